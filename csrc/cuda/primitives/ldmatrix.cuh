// \brief ldmatrix.x4 loads of a 16-row mma.sync A tile from shared memory:
// four 8x8 b16 matrices, rows 0-7 | 8-15 x the tile's first | second 16
// bytes of columns (4 float32 columns of a TF32 m16n8k8 tile, tf32x3.cuh;
// 8 bfloat16 columns of an m16n8k16 tile, bf16_mma.cuh).  The matrices land
// in a[0..3] in the order both fragment layouts read them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/primitives/reductions.cuh"  // kWarpSize

namespace fused_ops {
namespace cuda {

// This lane's row address within the tile, in elements of T: lanes
// 8j..8j+7 address the rows of matrix j (rows 0-7 | 8-15, columns +0 |
// +16 bytes).  Row stride ld in elements; 16-byte aligned row addresses.
template <typename T>
__device__ __forceinline__ int ldmatrix_lane_offset(int ld) {
  const int lane = threadIdx.x % kWarpSize;
  return ((lane & 7) + (lane & 8)) * ld + (lane >> 4) * int(16 / sizeof(T));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
#else
  __trap();
#endif
}

}  // namespace cuda
}  // namespace fused_ops
