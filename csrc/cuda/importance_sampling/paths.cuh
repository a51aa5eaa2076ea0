// \brief What the two importance_sampling kernels (fast.cu, general.cu) share:
// the kernel arguments, the phase code both run, the host-side plan of the
// fast path (its predicate) and the grid / workspace set-up of a launch.
//
// Both kernels are one cooperative launch of kThreads-thread blocks:
//
// Phase 1  Each sample row is handled by a group of G lanes (a power of two,
//          as few as hold the row in <= kLaneElems registers each on the fast
//          path: one thread per sample for D <= 16) that read it with
//          vectorised loads; the group reduces the K mixture terms and the
//          proposal term to the log weight lw.  Few lanes per row means little
//          redundant exp/log work.  Every group keeps an online-softmax state
//          over the samples it visits (running max m, sum e, sum e^2 and sum
//          e*x with e = exp(lw - m)), so x is read from memory exactly once.
//          Groups merge into one partial per block (write_block_partial),
//          written to a workspace.
// Phase 2  After a grid barrier every block merges the per-block (max, sum)
//          pairs in the same fixed order (so all blocks agree bitwise on the
//          normaliser), normalises its share of log_weights, and the
//          weighted-mean / ESS sums are spread over blocks by dimension
//          (finish).
//
// No atomics: every reduction has a fixed order, so results are bitwise
// reproducible for a given device and input size.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "common/logsumexp.h"
#include "cuda/primitives/cooperative.cuh"
#include "cuda/primitives/reductions.cuh"
#include "importance_sampling.h"

namespace fused_ops {
namespace {

using cuda::Vec;
namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / cuda::kWarpSize;
// Row elements a lane keeps in registers on the fast path.  16 keeps register
// use near 100 per thread (the row slice plus its weighted-sum accumulators).
constexpr int kLaneElems = 16;
constexpr int kMaxFastD = cuda::kWarpSize * kLaneElems;
// Fast path only while its shared memory leaves room for two blocks per SM.
constexpr size_t kMaxFastSmem = 96 * 1024;

template <typename T>
struct Args {
  const T* x;            // [N, D]
  const T* mix_weights;  // [K]
  const T* mix_mus;      // [K, D]
  const T* mix_stds;     // [K, D]
  const T* q_mu;         // [D]
  const T* q_std;        // [D]
  int64_t N;
  int D, K;
  int group_size;        // lanes per sample row
  T* weighted_mean;      // [D]
  T* ess;                // []
  T* log_weights;        // [N]
  // Workspace (no initialisation needed: every entry is written before it is read).
  LogSumExp<T>* block_lse;  // [grid]      per-block (max, sum exp(lw - max))
  T* block_sum_sq;          // [grid]      per-block sum exp(2 (lw - max))
  T* block_wsum;            // [D, grid]   per-block sum exp(lw - max) x, block-minor
  T* prepared;              // general path: 1/std [K*D], q 1/std [D], log-normalisers [K+1]
  T* group_wsum;            // general path: per-group sum exp(lw - m) x, [groups, D]
};

// Subnormal stds.  1/std overflows below 2^-128 (float32; 2^-1024 float64),
// and z = (x - mu) * inf would make a sample at the mean 0 * inf = NaN where
// the reference's (x - mu) / std is 0, and a sample near it inf where the
// reference's quotient is finite.  Calls with such a std divide by std, as the
// reference does; others multiply by 1/std.  The fast kernel runs the
// dividing case in a separate, plain loop (fast.cu), so the common case keeps
// its registers (a second copy of the register-resident loop, or one more
// operand per element, costs it occupancy).  std = 0 gives the reference's
// inf or NaN either way.  std_overflows: whether some 1/std of the call
// overflows, block-uniform (every block scans all stds, so the grid agrees).
template <typename T>
__device__ bool std_overflows(const Args<T>& a) {
  const int64_t KD = int64_t(a.K) * a.D;
  bool found = false;
  for (int64_t j = threadIdx.x; j < KD + a.D; j += blockDim.x) {
    const T sd = j < KD ? a.mix_stds[j] : a.q_std[j - KD];
    found |= sd != T(0) && isinf(T(1) / sd);
  }
  return __syncthreads_or(found);
}

// Mixture parameters in the form the inner loop wants: z = (x - mu) * inv_std,
// log-normaliser log w_k - sum_d log std_kd (index K: the proposal's,
// -sum_d log q_std_d).  Fills inv_std / q_inv_std / log_norm (and copies mu /
// q_mu when given destinations), split over `num_threads` cooperating threads
// with index `tid`.  Rows are stored `stride` >= D apart; the padding is zero
// (mu = inv_std = 0 makes a zero-padded x contribute exactly 0), which lets
// the fast kernel read whole chunks without bounds checks.  Each
// log-normaliser is summed by one warp in a fixed order.
//
// `divide` (std_overflows): store std itself in inv_std (padding 1).
template <typename T>
__device__ void prepare_parameters(const Args<T>& a, int stride, T* mu, T* inv_std, T* q_mu,
                                   T* q_inv_std, T* log_norm, int64_t tid, int64_t num_threads,
                                   bool divide) {
  const int D = a.D;
  for (int64_t j = tid; j < int64_t(a.K + 1) * stride; j += num_threads) {
    const int64_t k = j / stride;
    const int d = int(j - k * stride);
    const bool is_q = k == a.K, inside = d < D;
    const T sd = inside ? (is_q ? a.q_std[d] : a.mix_stds[k * D + d]) : T(0);
    const T inv = divide ? (inside ? sd : T(1)) : (inside ? T(1) / sd : T(0));
    (is_q ? q_inv_std[d] : inv_std[j]) = inv;
    if (mu) (is_q ? q_mu[d] : mu[j]) = inside ? (is_q ? a.q_mu[d] : a.mix_mus[k * D + d]) : T(0);
  }
  const int lane = threadIdx.x % cuda::kWarpSize;
  for (int64_t k = tid / cuda::kWarpSize; k <= a.K; k += num_threads / cuda::kWarpSize) {
    const T* stds = k < a.K ? a.mix_stds + k * D : a.q_std;
    T log_det = 0;
    for (int d = lane; d < D; d += cuda::kWarpSize) log_det += std::log(stds[d]);
    log_det = cuda::group_allreduce(log_det, cuda::kWarpSize);
    if (lane == 0) log_norm[k] = (k < a.K ? std::log(a.mix_weights[k]) : T(0)) - log_det;
  }
}

// Online-softmax state of one group (lanes hold their own slices of wsum).
template <typename T>
struct GroupState {
  T max = -INFINITY, sum = 0, sum_sq = 0;

  // Adds a sample with log weight lw; returns the factor to rescale the
  // running weighted sums by, and the sample's own weight in `e`.
  // One exp per sample, as in LogSumExp::push.
  __device__ __forceinline__ T push(T lw, T& e) {
    const bool up = lw > max;
    const T f = rel_exp(up ? max : lw, up ? lw : max);
    const T scale = up ? f : T(1);
    e = up ? T(1) : f;
    sum = sum * scale + e;
    sum_sq = sum_sq * scale * scale + e * e;
    max = up ? lw : max;
    return scale;
  }
};

// Shared memory of one block: the merge of its groups' states.
template <typename T>
struct BlockScratch {
  T* group_max;     // [groups]
  T* group_sum;     // [groups]
  T* group_sum_sq;  // [groups]
  T* group_scale;   // [groups] exp(group max - block max)
};

// Merges the groups' states into the block's partial (workspace), given each
// group's weighted sums through `group_wsum(g, d)`.  `partial` holds blockDim.x
// values.
template <typename T, typename GroupWsum>
__device__ void write_block_partial(const Args<T>& a, const BlockScratch<T>& s, int groups,
                                    GroupWsum group_wsum, T* reduce_t, LogSumExp<T>* reduce_lse,
                                    T* partial) {
  const int tid = threadIdx.x, D = a.D;
  LogSumExp<T> mine = LogSumExp<T>::empty();
  if (tid < groups) mine = {s.group_max[tid], s.group_sum[tid]};
  const LogSumExp<T> block = cuda::block_allreduce(mine, reduce_lse, cuda::MergeLogSumExp{});
  T sq = 0;
  if (tid < groups) {
    const T f = rel_exp(s.group_max[tid], block.max);
    s.group_scale[tid] = f;
    sq = s.group_sum_sq[tid] * f * f;
  }
  sq = cuda::block_allreduce(sq, reduce_t);  // its barriers also publish group_scale
  // Weighted sums over the groups.  For short rows the groups are split into R
  // slices so that every thread works (D = 16: 16 slices of 16 groups), then
  // the slices are added in order.
  const int R = (D > 0 && D < int(blockDim.x)) ? std::min(groups, int(blockDim.x) / D) : 1;
  const int64_t out = int64_t(blockIdx.x);
  if (R == 1) {
    for (int d = tid; d < D; d += blockDim.x) {
      T acc = 0;
      for (int g = 0; g < groups; ++g) acc += group_wsum(g, d) * s.group_scale[g];
      a.block_wsum[int64_t(d) * gridDim.x + out] = acc;
    }
  } else {
    if (tid < R * D) {
      const int d = tid % D;
      T acc = 0;
      for (int g = tid / D; g < groups; g += R) acc += group_wsum(g, d) * s.group_scale[g];
      partial[tid] = acc;
    }
    __syncthreads();
    if (tid < D) {
      T acc = 0;
      for (int r = 0; r < R; ++r) acc += partial[r * D + tid];
      a.block_wsum[int64_t(tid) * gridDim.x + out] = acc;
    }
  }
  if (tid == 0) {
    a.block_lse[blockIdx.x] = block;
    a.block_sum_sq[blockIdx.x] = sq;
  }
}

// Phase 2: runs in every block after the grid barrier.
template <typename T>
__device__ void finish(const Args<T>& a, T* reduce_scratch_t, LogSumExp<T>* reduce_scratch_lse) {
  const int tid = threadIdx.x;
  const int num_blocks = gridDim.x;
  LogSumExp<T> total = LogSumExp<T>::empty();
  for (int b = tid; b < num_blocks; b += blockDim.x) total = LogSumExp<T>::merge(total, a.block_lse[b]);
  total = cuda::block_allreduce(total, reduce_scratch_lse, cuda::MergeLogSumExp{});

  // A NaN or +inf log weight, or all of them -inf, leaves no normaliser: every
  // output is NaN, as the reference's mean and ESS are.
  const bool defined = isfinite(total.max);
  const T nan = T(NAN);
  // log w_i = (lw_i - max) - log(sum): the maximum comes off first, so huge
  // log weights keep their differences (max + log(sum) would round log(sum)
  // away once |max| is beyond 2^24 log(sum) in float32).
  const T log_sum = defined ? std::log(total.sum) : nan;
  const int64_t stride = int64_t(num_blocks) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + tid; i < a.N; i += stride) {
    a.log_weights[i] = (a.log_weights[i] - total.max) - log_sum;
  }
  // Weighted mean: dimensions spread over blocks, block partials rescaled to the global max.
  for (int d = blockIdx.x; d < a.D; d += num_blocks) {
    T acc = 0;
    for (int b = tid; b < num_blocks; b += blockDim.x) {
      acc += a.block_wsum[int64_t(d) * num_blocks + b] * rel_exp(a.block_lse[b].max, total.max);
    }
    acc = cuda::block_allreduce(acc, reduce_scratch_t);
    if (tid == 0) a.weighted_mean[d] = defined ? acc / total.sum : nan;
  }
  if (blockIdx.x == num_blocks - 1) {
    T acc = 0;
    for (int b = tid; b < num_blocks; b += blockDim.x) {
      const T f = rel_exp(a.block_lse[b].max, total.max);
      acc += a.block_sum_sq[b] * f * f;
    }
    acc = cuda::block_allreduce(acc, reduce_scratch_t);
    // sum_i w_i^2 = acc / total.sum^2 with w_i = exp(lw_i - max) / total.sum.
    if (tid == 0) *a.ess = defined ? total.sum * total.sum / acc : nan;
  }
}

template <typename T>
__device__ __forceinline__ T* carve(char*& p, int64_t count) {
  T* out = reinterpret_cast<T*>(p);
  p += (count * sizeof(T) + 15) / 16 * 16;  // keep every array 16-byte aligned
  return out;
}

// ---- Host side ------------------------------------------------------------

inline int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

inline size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// The fast path's configuration for a call: as few lanes per row (G) as hold
// it in registers, VEC-element loads when D and the samples' pointer allow
// them, and the shared memory the prepared parameters (rows zero-padded to
// G * kLaneElems) and the groups' weighted sums take.  `fits`: the fast
// kernel can run this call (its predicate).
struct FastPlan {
  bool vectorised;
  int group_size, groups;
  size_t smem;
  bool fits;
};

template <typename T>
FastPlan fast_plan(const ImportanceSamplingCall& c) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t D = c.D, K = c.K;
  const bool vectorised = D % kVec == 0 && reinterpret_cast<uintptr_t>(cdata<T>(c.x)) % 16 == 0;
  const int vec = vectorised ? kVec : 1;
  const int64_t num_chunks = D / vec, chunks_per_lane = kLaneElems / vec;
  const int G = next_pow2(int(std::max<int64_t>(1, (num_chunks + chunks_per_lane - 1) / chunks_per_lane)));
  const int groups = kWarps * (cuda::kWarpSize / G);
  const int64_t stride = int64_t(G) * kLaneElems;  // zero-padded parameter row
  const size_t params_bytes = 2 * align16(K * stride * sizeof(T)) +
                              2 * align16(stride * sizeof(T)) + align16((K + 1) * sizeof(T));
  const size_t smem = params_bytes + align16(groups * D * sizeof(T)) + 4 * align16(groups * sizeof(T));
  return {vectorised, G, groups, smem, D <= kMaxFastD && smem <= kMaxFastSmem};
}

// The call's tensors as kernel arguments (group size and workspace unset).
template <typename T>
Args<T> make_args(const ImportanceSamplingCall& c) {
  Args<T> a{};
  a.x = cdata<T>(c.x);
  a.mix_weights = cdata<T>(c.mix_weights);
  a.mix_mus = cdata<T>(c.mix_mus);
  a.mix_stds = cdata<T>(c.mix_stds);
  a.q_mu = cdata<T>(c.q_mu);
  a.q_std = cdata<T>(c.q_std);
  a.N = c.N;
  a.D = int(c.D);
  a.K = int(c.K);
  a.weighted_mean = mdata<T>(c.weighted_mean);
  a.ess = mdata<T>(c.ess);
  a.log_weights = mdata<T>(c.log_weights);
  return a;
}

// Sizes the grid, allocates and carves the workspace, and launches `kernel`
// cooperatively.  One group per row at a time; the grid is as large as can be
// resident (the grid barrier needs every block resident) or as the rows need,
// if fewer.  `general`: the general kernel, which also needs the prepared
// parameters and the per-group weighted sums in the workspace.
template <typename T>
void launch_with_workspace(void (*kernel)(const Args<T>), Args<T>& a, bool general, int groups,
                           size_t smem, const ImportanceSamplingCall& c) {
  const int64_t D = a.D, K = a.K;
  int64_t grid = std::min(cuda::max_resident_blocks(kernel, kThreads, smem),
                          (a.N + groups - 1) / groups);
  if (general) {
    // Bound the per-group weighted-sum workspace (grid * groups * D) to ~256 MB.
    const int64_t cap = (int64_t(256) << 20) / int64_t(sizeof(T)) / (int64_t(groups) * std::max<int64_t>(D, 1));
    grid = std::min(grid, cap);
  }
  grid = std::max<int64_t>(grid, 1);

  // One workspace allocation, carved into 16-byte aligned arrays.
  auto count = [](int64_t n) { return (n * int64_t(sizeof(T)) + 15) / 16 * 16 / int64_t(sizeof(T)); };
  const int64_t n_lse = count(2 * grid), n_sq = count(grid), n_wsum = count(D * grid);
  const int64_t n_prep = general ? count(K * D + D + K + 1) : 0;
  const int64_t n_group = general ? count(grid * groups * D) : 0;
  Tensor workspace = empty_like_device(c.x, {n_lse + n_sq + n_wsum + n_prep + n_group});
  T* w = mdata<T>(workspace);
  a.block_lse = reinterpret_cast<LogSumExp<T>*>(w);
  a.block_sum_sq = w + n_lse;
  a.block_wsum = a.block_sum_sq + n_sq;
  a.prepared = a.block_wsum + n_wsum;
  a.group_wsum = a.prepared + n_prep;

  cuda::launch_cooperative(kernel, grid, kThreads, smem, a);
}

}  // namespace

// Predicates and launchers of the importance_sampling/cuda path table
// (dispatch.cu).
namespace importance_sampling_paths {

bool fast_applies(const ImportanceSamplingCall& c);
void launch_fast(const ImportanceSamplingCall& c);
void launch_general(const ImportanceSamplingCall& c);

}  // namespace importance_sampling_paths
}  // namespace fused_ops
