// \brief bfloat16 tensor-core products with float32 accumulation
// (mma.sync m16n8k16), for kernels whose operands are bfloat16: the A
// operands' shared-memory rows, their ldmatrix loads, the products, and the
// once-per-call packing of nn.Linear weights into B-fragment order.
// The bfloat16 counterpart of tf32x3.cuh (which keeps float32 accuracy with
// three TF32 products per tile): here one product per tile, with twice the
// k per instruction, on operands that already are bfloat16.
//
// Fragment layout of mma.sync m16n8k16 (row.col, bf16 in, f32 accumulate),
// per lane with g = lane / 4 and t = lane % 4 (PTX ISA, "Matrix Fragments
// for mma.m16n8k16 with floating point type"); each 32-bit register holds
// two bfloat16 values, the lower k (or column) index in the low half:
//   A (16x16, M x K): a[0]=(g, 2t..2t+1)    a[1]=(g+8, 2t..2t+1)
//                     a[2]=(g, 2t+8..2t+9)  a[3]=(g+8, 2t+8..2t+9)
//   B (16x8,  K x N): b[0]=(k=2t..2t+1, n=g)  b[1]=(k=2t+8..2t+9, n=g)
//   C (16x8,  M x N): c[0]=(g, 2t) c[1]=(g, 2t+1) c[2]=(g+8, 2t) c[3]=(g+8, 2t+1)
// (C as for m16n8k8: the accumulators of tf32x3.cuh's kernels read the same.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/primitives/ldmatrix.cuh"
#include "cuda/primitives/reductions.cuh"  // kWarpSize

namespace fused_ops {
namespace cuda {

// c += a * b on one m16n8k16 tile.  Not volatile: the compiler may
// interleave independent products.
__device__ __forceinline__ void mma_bf16_m16n8k16(float (&c)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  // Tensor cores need sm_80+; callers only launch these paths there.
  __trap();
#endif
}

// acc[m][n] += A_m * B_n for M x N tiles of one k-step, tile by tile (the
// products of different tiles are independent: no mma.sync waits on the one
// just before it).
template <int M, int N>
__device__ __forceinline__ void mma_bf16_tiles(float (&acc)[M][N][4], const uint32_t (&a)[M][4],
                                               const uint32_t (&b)[N][2]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n) mma_bf16_m16n8k16(acc[m][n], a[m], b[n]);
}

// A operands in shared memory as bfloat16 rows: a float value is rounded to
// nearest even when stored (what a bfloat16 PyTorch program does to every
// intermediate).  One ldmatrix.x4 loads a lane's A fragment of a 16x16
// tile: its four 8x8 b16 matrices are rows 0-7 | 8-15 x columns k..k+7 |
// k+8..k+15, in a[0..3]'s order above.  Row stride ld (elements) must be a
// multiple of 8 (16-byte row addresses); ld / 8 odd keeps the 8 rows of a
// matrix in 8 different 16-byte bank groups (conflict-free).
struct Bf16Rows {
  __nv_bfloat16* p;  // [rows, ld]
  int ld;
  __device__ __forceinline__ void store(int r, int c, float v) const {
    p[r * ld + c] = __float2bfloat16_rn(v);
  }
};

// B operands (bfloat16 weights, nn.Linear's [N, K] layout) packed once per
// call in m16n8k16's fragment order: for k-step s (16 columns) and n8-tile
// T, lane (g, t) holds {W[8T+g][16s+2t], W[8T+g][16s+2t+1]} and
// {W[8T+g][16s+2t+8], W[8T+g][16s+2t+9]} as one uint2 (zero past N and K),
// at out[(s * tiles + T) * 32 + lane]: one 8-byte load per fragment, 256
// contiguous bytes per warp.  The values are copied bit for bit.
struct BFragmentsBf16 {
  const uint16_t* w;  // [N, K] bfloat16 bits, row stride ld
  int64_t ld;
  int N, K, ksteps;   // ksteps >= ceil(K / 16): k-steps packed (zero past K)
  uint2* out;         // b_fragment_bf16_size(N, ksteps) fragments
};

__host__ __device__ inline int64_t b_fragment_bf16_size(int N, int ksteps) {
  return int64_t(ksteps) * ((N + 7) / 8) * kWarpSize;
}

constexpr int kMaxBFragmentsBf16 = 5;
struct BFragmentsBf16Batch {
  BFragmentsBf16 m[kMaxBFragmentsBf16];
};

template <int kThreadsPerBlock>
__global__ void __launch_bounds__(kThreadsPerBlock)
    pack_b_fragments_bf16_kernel(const BFragmentsBf16Batch batch) {
  // Picked with constant indices (a dynamic index would copy the batch to
  // local memory).
  BFragmentsBf16 b = batch.m[0];
#pragma unroll
  for (int i = 1; i < kMaxBFragmentsBf16; ++i)
    if (int(blockIdx.y) == i) b = batch.m[i];
  const int tiles = (b.N + 7) / 8;
  // Word (s, T, lane, e), e fastest: consecutive threads write consecutive words.
  uint32_t* out = reinterpret_cast<uint32_t*>(b.out);
  const int64_t total = 2 * b_fragment_bf16_size(b.N, b.ksteps);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int e = int(i % 2), lane = int(i / 2 % kWarpSize);
    const int64_t f = i / (kWarpSize * 2);
    const int T = int(f % tiles), s = int(f / tiles);
    const int n = 8 * T + lane / 4, k = 16 * s + 2 * (lane % 4) + 8 * e;
    const bool row = n < b.N;
    const uint32_t lo = (row && k < b.K) ? b.w[int64_t(n) * b.ld + k] : 0u;
    const uint32_t hi = (row && k + 1 < b.K) ? b.w[int64_t(n) * b.ld + k + 1] : 0u;
    out[i] = lo | (hi << 16);
  }
}

// Packs batch.m[0 .. count) on `stream`.
inline void pack_b_fragments_bf16(cudaStream_t stream, const BFragmentsBf16Batch& batch, int count) {
  constexpr int kPackThreads = 256;
  int64_t largest = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t n = 2 * b_fragment_bf16_size(batch.m[i].N, batch.m[i].ksteps);
    largest = n > largest ? n : largest;
  }
  const int64_t blocks = (largest + kPackThreads - 1) / kPackThreads;
  const dim3 grid(unsigned(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks)), unsigned(count));
  pack_b_fragments_bf16_kernel<kPackThreads><<<grid, kPackThreads, 0, stream>>>(batch);
}

}  // namespace cuda
}  // namespace fused_ops
