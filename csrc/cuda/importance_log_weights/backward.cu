// \brief importance_log_weights_backward, CUDA path "tiled": per-sample
// gradients and per-block partial sums of the parameter gradients, reduced
// in a fixed order by a second kernel.
//
// What (csrc/cpu/importance_log_weights/backward.cpp states the math): with
// g_i the upstream gradient, the coefficients a_ij = +-g_i r_ij (target /
// proposal responsibilities), z_ijd = (x_id - mu_jd) / std_jd:
//   grad_x_id = -sum_j a_ij z_ijd / std_jd, and the sums over samples
//   S1_jd = sum_i a_ij z_ijd, S2_jd = sum_i a_ij (z_ijd^2 - 1), S0_j = sum_i a_ij,
// scaled into grad_mu = S1 / std, grad_std = S2 / std, grad_w = S0 / w.
// When: every input (the table's only backward path).
// Design.  Three launches: `prepare` (paths.cuh); `tiled_rows`, a 1-D grid
// of B * P blocks of 256 threads, P = min(tiles of the problem, ceil(8 SMs /
// B)) blocks per problem, block p walking the problem's tiles p, p + P, ...
// of TILE rows (TILE = 256 while the coefficient tile [TILE, J] of doubles
// fits 32 KB, i.e. J <= 16; fewer rows, a multiple of 32, up to J = 128;
// beyond that TILE = 32 with the tile in a global workspace slice of the
// block).  Per tile, one thread per row computes the row's two log-sum-exps,
// its coefficients into the tile and its grad_x row (in double, written
// once per element); then one thread per entry (j, d) (and per j for S0)
// adds the tile's rows in row order to the block's partial row [2 J D + J]
// in a global workspace (each entry always updated by the same thread);
// `finish`, one block per problem, adds the P partials in block order and
// scales them.  All arithmetic in double, as on the CPU; no atomics: bitwise reproducible on one device
// (P depends on the SM count).  Workspace O(B P (2 J D + J)) doubles.

#include <climits>

#include "cuda/importance_log_weights/paths.cuh"

namespace fused_ops {
namespace importance_log_weights_paths {
namespace {

constexpr size_t kCoefBudget = 32 * 1024;

template <typename T>
struct Grads {
  const T *x, *g;  // [B, N, D], [B, N]
  T *gx, *gmw, *gmm, *gms, *gqw, *gqm, *gqs;
  double* part;         // [B * P, 2 J D + J]
  double* coef_global;  // [B * P, TILE, J] when the tile does not fit shared memory, else nullptr
  int64_t P;
  int tile;
  bool staged;
  size_t coef_offset;  // byte offset of the coefficient tile in shared memory
};

__device__ __forceinline__ double over_std(double v, double r, bool divide) { return divide ? v / r : v * r; }

template <typename T>
__global__ void __launch_bounds__(kThreads) tiled_rows(const Params<T> p, const Grads<T> a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t b = blockIdx.x / a.P, pb = blockIdx.x % a.P;
  const Staged<T> s = stage(p, b, a.staged, smem);
  const int J = p.J, D = p.D, K = p.K;
  const int64_t JD = int64_t(J) * D, stride = 2 * JD + J;
  double* coef = a.coef_global ? a.coef_global + int64_t(blockIdx.x) * a.tile * J
                               : reinterpret_cast<double*>(smem + a.coef_offset);
  double* part = a.part + int64_t(blockIdx.x) * stride;
  const int64_t tiles = (p.N + a.tile - 1) / a.tile;
  bool first = true;
  for (int64_t t = pb; t < tiles; t += a.P, first = false) {
    const int64_t i0 = t * a.tile;
    if (threadIdx.x < a.tile) {
      double* c = coef + int64_t(threadIdx.x) * J;
      const int64_t i = i0 + threadIdx.x;
      if (i < p.N) {
        const int64_t row = b * p.N + i;
        const T* xr = a.x + row * D;
        LogSumExp<double> lp, lq;
        row_log_sums(p, s, xr, lp, lq);
        const double gi = double(a.g[row]), Lp = lp.value(), Lq = lq.value();
        // exp(-inf - -inf) = NaN where every density of the row is zero, as
        // the reference's logsumexp backward gives.
        for (int j = 0; j < J; ++j) {
          const double lc = component_log_density(p, s, xr, j);
          c[j] = j < K ? gi * exp(lc - Lp) : -gi * exp(lc - Lq);
        }
        T* gxr = a.gx + row * D;
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          for (int j = 0; j < J; ++j) {
            const bool divide = s.divide[j] != 0;
            const double r = s.r_of(p, j)[d];
            const double z = z_of(xr[d], s.mu_of(p, j)[d], r, divide);
            acc -= over_std(c[j] * z, r, divide);
          }
          gxr[d] = T(acc);
        }
      } else {
        for (int j = 0; j < J; ++j) c[j] = 0;  // rows past N weigh nothing
      }
    }
    __syncthreads();
    const int rows = p.N - i0 < a.tile ? int(p.N - i0) : a.tile;
    for (int64_t e = threadIdx.x; e < JD + J; e += blockDim.x) {
      if (e < JD) {
        const int j = int(e / D), d = int(e % D);
        const T mu = s.mu_of(p, j)[d];
        const double r = s.r_of(p, j)[d];
        const bool divide = s.divide[j] != 0;
        double s1 = 0, s2 = 0;
        for (int q = 0; q < rows; ++q) {
          const double z = z_of(a.x[(b * p.N + i0 + q) * D + d], mu, r, divide);
          const double cq = coef[int64_t(q) * J + j];
          s1 += cq * z;
          s2 += cq * (z * z - 1);
        }
        part[e] = first ? s1 : part[e] + s1;
        part[JD + e] = first ? s2 : part[JD + e] + s2;
      } else {
        const int j = int(e - JD);
        double s0 = 0;
        for (int q = 0; q < rows; ++q) s0 += coef[int64_t(q) * J + j];
        part[2 * JD + j] = first ? s0 : part[2 * JD + j] + s0;
      }
    }
    __syncthreads();  // the next tile overwrites the coefficients
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) finish(const Params<T> p, const Grads<T> a) {
  const int64_t b = blockIdx.x;
  const int J = p.J, D = p.D, K = p.K, Kq = p.Kq;
  const int64_t JD = int64_t(J) * D, stride = 2 * JD + J;
  const double* part = a.part + b * a.P * stride;
  for (int64_t e = threadIdx.x; e < JD + J; e += blockDim.x) {
    if (e < JD) {
      double s1 = 0, s2 = 0;
      for (int64_t q = 0; q < a.P; ++q) {
        s1 += part[q * stride + e];
        s2 += part[q * stride + JD + e];
      }
      const int j = int(e / D), d = int(e % D);
      const double r = p.r[b * JD + e];
      const bool divide = p.divide[b * J + j] != 0;
      T* gm = j < K ? a.gmm + (b * K + j) * D : a.gqm + (b * Kq + (j - K)) * D;
      T* gs = j < K ? a.gms + (b * K + j) * D : a.gqs + (b * Kq + (j - K)) * D;
      gm[d] = T(over_std(s1, r, divide));
      gs[d] = T(over_std(s2, r, divide));
    } else {
      const int j = int(e - JD);
      double s0 = 0;
      for (int64_t q = 0; q < a.P; ++q) s0 += part[q * stride + 2 * JD + j];
      const double w = double(p.weight_of(b, j));
      (j < K ? a.gmw[b * K + j] : a.gqw[b * Kq + (j - K)]) = T(s0 / w);
    }
  }
}

template <typename T>
void launch_tiled_typed(const ImportanceLogWeightsBackwardCall& c) {
  const int device = cuda::current_device();
  const cudaStream_t stream = cuda::current_stream(device);
  const int64_t J = c.K + c.Kq, JD = J * c.D, stride = 2 * JD + J;
  // The coefficient tile: 256 rows while it fits kCoefBudget, else fewer (a
  // multiple of 32), else 32 rows in global memory.
  int tile = kThreads;
  while (tile > 32 && size_t(tile) * J * sizeof(double) > kCoefBudget) tile -= 32;
  const bool coef_in_smem = size_t(tile) * J * sizeof(double) <= kCoefBudget;
  const int64_t tiles = (c.N + tile - 1) / tile;
  const int sms = cuda::multiprocessor_count(device);
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(tiles, (int64_t(8) * sms + c.B - 1) / c.B));
  const size_t staged = (staged_bytes(J, c.D, sizeof(T)) + 15) / 16 * 16;
  const size_t coef_bytes = coef_in_smem ? size_t(tile) * J * sizeof(double) : 0;
  const bool stage_params = staged + coef_bytes <= kSharedBudget;
  const int64_t blocks = c.B * P;
  FUSED_OPS_CHECK(blocks <= INT_MAX, "importance_log_weights_backward: too many problems for one grid (B=", c.B,
                  ")");
  const int64_t prep = prepared_doubles(c.B, J, c.D);
  const Tensor ws = float64_workspace(c.x, prep + blocks * stride + (coef_in_smem ? 0 : blocks * tile * J),
                                      "importance_log_weights");
  double* w = mdata<double>(ws);
  const Params<T> p = make_params<T>(c, w);
  Grads<T> a;
  a.x = cdata<T>(c.x), a.g = cdata<T>(c.grad_lw), a.gx = mdata<T>(c.grad_x);
  a.gmw = mdata<T>(c.grad_mix_weights), a.gmm = mdata<T>(c.grad_mix_mus), a.gms = mdata<T>(c.grad_mix_stds);
  a.gqw = mdata<T>(c.grad_q_weights), a.gqm = mdata<T>(c.grad_q_mus), a.gqs = mdata<T>(c.grad_q_stds);
  a.part = w + prep;
  a.coef_global = coef_in_smem ? nullptr : a.part + blocks * stride;
  a.P = P, a.tile = tile, a.staged = stage_params;
  a.coef_offset = stage_params ? staged : 0;
  launch_prepare(p, stream);
  tiled_rows<T><<<unsigned(blocks), kThreads, a.coef_offset + coef_bytes, stream>>>(p, a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  finish<T><<<unsigned(c.B), kThreads, 0, stream>>>(p, a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void launch_tiled_backward(const ImportanceLogWeightsBackwardCall& c) {
  dispatch_float(c.x.scalar_type(), [&](auto zero) { launch_tiled_typed<decltype(zero)>(c); });
}

}  // namespace importance_log_weights_paths
}  // namespace fused_ops
