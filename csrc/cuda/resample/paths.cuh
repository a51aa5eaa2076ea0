// \brief What the two CUDA paths of fused_ops::resample share (block.cu,
// multiblock.cu): the kernel arguments, the launch geometry, the positions,
// and the tile scan that turns log weights into a float64 CDF in shared
// memory.  The math is csrc/resample.h's.
//
// Numerics: w_i = exp(lw_i - max) in float64 for float32 and float64 inputs
// alike; a tile of kTile weights is summed per thread (kItems consecutive
// weights, sequentially) and across threads by a block scan
// (primitives/scan.cuh), on top of the running carry of the tiles before.
// The rounding of a CDF value is therefore bounded by about
// (kItems + 32 + kWarps + number of tiles) float64 ulps of the total.
// A problem whose log weights hold NaN or +inf, or are all -inf, gets -1 in
// every index (no host synchronisation: the caller checks, if it cares).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/primitives/reductions.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/scan.cuh"
#include "resample.h"

namespace fused_ops {
namespace resample_paths {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / cuda::kWarpSize;
constexpr int kItems = 8;                   // consecutive weights per thread and tile
constexpr int kTile = kThreads * kItems;    // weights (and positions) per tile
constexpr int64_t kInvalid = -1;            // every index of a problem without a positive weight

template <typename T>
struct Args {
  const T* lw;       // [B, N]
  const double* u;   // [B, U]
  int64_t* out;      // [B, M]
  int64_t B, N, M, U;
  ResampleMethod method;
};

template <typename T>
Args<T> make_args(const ResampleCall& c) {
  return {cdata<T>(c.log_weights), cdata<double>(c.uniforms), mdata<int64_t>(c.indices),
          c.B, c.N, c.M, c.U, c.method};
}

// Stratified / systematic position of sample k of a problem (uniforms u of it).
__device__ __forceinline__ double strided_at(const double* u, ResampleMethod method, int64_t k, int64_t M) {
  return strided_position(k, method == ResampleMethod::kStratified ? u[k] : u[0], M);
}

// True when a log weight makes its problem invalid (NaN or +inf).
template <typename T>
__device__ __forceinline__ bool is_bad(T v) {
  return v != v || v == T(INFINITY);
}

// One tile of the CDF: cdf[j] = carry + w_{base} + ... + w_{base + j} for the
// n = min(kTile, N - base) weights of the tile; returns cdf[n - 1], the carry
// of the next tile (so consecutive tiles join exactly), and sets
// *last_positive to the largest index of the tile with w > 0 (or leaves it).
// All threads of the block call it; it ends with a barrier.
template <typename T>
__device__ double cdf_tile(const T* lw, int64_t N, int64_t base, double gmax, double carry, double* cdf,
                           double* scratch, int64_t* last_positive_smem) {
  const int64_t first = base + int64_t(threadIdx.x) * kItems;
  double local[kItems];
  double s = 0.0;
  int64_t last = -1;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t i = first + j;
    const double e = i < N ? exp(double(lw[i]) - gmax) : 0.0;
    s += e;
    local[j] = s;
    if (e > 0.0) last = i;
  }
  const cuda::ScanResult<double> scan = cuda::block_exclusive_scan(s, scratch);
  const int64_t n = N - base < kTile ? N - base : kTile;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t t = int64_t(threadIdx.x) * kItems + j;
    if (t < n) cdf[t] = carry + (scan.exclusive + local[j]);
  }
  if (last >= 0) atomicMax(reinterpret_cast<unsigned long long*>(last_positive_smem),
                           static_cast<unsigned long long>(last));
  __syncthreads();
  return cdf[n - 1];
}

// First j in [lo, hi) with a[j] > x (hi when none): upper_bound.
__device__ __forceinline__ int64_t upper_bound(const double* a, int64_t lo, int64_t hi, double x) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] > x) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// First j in [lo, hi) with a[j] >= x: lower_bound.
__device__ __forceinline__ int64_t lower_bound(const double* a, int64_t lo, int64_t hi, double x) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] >= x) hi = mid; else lo = mid + 1;
  }
  return lo;
}

struct MaxOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a > b ? a : b; }
};

// multiblock's multinomial pre-pass (positions.cu): the sorted positions of
// every problem, as float64 bits in c.indices.
void write_multinomial_positions(const ResampleCall& c, cudaStream_t stream);

bool multiblock_applies(const ResampleCall& c);
void launch_block(const ResampleCall& c);
void launch_multiblock(const ResampleCall& c);

}  // namespace resample_paths
}  // namespace fused_ops
