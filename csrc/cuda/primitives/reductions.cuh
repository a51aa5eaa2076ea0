// \brief Warp- and block-level reductions shared by the CUDA kernels: sums
// and log-sum-exp merges over a group of lanes (xor butterfly), a warp, or a
// block (per-warp partials through shared memory).
//
// All reductions combine values in a fixed pattern that does not depend on
// timing, so kernels built on them are bitwise reproducible.  The xor
// butterfly adds the same pairs in every lane (a + b == b + a exactly), so all
// lanes of a group end up with bitwise the same total.
#pragma once

#include <cuda_runtime.h>

#include "common/logsumexp.h"

namespace fused_ops {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;

template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int offset) {
  return __shfl_xor_sync(kFullMask, v, offset);
}

template <typename T>
__device__ __forceinline__ LogSumExp<T> shfl_xor(LogSumExp<T> v, int offset) {
  return {__shfl_xor_sync(kFullMask, v.max, offset), __shfl_xor_sync(kFullMask, v.sum, offset)};
}

struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

struct MergeLogSumExp {
  template <typename T>
  __device__ __forceinline__ LogSumExp<T> operator()(LogSumExp<T> a, LogSumExp<T> b) const {
    return LogSumExp<T>::merge(a, b);
  }
};

// Reduce over aligned groups of `width` lanes (a power of two <= 32); every lane
// of a group receives the group's result.  All 32 lanes must call it.
template <typename T, typename Op = Sum>
__device__ __forceinline__ T group_allreduce(T v, int width, Op op = {}) {
  for (int offset = width >> 1; offset > 0; offset >>= 1) v = op(v, shfl_xor(v, offset));
  return v;
}

// Reduce over the whole block (blockDim.x a multiple of 32); every thread
// receives the result.  `scratch` holds one T per warp; the call begins with a
// barrier so the same scratch can be reused by consecutive calls.
template <typename T, typename Op = Sum>
__device__ __forceinline__ T block_allreduce(T v, T* scratch, Op op = {}) {
  v = group_allreduce(v, kWarpSize, op);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  const int num_warps = blockDim.x / kWarpSize;
  for (int w = 1; w < num_warps; ++w) v = op(v, scratch[w]);
  return v;
}

// A VEC-wide vector of T that loads and stores in one instruction.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

}  // namespace cuda
}  // namespace fused_ops
