// \brief CUDA kernel of fused_ops::importance_sampling_backward, its only
// path ("tiled" in the importance_sampling_backward/cuda table, for every
// input): one cooperative launch, three phases separated by grid barriers.
// The math is in cpu/importance_sampling/backward.cpp; in short, with g_i = dL/dlw_i,
// coef_ik = g_i r_ik (r: the responsibilities, recomputed here) and
// z_ikd = (x_id - mu_kd) / std_kd (row K: the proposal, with coef_iK = g_i):
//
//   grad_x_id = g_i zq_id / q_std_d - sum_k coef_ik z_ikd / std_kd + w_i gM_d
//   S1_kd = sum_i coef_ik z_ikd,  S2_kd = sum_i coef_ik (z_ikd^2 - 1),  S0_k = sum_i coef_ik
//
// Phase A  Every block prepares a share of 1/std and the log-normalisers into
//          the workspace, zeroes its own partial-sum row, and writes its
//          partials of sum_i gL_i and (for the ESS gradient) of sum_i w_i and
//          sum_i w_i^2.
// Phase B  After the grid barrier every block adds those partials in the same
//          fixed order (all blocks agree bitwise on c = sum_i gL_i and S).  Blocks
//          then walk tiles of `tile` samples (grid-stride over tiles):
//            1. one thread per sample: the K log densities, the
//               responsibilities and g_i -> coef [tile, K + 2] (shared
//               memory, or the block's slice of the workspace when K is large);
//            2. grad_x for the tile's rows, one thread per element;
//            3. the tile's contribution to S1/S2/S0, one thread per entry
//               (split over R sample slices when there are few entries, the
//               slices added in order), added to the block's row of partials;
//               every entry is always updated by the same thread.
// Phase C  After the second grid barrier the partials are summed over blocks
//          in block order, one thread per entry, and scaled into the gradients.
//
// Per-sample arithmetic runs in the tensors' dtype, except the ESS term
// 2 w_i (S - w_i) / S^2 (S = sum_j w_j^2 = 1 / ess), which cancels near a
// dominant sample: it runs in double, with S and w_i both from log_weights
// (renormalised), never from the separately rounded forward output ess.  The
// sums over samples (tile slices, tiles, blocks) run in double.  No atomics;
// every sum has a fixed order, so results are bitwise reproducible for a
// given device and input size.  Workspace: O(grid * (K + 1) * D), bounded to
// ~256 MB by capping the grid.

#include <cooperative_groups.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <climits>
#include <optional>

#include "common/dispatch.h"
#include "common/logsumexp.h"
#include "cuda/primitives/cooperative.cuh"
#include "cuda/primitives/reductions.cuh"
#include "importance_sampling.h"

namespace fused_ops {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / cuda::kWarpSize;
// Coefficients in shared memory while a tile of at least kMinSmemTile samples fits here.
constexpr size_t kCoefSmemBytes = 32 * 1024;
constexpr int kMinSmemTile = 32;

template <typename T>
struct BackwardArgs {
  const T* grad_mean;  // [D] or nullptr (zero)
  const T* grad_ess;   // []  or nullptr
  const T* grad_lw;    // [N] or nullptr
  const T* x;          // [N, D]
  const T* mix_weights;  // [K]
  const T* mix_mus;      // [K, D]
  const T* mix_stds;     // [K, D]
  const T* q_mu;         // [D]
  const T* q_std;        // [D]
  const T* mean;         // [D] forward output
  const T* log_weights;  // [N] forward output (normalised)
  int64_t N;
  int D, K;
  int tile;  // samples per tile, <= kThreads
  T* grad_x;             // [N, D]
  T* grad_mix_weights;   // [K]
  T* grad_mix_mus;       // [K, D]
  T* grad_mix_stds;      // [K, D]
  T* grad_q_mu;          // [D]
  T* grad_q_std;         // [D]
  // Workspace (no initialisation needed: every entry is written before it is read).
  double* block_sums;  // [3, grid] per-block partials of sum_i gL_i, sum_i w_i, sum_i w_i^2
  T* inv_std;     // [(K + 1) * D] row K: the proposal
  T* log_norm;    // [K + 1]       log w_k - sum_d log std_kd; [K]: -sum_d log q_std_d
  double* block_acc;  // [grid, 2 * E] per-block S1 | S0 (E entries), then S2 (E entries)
  T* coef_global; // [grid, tile, K + 2] or nullptr (coefficients in shared memory)
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
importance_sampling_backward_kernel(const BackwardArgs<T> a) {
  extern __shared__ __align__(16) char smem_raw[];
  __shared__ double reduce_d[kWarps];
  __shared__ double partial[2 * kThreads];

  const int tid = threadIdx.x;
  const int D = a.D, K = a.K;
  const int64_t KD1 = int64_t(K + 1) * D;
  const int64_t E = KD1 + K;  // entries: (k, d) for k <= K, then S0_k for k < K
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + tid;
  const int64_t gthreads = int64_t(gridDim.x) * blockDim.x;
  double* acc = a.block_acc + int64_t(blockIdx.x) * 2 * E;

  // ---- Phase A ------------------------------------------------------------
  for (int64_t j = gtid; j < KD1; j += gthreads) {
    const int64_t k = j / D;
    const int64_t d = j - k * D;
    a.inv_std[j] = T(1) / (k < K ? a.mix_stds[j] : a.q_std[d]);
  }
  {
    // One warp per log-normaliser, lanes over d; warp-uniform loop bounds.
    const int lane = tid % cuda::kWarpSize;
    for (int64_t k = gtid / cuda::kWarpSize; k <= K; k += gthreads / cuda::kWarpSize) {
      const T* stds = k < K ? a.mix_stds + k * D : a.q_std;
      T log_det = 0;
      for (int d = lane; d < D; d += cuda::kWarpSize) log_det += std::log(stds[d]);
      log_det = cuda::group_allreduce(log_det, cuda::kWarpSize);
      if (lane == 0) a.log_norm[k] = (k < K ? std::log(a.mix_weights[k]) : T(0)) - log_det;
    }
  }
  for (int64_t p = tid; p < 2 * E; p += blockDim.x) acc[p] = 0;  // owner: thread p % blockDim.x
  {
    double s = 0, sw = 0, sw2 = 0;
    if (a.grad_lw) {
      for (int64_t i = gtid; i < a.N; i += gthreads) s += double(a.grad_lw[i]);
    }
    if (a.grad_ess) {
      for (int64_t i = gtid; i < a.N; i += gthreads) {
        const double w = exp(double(a.log_weights[i]));
        sw += w;
        sw2 += w * w;
      }
    }
    s = cuda::block_allreduce(s, reduce_d);
    sw = cuda::block_allreduce(sw, reduce_d);
    sw2 = cuda::block_allreduce(sw2, reduce_d);
    if (tid == 0) {
      a.block_sums[blockIdx.x] = s;
      a.block_sums[gridDim.x + blockIdx.x] = sw;
      a.block_sums[2 * gridDim.x + blockIdx.x] = sw2;
    }
  }

  cg::this_grid().sync();

  // ---- Phase B ------------------------------------------------------------
  double c_sum = 0, sum_w = 0, sum_w2 = 0;
  for (int b = tid; b < int(gridDim.x); b += blockDim.x) {
    c_sum += a.block_sums[b];
    sum_w += a.block_sums[gridDim.x + b];
    sum_w2 += a.block_sums[2 * gridDim.x + b];
  }
  const T c = T(cuda::block_allreduce(c_sum, reduce_d));
  sum_w = cuda::block_allreduce(sum_w, reduce_d);
  sum_w2 = cuda::block_allreduce(sum_w2, reduce_d);
  const double inv_sum_w = a.grad_ess ? 1.0 / sum_w : 0.0;
  const double S = sum_w2 * inv_sum_w * inv_sum_w;
  const double ess_coef = a.grad_ess ? double(*a.grad_ess) * 2.0 / (S * S) : 0.0;
  const int CS = K + 2;  // per sample: coef_0..coef_{K-1}, g, w
  T* coef = a.coef_global ? a.coef_global + int64_t(blockIdx.x) * a.tile * CS
                          : reinterpret_cast<T*>(smem_raw);
  const T* inv_std = a.inv_std;
  const int64_t num_tiles = (a.N + a.tile - 1) / a.tile;

  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t i0 = tile * a.tile;
    const int n = int(std::min<int64_t>(a.tile, a.N - i0));

    // 1. Per-sample coefficients.
    for (int t = tid; t < n; t += blockDim.x) {
      const int64_t i = i0 + t;
      const T* xi = a.x + i * D;
      T* cf = coef + int64_t(t) * CS;
      T max = -INFINITY;
      for (int k = 0; k < K; ++k) {
        const T* mu_k = a.mix_mus + int64_t(k) * D;
        const T* inv_k = inv_std + int64_t(k) * D;
        T sq = 0;
        for (int d = 0; d < D; ++d) {
          const T z = (xi[d] - mu_k[d]) * inv_k[d];
          sq += z * z;
        }
        const T lc = T(-0.5) * sq + a.log_norm[k];
        cf[k] = lc;
        max = nan_max(max, lc);
      }
      T sum = 0;
      for (int k = 0; k < K; ++k) {
        const T e = rel_exp(cf[k], max);
        cf[k] = e;
        sum += e;
      }
      const T w = std::exp(a.log_weights[i]);
      T dot = 0;
      if (a.grad_mean) {
        for (int d = 0; d < D; ++d) dot += (xi[d] - a.mean[d]) * a.grad_mean[d];
      }
      T g = (a.grad_lw ? a.grad_lw[i] : T(0)) - w * c + w * dot;
      if (a.grad_ess) {
        const double wn = exp(double(a.log_weights[i])) * inv_sum_w;
        g += T(ess_coef * wn * (S - wn));
      }
      const T g_over_sum = g / sum;
      for (int k = 0; k < K; ++k) cf[k] *= g_over_sum;
      cf[K] = g;
      cf[K + 1] = w;
    }
    __syncthreads();

    // 2. grad_x of the tile's rows.
    for (int64_t e = tid; e < int64_t(n) * D; e += blockDim.x) {
      const int64_t t = e / D;
      const int d = int(e - t * D);
      const int64_t i = i0 + t;
      const T* cf = coef + t * CS;
      const T xv = a.x[i * D + d];
      const T q_inv = inv_std[int64_t(K) * D + d];
      T gx = cf[K] * (xv - a.q_mu[d]) * q_inv * q_inv;
      for (int k = 0; k < K; ++k) {
        const T inv = inv_std[int64_t(k) * D + d];
        gx -= cf[k] * (xv - a.mix_mus[int64_t(k) * D + d]) * inv * inv;
      }
      if (a.grad_mean) gx += cf[K + 1] * a.grad_mean[d];
      a.grad_x[i * D + d] = gx;
    }

    // 3. The tile's S1/S2/S0 contributions over samples t = first, first + step, ...
    auto entry_sums = [&](int64_t p, int first, int step, double& s1, double& s2) {
      s1 = 0;
      s2 = 0;
      if (p < KD1) {
        const int64_t k = p / D;
        const int64_t d = p - k * D;
        const T mu = k < K ? a.mix_mus[p] : a.q_mu[d];
        const T inv = inv_std[p];
        for (int t = first; t < n; t += step) {
          const T z = (a.x[(i0 + t) * D + d] - mu) * inv;
          const T cf = coef[int64_t(t) * CS + k];  // k == K: g
          s1 += double(cf * z);
          s2 += double(cf * (z * z - T(1)));
        }
      } else {
        const int64_t k = p - KD1;
        for (int t = first; t < n; t += step) s1 += double(coef[int64_t(t) * CS + k]);
      }
    };
    const int R = int(std::max<int64_t>(1, std::min<int64_t>(n, blockDim.x / E)));
    if (R == 1) {
      for (int64_t p = tid; p < E; p += blockDim.x) {
        double s1, s2;
        entry_sums(p, 0, 1, s1, s2);
        acc[p] += s1;
        acc[E + p] += s2;
      }
    } else {
      // R * E <= blockDim.x: thread tid sums slice r = tid / E of entry tid % E.
      if (tid < R * E) {
        double s1, s2;
        entry_sums(tid % E, int(tid / E), R, s1, s2);
        partial[tid] = s1;
        partial[kThreads + tid] = s2;
      }
      __syncthreads();
      if (tid < E) {
        double s1 = 0, s2 = 0;
        for (int r = 0; r < R; ++r) {
          s1 += partial[r * E + tid];
          s2 += partial[kThreads + r * E + tid];
        }
        acc[tid] += s1;
        acc[E + tid] += s2;
      }
    }
    __syncthreads();  // coef and partial are rewritten by the next tile
  }

  cg::this_grid().sync();

  // ---- Phase C ------------------------------------------------------------
  const int num_blocks = gridDim.x;
  for (int64_t p = gtid; p < E; p += gthreads) {
    double s1 = 0, s2 = 0;
    for (int b = 0; b < num_blocks; ++b) {
      const double* row = a.block_acc + int64_t(b) * 2 * E;
      s1 += row[p];
      s2 += row[E + p];
    }
    if (p < KD1) {
      const int64_t k = p / D;
      const int64_t d = p - k * D;
      const double inv = inv_std[p];
      if (k < K) {
        a.grad_mix_mus[p] = T(s1 * inv);
        a.grad_mix_stds[p] = T(s2 * inv);
      } else {
        a.grad_q_mu[d] = T(-s1 * inv);
        a.grad_q_std[d] = T(-s2 * inv);
      }
    } else {
      const int64_t k = p - KD1;
      a.grad_mix_weights[k] = T(s1 / double(a.mix_weights[k]));
    }
  }
}

template <typename T>
void importance_sampling_backward_launch(const ImportanceSamplingBackwardCall& c) {
  BackwardArgs<T> a{};
  a.grad_mean = cdata_or_null<T>(c.grad_mean);
  a.grad_ess = cdata_or_null<T>(c.grad_ess);
  a.grad_lw = cdata_or_null<T>(c.grad_lw);
  a.x = cdata<T>(c.x);
  a.mix_weights = cdata<T>(c.mix_weights);
  a.mix_mus = cdata<T>(c.mix_mus);
  a.mix_stds = cdata<T>(c.mix_stds);
  a.q_mu = cdata<T>(c.q_mu);
  a.q_std = cdata<T>(c.q_std);
  a.mean = cdata<T>(c.weighted_mean);
  a.log_weights = cdata<T>(c.log_weights);
  a.N = c.N;
  a.D = int(c.D);
  a.K = int(c.K);
  a.grad_x = mdata<T>(c.grad_x);
  a.grad_mix_weights = mdata<T>(c.grad_mix_weights);
  a.grad_mix_mus = mdata<T>(c.grad_mix_mus);
  a.grad_mix_stds = mdata<T>(c.grad_mix_stds);
  a.grad_q_mu = mdata<T>(c.grad_q_mu);
  a.grad_q_std = mdata<T>(c.grad_q_std);
  const int64_t N = c.N, D = c.D, K = c.K;
  const int64_t E = (K + 1) * D + K;
  const int64_t CS = K + 2;

  // Tiles: about one per SM for small N (more blocks busy), at most one
  // sample per thread, a multiple of 32.  Coefficients in shared memory when
  // a tile of at least kMinSmemTile samples fits, else in the workspace.
  const int sms = cuda::multiprocessor_count(cuda::current_device());
  int64_t tile = (N + sms - 1) / sms;
  tile = std::clamp<int64_t>((tile + 31) / 32 * 32, 32, kThreads);
  const int64_t smem_tile = int64_t(kCoefSmemBytes) / (CS * int64_t(sizeof(T)));
  const bool coef_in_smem = smem_tile >= kMinSmemTile;
  if (coef_in_smem) tile = std::min(tile, smem_tile);
  a.tile = int(tile);
  const size_t smem = coef_in_smem ? size_t(tile * CS) * sizeof(T) : 0;

  auto kernel = importance_sampling_backward_kernel<T>;
  const int64_t num_tiles = (N + tile - 1) / tile;
  int64_t grid = std::min(cuda::max_resident_blocks(kernel, kThreads, smem), num_tiles);
  // Bound the per-block workspace (partials, and coefficients when not in
  // shared memory) to ~256 MB.
  const int64_t per_block =
      2 * E * int64_t(sizeof(double) / sizeof(T)) + (coef_in_smem ? 0 : tile * CS);
  grid = std::min(grid, (int64_t(256) << 20) / int64_t(sizeof(T)) / std::max<int64_t>(per_block, 1));
  grid = std::max<int64_t>(grid, 1);

  // One workspace allocation, carved into 16-byte aligned arrays.
  auto count = [](int64_t n) { return (n * int64_t(sizeof(T)) + 15) / 16 * 16 / int64_t(sizeof(T)); };
  // Arrays of doubles: count(2 * n) T elements hold n doubles when T is float.
  constexpr int64_t kDoubleT = int64_t(sizeof(double) / sizeof(T));
  const int64_t n_sums = count(3 * grid * kDoubleT);
  const int64_t n_inv = count((K + 1) * D), n_norm = count(K + 1);
  const int64_t n_acc = count(grid * 2 * E * kDoubleT);
  const int64_t n_coef = coef_in_smem ? 0 : count(grid * tile * CS);
  Tensor workspace = empty_like_device(c.x, {n_sums + n_inv + n_norm + n_acc + n_coef});
  T* w = mdata<T>(workspace);
  a.block_sums = reinterpret_cast<double*>(w);  // every array starts 16-byte aligned
  a.inv_std = w + n_sums;
  a.log_norm = a.inv_std + n_inv;
  a.block_acc = reinterpret_cast<double*>(a.log_norm + n_norm);
  a.coef_global = coef_in_smem ? nullptr : a.log_norm + n_norm + n_acc;

  cuda::launch_cooperative(kernel, grid, kThreads, smem, a);
}

void launch_tiled(const ImportanceSamplingBackwardCall& c) {
  dispatch_float(c.x.scalar_type(),
                 [&](auto zero) { importance_sampling_backward_launch<decltype(zero)>(c); });
}

// One path: a table all the same, so that tests and tools can name and
// report it like every other op's.
const dispatch::PathTable<ImportanceSamplingBackwardCall, 1> kPaths(
    "importance_sampling_backward", "cuda",
    {{
        {"tiled", "any input", "one cooperative launch over tiles of samples; no atomics, fixed-order sums",
         dispatch::always<ImportanceSamplingBackwardCall>, launch_tiled},
    }});

ImportanceSamplingGrads importance_sampling_backward_cuda(
    const std::optional<Tensor>& grad_weighted_mean, const std::optional<Tensor>& grad_ess,
    const std::optional<Tensor>& grad_log_weights, const Tensor& samples,
    const Tensor& mix_weights, const Tensor& mix_mus, const Tensor& mix_stds, const Tensor& q_mu,
    const Tensor& q_std, const Tensor& weighted_mean, const Tensor& log_weights) {
  const cuda::TensorDeviceGuard guard(samples);
  ImportanceSamplingBackwardCall c(grad_weighted_mean, grad_ess, grad_log_weights, samples,
                                   mix_weights, mix_mus, mix_stds, q_mu, q_std, weighted_mean,
                                   log_weights);
  FUSED_OPS_CHECK(samples.is_cuda(), "samples must be a CUDA tensor, got ", device_str(samples));
  FUSED_OPS_CHECK(c.D <= INT_MAX / 2 && c.K <= INT_MAX / 2,
                  "importance_sampling_backward: D and K must fit in int32, got D=", c.D,
                  ", K=", c.K);
  kPaths.run(c);
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("importance_sampling_backward", TORCH_BOX(&importance_sampling_backward_cuda));
}

}  // namespace fused_ops
