// Tensor-core matrix products at float32 accuracy ("3xTF32"), shared by the
// CUDA kernels that run chains of small matrix products (flow_euler, vae_elbo).
//
// Why: a TF32 tensor-core product keeps only 10 mantissa bits of each operand,
// far outside the float32 contract (1e-4).  Splitting each operand into a TF32
// "big" part and a TF32 "small" remainder, x = big + small, and summing
//   small_a*big_b + big_a*small_b + big_a*big_b
// recovers ~21 bits per operand (the dropped small*small term is below float32
// rounding); the accumulation is float32 in the tensor core.  That is three
// tensor-core products per tile, still far faster than float32 FMA on sm_80+.
//
// Fragment layout of mma.sync m16n8k8 (row.col, tf32 in, f32 accumulate), per
// lane with g = lane / 4 and t = lane % 4 (PTX ISA, "Matrix Fragments for
// mma.m16n8k8" with .tf32):
//   A (16x8, row-major M x K): a[0]=(g, t)  a[1]=(g+8, t)  a[2]=(g, t+4)  a[3]=(g+8, t+4)
//   B (8x8,  K x N)          : b[0]=(k=t, n=g)            b[1]=(k=t+4, n=g)
//   C (16x8, M x N)          : c[0]=(g, 2t) c[1]=(g, 2t+1) c[2]=(g+8, 2t) c[3]=(g+8, 2t+1)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_ops {
namespace cuda {

// x = big + small, both exactly representable in TF32 (round to nearest).
struct SplitTf32 {
  uint32_t big, small;
};

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ SplitTf32 split_tf32(float x) {
  const uint32_t big = to_tf32(x);
  return {big, to_tf32(x - __uint_as_float(big))};
}

// c += a * b on one m16n8k8 tile (operands already TF32 bit patterns).
__device__ __forceinline__ void mma_tf32_m16n8k8(float (&c)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  // Tensor cores need sm_80+; callers only launch these paths there.
  __trap();
#endif
}

// c += a * b at float32 accuracy from split operands.  The small products go
// first so they are not swamped by the large one in the accumulator.
__device__ __forceinline__ void mma_3xtf32_m16n8k8(float (&c)[4], const SplitTf32 (&a)[4],
                                                   const SplitTf32 (&b)[2]) {
  const uint32_t a_big[4] = {a[0].big, a[1].big, a[2].big, a[3].big};
  const uint32_t a_small[4] = {a[0].small, a[1].small, a[2].small, a[3].small};
  const uint32_t b_big[2] = {b[0].big, b[1].big};
  const uint32_t b_small[2] = {b[0].small, b[1].small};
  mma_tf32_m16n8k8(c, a_small, b_big);
  mma_tf32_m16n8k8(c, a_big, b_small);
  mma_tf32_m16n8k8(c, a_big, b_big);
}

}  // namespace cuda
}  // namespace fused_ops
