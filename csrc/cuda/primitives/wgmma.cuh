// \brief Hopper warpgroup matrix products (wgmma, sm_90a) on TF32 operands in
// shared memory, the operand layout they read, and the pieces of a kernel
// that streams packed weights through them (bottom).
//
// Why: on the H200 a CTA of two warpgroups issuing wgmma.m64nNk8 TF32
// sustains ~917 multiply-adds per clock per SM, mma.sync.m16n8k8 ~470
// (the probe measurement, `git show 3b1fe44:bench/results/nvidia-h200-wgmma-probe.txt`):
// for the 3xTF32 products of the tiled paths that is the difference between
// being bound by the tensor cores and by everything around them.
//
// Operand layout ("core-matrix", K-major, no swizzle): an R x 8 block of one
// k-step (R rows of the operand, 8 consecutive k) is R / 8 groups of two
// 8 x 4 core matrices, each core matrix 128 contiguous bytes (8 rows of
// 16 bytes).  Float (r, k) of the block lies at core_offset(r, k): the two
// core matrices of a group (k < 4, k >= 4) 128 bytes apart (the descriptor's
// leading byte offset), groups 256 bytes apart (its stride byte offset).
// Blocks of consecutive k-steps follow each other, R * 8 floats apart.  A
// probe kernel on the H200 confirmed this reading of the descriptor fields
// (the other assignment of the two offsets gives wrong products) and the
// accumulator layout below (the probe measurement, `git show 3b1fe44:bench/results/nvidia-h200-wgmma-probe.txt`).
//
// Accumulators of m64nN: warp w of the warpgroup owns rows 16 w .. 16 w + 15;
// lane (g = lane / 4, t = lane % 4) holds, for each n8 tile j, d[4 j + i] =
// (row 16 w + g + 8 (i >= 2), column 8 j + 2 t + (i & 1)) -- mma.sync's C
// fragment, repeated over the tiles.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/primitives/mbarrier.cuh"

namespace fused_ops {
namespace cuda {

__host__ __device__ constexpr int core_offset(int r, int k) {
  return (r / 8) * 64 + (k / 4) * 32 + (r % 8) * 4 + (k % 4);
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FUSED_OPS_WGMMA 1

// Shared-memory matrix descriptor of the block at `p` (16-byte aligned),
// layout above: leading byte offset 128, stride byte offset 256, no swizzle.
__device__ __forceinline__ uint64_t wgmma_desc(const float* p) {
  const uint64_t a = smem_addr(p);
  return ((a & 0x3FFFF) >> 4) | (uint64_t(128 >> 4) << 16) | (uint64_t(256 >> 4) << 32);
}

// Orders this thread's register and shared-memory accesses before the
// warpgroup's next wgmma (required before the first one and whenever the
// accumulators were touched by other instructions).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes visible to the
// async proxy (wgmma operand reads, bulk copies).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// d[64 x N] += A[64 x 8] * B[N x 8]^T, A and B by descriptor (K-major TF32:
// the tensor core reads each float's top 19 bits); with accumulate == 0,
// d = A * B (the old d is not read: no zeroing of a fresh accumulator).
// accumulate is a compile-time constant at every call here, so ptxas folds
// the predicate.
template <int N>
__device__ void wgmma_tf32(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate = 1);
template <>
__device__ __forceinline__ void wgmma_tf32<8>(float (&d)[4], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %6, 0; "
      "wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {%0, %1, %2, %3}, %4, %5, p, 1, 1;}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_tf32<16>(float (&d)[8], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %10, 0; "
      "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_tf32<32>(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %18, 0; "
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_tf32<64>(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %34, 0; "
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_tf32<128>(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %66, 0; "
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                 "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                 "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}

// One k-step of a 3xTF32 product from split operands (big and small planes
// by descriptor): the two small cross terms first, as in mma_3xtf32_tiles.
template <int N>
__device__ __forceinline__ void wgmma_3xtf32(float (&d)[N / 2], uint64_t a_big, uint64_t a_small, uint64_t b_big,
                                             uint64_t b_small, int accumulate = 1) {
  wgmma_tf32<N>(d, a_small, b_big, accumulate);
  wgmma_tf32<N>(d, a_big, b_small);
  wgmma_tf32<N>(d, a_big, b_big);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace cuda
}  // namespace fused_ops
