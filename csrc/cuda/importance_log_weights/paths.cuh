// \brief What the CUDA forward (rows.cu) and backward (backward.cu) of
// fused_ops::importance_log_weights share: the prepared parameters, the
// parameter staging in shared memory, one component's log density, the
// workspace, and the path launchers that dispatch.cu's tables name.
//
// Components j = 0 .. J-1 of problem b, J = K + Kq: j < K the target's,
// j >= K the proposal's.  `prepare` (one warp per (b, j), lanes strided over
// d, the sum of log std in double in a fixed butterfly order) writes
//   r      [B, J, D]  1/std in double, or std itself for a component where
//                     some 1/std overflows (a subnormal float64 std: (x - mu)
//                     * inf would be NaN at the mean, where the reference's
//                     division gives 0);
//   divide [B, J]     1 for such a component: its z divides by r;
//   lnorm  [B, J]     log w_j - sum_d log std_jd, in double.
// Blocks work for one problem each, so a block stages its problem's mu, r,
// lnorm and divide in shared memory when they fit (`Staged`), else reads
// them from global memory (mu from the inputs, the rest from the workspace).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/logsumexp.h"
#include "cuda/primitives/reductions.cuh"
#include "cuda/primitives/runtime.cuh"
#include "importance_log_weights.h"

namespace fused_ops {
namespace importance_log_weights_paths {

constexpr int kThreads = 256;
constexpr size_t kSharedBudget = 48 * 1024;  // the default dynamic shared memory limit: no opt-in

template <typename T>
struct Params {
  const T *mix_weights, *mix_mus, *q_weights, *q_mus;  // inputs (weights: for the gradients)
  const T *mix_stds, *q_stds;
  double* r;      // [B, J, D] workspace
  double* lnorm;  // [B, J]
  int* divide; // [B, J]
  int64_t B, N;
  int D, K, Kq, J;

  __device__ __forceinline__ const T* mu_of(int64_t b, int j) const {
    return j < K ? mix_mus + (b * K + j) * int64_t(D) : q_mus + (b * Kq + (j - K)) * int64_t(D);
  }
  __device__ __forceinline__ const T* std_of(int64_t b, int j) const {
    return j < K ? mix_stds + (b * K + j) * int64_t(D) : q_stds + (b * Kq + (j - K)) * int64_t(D);
  }
  __device__ __forceinline__ T weight_of(int64_t b, int j) const {
    return j < K ? mix_weights[b * K + j] : q_weights[b * Kq + (j - K)];
  }
};

// One warp per component (b, j): r, divide, lnorm.
template <typename T>
__global__ void __launch_bounds__(kThreads) prepare(const Params<T> p) {
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int64_t comp = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / cuda::kWarpSize;
  if (comp >= p.B * p.J) return;  // whole warps exit together
  const int64_t b = comp / p.J;
  const int j = int(comp % p.J);
  const T* s = p.std_of(b, j);
  double* r = p.r + comp * p.D;
  double log_det = 0;
  int overflow = 0;
  for (int d = lane; d < p.D; d += cuda::kWarpSize) {
    const double inv = 1.0 / double(s[d]);
    r[d] = inv;
    overflow |= isinf(inv) && s[d] != T(0);
    log_det += log(double(s[d]));
  }
  log_det = cuda::group_allreduce(log_det, cuda::kWarpSize);
  overflow = __any_sync(0xffffffffu, overflow);
  if (overflow) {
    __syncwarp();
    for (int d = lane; d < p.D; d += cuda::kWarpSize) r[d] = double(s[d]);
  }
  if (lane == 0) {
    p.divide[comp] = overflow;
    p.lnorm[comp] = log(double(p.weight_of(b, j))) - log_det;
  }
}

// A block's view of its problem's parameters: shared memory when staged.
template <typename T>
struct Staged {
  const T* mu;  // [J, D] staged, else nullptr: read through Params
  const double* r;
  const double* lnorm;
  const int* divide;
  int64_t b;

  __device__ __forceinline__ const T* mu_of(const Params<T>& p, int j) const {
    return mu ? mu + j * p.D : p.mu_of(b, j);
  }
  __device__ __forceinline__ const double* r_of(const Params<T>& p, int j) const {
    return r + int64_t(j) * p.D;
  }
};

// Shared memory bytes that staging the parameters of one problem takes.
inline size_t staged_bytes(int64_t J, int64_t D, size_t elem) {
  return size_t(J + J * D) * sizeof(double) + size_t(J * D) * elem + size_t(J) * sizeof(int) + 16;
}

// Stage problem b's parameters into `smem` (when `stage`), else point into
// global memory.  Every thread of the block calls it (it synchronises).
template <typename T>
__device__ Staged<T> stage(const Params<T>& p, int64_t b, bool stage_it, unsigned char* smem) {
  const int64_t JD = int64_t(p.J) * p.D;
  if (!stage_it) {
    return {nullptr, p.r + b * JD, p.lnorm + b * p.J, p.divide + b * p.J, b};
  }
  double* lnorm = reinterpret_cast<double*>(smem);
  double* r = lnorm + p.J;
  T* mu = reinterpret_cast<T*>(r + JD);
  int* divide = reinterpret_cast<int*>(mu + JD);
  for (int64_t e = threadIdx.x; e < JD; e += blockDim.x) {
    const int j = int(e / p.D), d = int(e % p.D);
    mu[e] = p.mu_of(b, j)[d];
    r[e] = p.r[b * JD + e];
  }
  for (int j = threadIdx.x; j < p.J; j += blockDim.x) {
    lnorm[j] = p.lnorm[b * p.J + j];
    divide[j] = p.divide[b * p.J + j];
  }
  __syncthreads();
  return {mu, r, lnorm, divide, b};
}

// (x - mu) / std of one element in double: a multiply by 1/std, or a division.
template <typename T>
__device__ __forceinline__ double z_of(T x, T mu, double r, bool divide) {
  const double diff = double(x) - double(mu);
  return divide ? diff / r : diff * r;
}

// lnorm_j - 0.5 sum_d z_d^2 for row x, all in double (as the CPU kernel
// computes): z, and its square accumulated in two interleaved partial sums
// (long float32 rows would otherwise round far from a float64 run; the
// row's bytes, not this arithmetic, are meant to bound the kernel).
template <typename T>
__device__ __forceinline__ double component_log_density(const Params<T>& p, const Staged<T>& s, const T* x, int j) {
  const T* mu = s.mu_of(p, j);
  const double* r = s.r_of(p, j);
  const bool divide = s.divide[j] != 0;
  double a0 = 0, a1 = 0;
  int d = 0;
  for (; d + 2 <= p.D; d += 2) {
    const double z0 = z_of(x[d], mu[d], r[d], divide), z1 = z_of(x[d + 1], mu[d + 1], r[d + 1], divide);
    a0 = fma(z0, z0, a0);
    a1 = fma(z1, z1, a1);
  }
  if (d < p.D) {
    const double z0 = z_of(x[d], mu[d], r[d], divide);
    a0 = fma(z0, z0, a0);
  }
  return s.lnorm[j] - 0.5 * (a0 + a1);
}

// The log-sum-exps (double) of a row's target (j < K) and proposal (j >= K) densities.
template <typename T>
__device__ __forceinline__ void row_log_sums(const Params<T>& p, const Staged<T>& s, const T* x,
                                             LogSumExp<double>& lp, LogSumExp<double>& lq) {
  lp = LogSumExp<double>::empty();
  lq = LogSumExp<double>::empty();
  for (int j = 0; j < p.J; ++j) {
    const double lc = component_log_density(p, s, x, j);
    if (j < p.K) {
      lp.push(lc);
    } else {
      lq.push(lc);
    }
  }
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------

// Params over the inputs, with the prepared arrays carved from `ws` (its
// first prepared_doubles(...) elements), and the prepare launch.
inline int64_t prepared_doubles(int64_t B, int64_t J, int64_t D) {
  return B * J * D + 2 * B * J + 2;  // r and lnorm: doubles; divide: ints
}

template <typename T>
Params<T> make_params(const ImportanceLogWeightsInputs& c, double* ws) {
  Params<T> p;
  p.mix_weights = cdata<T>(c.mix_weights);
  p.mix_mus = cdata<T>(c.mix_mus);
  p.mix_stds = cdata<T>(c.mix_stds);
  p.q_weights = cdata<T>(c.q_weights);
  p.q_mus = cdata<T>(c.q_mus);
  p.q_stds = cdata<T>(c.q_stds);
  p.B = c.B, p.N = c.N, p.D = int(c.D), p.K = int(c.K), p.Kq = int(c.Kq), p.J = int(c.K + c.Kq);
  const int64_t BJ = c.B * p.J;
  p.r = ws;
  p.lnorm = ws + BJ * c.D;
  p.divide = reinterpret_cast<int*>(ws + BJ * c.D + BJ);
  return p;
}

template <typename T>
void launch_prepare(const Params<T>& p, cudaStream_t stream) {
  const int64_t warps = p.B * p.J, per_block = kThreads / cuda::kWarpSize;
  prepare<T><<<unsigned((warps + per_block - 1) / per_block), kThreads, 0, stream>>>(p);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

// The paths (rows.cu, backward.cu).
bool staged_applies(const ImportanceLogWeightsCall& c);
void launch_staged(const ImportanceLogWeightsCall& c);
void launch_global(const ImportanceLogWeightsCall& c);
void launch_tiled_backward(const ImportanceLogWeightsBackwardCall& c);

}  // namespace importance_log_weights_paths
}  // namespace fused_ops
