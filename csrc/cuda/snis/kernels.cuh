// \brief What the two snis paths (block.cu, split.cu) share: the kernel
// arguments, the block-level building blocks both run, and the host-side
// plan (chunking, workspace).
//
// Geometry: kThreads-thread blocks, each owning one chunk [n0, n1) of one
// problem (the block path: the whole problem).  A 1-D grid of B * C blocks,
// block index = b * C + c, so B is not limited by gridDim.y.
//
// Building blocks, each a pass over the block's chunk:
//   block_stats     online log-sum-exp over the log weights: per thread a
//                   running max (in T) and sum exp(lw - max), sum exp(2 (lw -
//                   max)) in double, four loads in flight per thread; merged
//                   over the block in a fixed pattern (warp butterfly, then
//                   warps in order).
//   block_moments   tiles of kThreads rows: each thread writes one
//                   normalised log weight (double lw - logsumexp, rounded
//                   once) and stages w = exp(lnw) in shared memory; the block
//                   then reads the tile's samples [rows, D] as consecutive
//                   row segments (thread t: column t % Dc, row t / Dc, Dc =
//                   min(D, kThreads)), coalesced, accumulating sum w x (or
//                   sum w (x - mean)^2 about a given mean) in double; the
//                   rows' partials are added in row-slot order at the end.
// Every reduction has a fixed order: bitwise reproducible, no atomics.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/snis_partials.h"
#include "cuda/primitives/reductions.cuh"
#include "cuda/primitives/runtime.cuh"
#include "snis.h"

namespace fused_ops {
namespace snis_paths {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / cuda::kWarpSize;
constexpr int64_t kMinChunk = 4096;  // the split path's smallest chunk

template <typename T>
struct Args {
  const T* lw;  // [B, N]
  const T* x;   // [B, N, D] or nullptr
  T *lnw, *ess, *logz, *mean, *var;
  int64_t B, N, C, chunk;  // C chunks of `chunk` weights per problem
  int D;
  bool moments;
  SnisStats* stats;  // [B * C] (split path)
  double* sums;      // [B * C, D] (split path)
  double* mean64;    // [B, D]: the mean in double, about which the variance is taken
  double* lse;       // [B] (split path)
};

__device__ __forceinline__ SnisStats shfl_xor(const SnisStats& s, int offset) {
  return {cuda::shfl_xor(s.max, offset), cuda::shfl_xor(s.sum, offset), cuda::shfl_xor(s.sum_sq, offset)};
}

// Every thread gets the block's merge of the threads' partials (fixed pattern).
__device__ __forceinline__ SnisStats block_merge(SnisStats s, SnisStats* scratch) {
  for (int offset = cuda::kWarpSize / 2; offset > 0; offset >>= 1) s = SnisStats::merge(s, shfl_xor(s, offset));
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  __syncthreads();
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  s = scratch[0];
  for (int w = 1; w < kWarps; ++w) s = SnisStats::merge(s, scratch[w]);
  return s;
}

// Thread-level online update: a value above the running max (or NaN)
// rescales the sums; -inf adds nothing; +inf or NaN makes them NaN.
template <typename T>
__device__ __forceinline__ void stats_push(T v, T& m, double& s, double& s2) {
  if (!(v <= m)) {
    const double r = m == T(-INFINITY) ? 0.0 : exp(double(m) - double(v));
    s *= r;
    s2 *= r * r;
    m = v;
  }
  const double e = v == T(-INFINITY) ? 0.0 : double(exp(v - m));
  s += e;
  s2 += e * e;
}

template <typename T>
__device__ SnisStats block_stats(const T* __restrict__ v, int64_t n0, int64_t n1, SnisStats* scratch) {
  T m = T(-INFINITY);
  double s = 0, s2 = 0;
  int64_t i = n0 + threadIdx.x;
  for (; i + 3 * kThreads < n1; i += 4 * kThreads) {
    const T a = v[i], b = v[i + kThreads], c = v[i + 2 * kThreads], d = v[i + 3 * kThreads];
    stats_push(a, m, s, s2);
    stats_push(b, m, s, s2);
    stats_push(c, m, s, s2);
    stats_push(d, m, s, s2);
  }
  for (; i < n1; i += kThreads) stats_push(v[i], m, s, s2);
  return block_merge({double(m), s, s2}, scratch);
}

// The fixed-order merge of a problem's C chunk partials, in every thread.
__device__ __forceinline__ SnisStats merge_chunks(const SnisStats* part, int64_t C, SnisStats* scratch) {
  SnisStats s = SnisStats::empty();
  for (int64_t k = threadIdx.x; k < C; k += kThreads) s = SnisStats::merge(s, part[k]);
  return block_merge(s, scratch);
}

struct MomentScratch {
  double w[kThreads];    // the tile's weights
  double acc[kThreads];  // per (row slot, column) partials at the end
};

// Over rows [n0, n1) of one problem: writes lnw (when lnw_out), and, with
// samples, calls out(d, sum_i w_i f(x_id)) once per d (from one thread each),
// f(x) = x, or (x - mu_d)^2 when mu is given.
template <typename T, typename Out>
__device__ void block_moments(const T* __restrict__ lw, const T* __restrict__ x, int D, int64_t n0, int64_t n1,
                              double lse, T* lnw_out, const double* mu, MomentScratch& sm, Out out) {
  const int t = threadIdx.x;
  if (!x || D == 0) {  // normalised log weights only: four loads in flight per thread
    int64_t i = n0 + t;
    for (; i + 3 * kThreads < n1; i += 4 * kThreads) {
      const T a = lw[i], b = lw[i + kThreads], c = lw[i + 2 * kThreads], e = lw[i + 3 * kThreads];
      lnw_out[i] = T(double(a) - lse);
      lnw_out[i + kThreads] = T(double(b) - lse);
      lnw_out[i + 2 * kThreads] = T(double(c) - lse);
      lnw_out[i + 3 * kThreads] = T(double(e) - lse);
    }
    for (; i < n1; i += kThreads) lnw_out[i] = T(double(lw[i]) - lse);
    return;
  }
  const int Dc = D < kThreads ? D : kThreads;
  const int R = kThreads / Dc, col = t % Dc, slot = t / Dc;
  for (int d0 = 0; d0 < D; d0 += Dc) {
    const int d = d0 + col;
    const bool active = slot < R && d < D;
    const double m = (mu && active) ? mu[d] : 0.0;
    double acc = 0;
    for (int64_t tile = n0; tile < n1; tile += kThreads) {
      __syncthreads();  // the previous tile's weights are consumed
      const int64_t i = tile + t;
      if (i < n1) {
        const T ln = T(double(lw[i]) - lse);
        if (lnw_out && d0 == 0) lnw_out[i] = ln;
        sm.w[t] = double(exp(ln));
      }
      __syncthreads();
      const int rows = int(n1 - tile < kThreads ? n1 - tile : kThreads);
      if (active) {
        for (int r = slot; r < rows; r += R) {
          const double v = double(x[(tile + r) * D + d]) - m;
          acc += sm.w[r] * (mu ? v * v : v);
        }
      }
    }
    __syncthreads();
    sm.acc[t] = acc;
    __syncthreads();
    if (slot == 0 && d < D) {
      double total = 0;
      for (int r = 0; r < R; ++r) total += sm.acc[r * Dc + col];
      out(d, total);
    }
  }
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------

// The split path's chunk: enough blocks for ~8 per SM over all problems,
// at least kMinChunk weights, a multiple of kThreads.
inline int64_t split_chunk(int64_t B, int64_t N, int sms) {
  const int64_t target = int64_t(8) * sms;
  const int64_t per_problem = std::max<int64_t>(1, target / std::max<int64_t>(B, 1));
  int64_t chunk = (N + per_problem - 1) / per_problem;
  chunk = (chunk + kThreads - 1) / kThreads * kThreads;
  return std::max(chunk, kMinChunk);
}

template <typename T>
Args<T> make_args(const SnisCall& c) {
  Args<T> a{};
  a.lw = cdata<T>(c.lw);
  a.x = c.has_samples ? cdata<T>(c.x) : nullptr;
  a.lnw = mdata<T>(c.log_norm_weights);
  a.ess = mdata<T>(c.ess);
  a.logz = mdata<T>(c.log_evidence);
  a.mean = c.has_samples ? mdata<T>(c.mean) : nullptr;
  a.var = c.moments ? mdata<T>(c.variance) : nullptr;
  a.B = c.B, a.N = c.N, a.D = int(c.D), a.moments = c.moments;
  return a;
}

bool split_applies(const SnisCall& c);
void launch_split(const SnisCall& c);
void launch_block(const SnisCall& c);

}  // namespace snis_paths
}  // namespace fused_ops
