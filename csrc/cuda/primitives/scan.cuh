// \brief Block-wide exclusive prefix sum (one value per thread), in a fixed
// order: bitwise reproducible, and the same arithmetic on every call with the
// same values (so two passes that scan the same data agree exactly).
//
// Lanes combine by a Hillis-Steele shuffle scan; the warps' totals are added
// sequentially in warp order by every thread (blockDim.x / 32 adds).
#pragma once

#include <cuda_runtime.h>

#include "cuda/primitives/reductions.cuh"

namespace fused_ops {
namespace cuda {

template <typename T>
struct ScanResult {
  T exclusive;  // the values of the threads below this one, combined (identity for thread 0)
  T total;      // all the block's values, combined
};

// blockDim.x a multiple of 32; `scratch` holds one T per warp.  Begins and
// ends with a barrier, so consecutive calls may share the scratch.  `op` is
// associative with `identity` (Sum and 0 by default; a max is exact, so a
// max-scan is the same whatever the order).
template <typename T, typename Op = Sum>
__device__ __forceinline__ ScanResult<T> block_exclusive_scan(T v, T* scratch, Op op = {}, T identity = T(0)) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  T inclusive = v;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const T up = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive = op(up, inclusive);
  }
  T exclusive = __shfl_up_sync(kFullMask, inclusive, 1);
  if (lane == 0) exclusive = identity;
  __syncthreads();
  if (lane == kWarpSize - 1) scratch[warp] = inclusive;
  __syncthreads();
  T offset = identity, total = identity;
  const int num_warps = blockDim.x / kWarpSize;
  for (int w = 0; w < num_warps; ++w) {
    if (w == warp) offset = total;
    total = op(total, scratch[w]);
  }
  __syncthreads();
  return {op(offset, exclusive), total};
}

}  // namespace cuda
}  // namespace fused_ops
