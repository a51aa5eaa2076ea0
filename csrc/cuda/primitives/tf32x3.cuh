// \brief Tensor-core matrix products at float32 accuracy ("3xTF32"), shared by the
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

#include "cuda/primitives/ldmatrix.cuh"
#include "cuda/primitives/reductions.cuh"  // kWarpSize

namespace fused_ops {
namespace cuda {

// x = big + small: big is x rounded to TF32 (to nearest, ties away from
// zero, as cvt.rna.tf32.f32), small the exact remainder x - big, handed to
// the tensor core as its float32 bit pattern: the tensor core reads a .tf32
// operand's top 19 bits and ignores the low 13 (CUTLASS's "fast" 3xTF32
// relies on the same), so small enters truncated to TF32 -- an error of at
// most 2^-21 |x| in a term that is itself at most 2^-11 |x|, below what the
// float32 accumulation loses: the products' error against float64 stays of
// the order of float32 FMA's.
// The rounding is two integer instructions: adding half a TF32 ulp to the
// magnitude bits and clearing the 13 dropped ones is that rounding for every
// finite input (a carry into the exponent is the correct round-up, up to
// inf past the largest TF32 value).  sm_90 has no single instruction for
// the cvt: it compiles to five (an inf/NaN test and a select besides), and
// with the split's second cvt the splits make up a large share of a
// tensor-core kernel's instructions (the flow tile kernel's, by ncu's source
// counters).  A NaN x gives a NaN
// small part (x - big), so NaN still propagates; inf gives NaN, as the cvt
// did (inf - inf).
struct SplitTf32 {
  uint32_t big, small;
};

__device__ __forceinline__ SplitTf32 split_tf32(float x) {
  const uint32_t big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  return {big, __float_as_uint(x - __uint_as_float(big))};
}

// c += a * b on one m16n8k8 tile (operands already TF32 bit patterns).  Not
// volatile: the compiler may interleave independent products.
__device__ __forceinline__ void mma_tf32_m16n8k8(float (&c)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  // Tensor cores need sm_80+; callers only launch these paths there.
  __trap();
#endif
}

// A operands kept in shared memory already split: two planes of the same
// shape, big parts then small parts (plane_floats apart), so the split is
// paid once per element instead of once per warp that reads it.  One
// ldmatrix.x4 loads a lane's four A values of one plane: ldmatrix moves 8x8
// tiles of 16-bit elements, and read as 32-bit elements an 8x8 b16 tile is
// an 8x4 tf32 tile whose lane (g, t) gets element (g, t) -- exactly the
// m16n8k8 A fragment when the four tiles are rows 0-7 / 8-15 x columns
// k..k+3 / k+4..k+7.  Row stride ld must be a multiple of 4 floats (16-byte
// row addresses); ld / 4 odd keeps the 8 rows of a tile in 8 different
// 16-byte bank groups (conflict-free).
struct SplitRows {
  float* big;         // [rows, ld]; the small parts at big + plane_floats
  int ld, plane_floats;
  __device__ __forceinline__ void store(int r, int c, float v) const {
    const SplitTf32 s = split_tf32(v);
    big[r * ld + c] = __uint_as_float(s.big);
    big[plane_floats + r * ld + c] = __uint_as_float(s.small);
  }
};

// acc[m][n] += A_m * B_n at float32 accuracy for M x N tiles (n < n_valid)
// from operands split ahead of time: per tile small_a*big_b, then
// big_a*small_b, then big_a*big_b (the small products first, so the large
// one does not swamp them).  They are issued pass by pass over all tiles,
// so no mma.sync waits on the one just before it (the three products of a
// tile form a dependent chain).  n_valid must fold to a constant at the call
// (a template argument of the caller): a run-time test around each
// mma.sync makes the compiler fence every one with a WARPSYNC.
template <int M, int N>
__device__ __forceinline__ void mma_3xtf32_tiles(float (&acc)[M][N][4], const uint32_t (&a_big)[M][4],
                                                 const uint32_t (&a_small)[M][4],
                                                 const uint32_t (&b_big)[N][2],
                                                 const uint32_t (&b_small)[N][2], int n_valid = N) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
      if (n < n_valid) mma_tf32_m16n8k8(acc[m][n], a_small[m], b_big[n]);
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
      if (n < n_valid) mma_tf32_m16n8k8(acc[m][n], a_big[m], b_small[n]);
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
      if (n < n_valid) mma_tf32_m16n8k8(acc[m][n], a_big[m], b_big[n]);
}

// B operands (weights, nn.Linear's [N, K] layout) packed once per call in
// mma.m16n8k8's fragment order: for k-step s (8 columns) and n8-tile T, the
// 32 lanes' fragments are consecutive, lane (g, t) holding W[8 T + g][8 s + t]
// and W[8 T + g][8 s + t + 4] (zero past N and K).  A lane then reads its
// whole fragment with one 8-byte load, and a warp's 32 loads are 256
// contiguous bytes, where the [N, K] layout needs two 4-byte loads with
// bounds checks spread over eight rows.  With `split` each lane's fragment is
// stored already split, {big(t), big(t+4), small(t), small(t+4)} as TF32 bit
// patterns: one 16-byte load and no split in the kernel, for twice the bytes.
// Tiles are grouped in passes of pass_tiles (only the last pass may be
// shorter), ordered [pass][k-step][tile in pass][lane][2 or 4], so that a
// range of k-steps of one pass is contiguous (a kernel can stream it as one
// chunk); a single pass (pass_tiles >= the tile count) is plain
// [k-step][tile][lane][2 or 4].
struct BFragments {
  const float* w;  // [N, K], row stride ld
  int64_t ld;
  int N, K, ksteps, pass_tiles;  // ksteps >= ceil(K / 8): k-steps packed (zero past K)
  float* out;                    // b_fragment_size(N, ksteps, split) floats
  bool split;
};

// Floats of one warp's fragment (one k-step, one n8-tile).
__host__ __device__ constexpr int b_fragment_floats(bool split) { return kWarpSize * (split ? 4 : 2); }

__host__ __device__ inline int64_t b_fragment_size(int N, int ksteps, bool split = false) {
  return int64_t(ksteps) * ((N + 7) / 8) * b_fragment_floats(split);
}

// n8-tiles in pass p (all but the last pass hold pass_tiles).
__host__ __device__ inline int b_fragment_pass_tiles(int N, int pass_tiles, int p) {
  const int left = (N + 7) / 8 - p * pass_tiles;
  return left < pass_tiles ? left : pass_tiles;
}

// Offset (floats) of the fragments of k-step s, n8-tile T.
__host__ __device__ inline int64_t b_fragment_offset(int N, int ksteps, int pass_tiles, int s, int T,
                                                     bool split = false) {
  const int p = T / pass_tiles, nt = T - p * pass_tiles;
  return (int64_t(p) * pass_tiles * ksteps + int64_t(s) * b_fragment_pass_tiles(N, pass_tiles, p) + nt) *
         b_fragment_floats(split);
}

// Packs up to kMaxBFragments matrices in one launch (blockIdx.y = matrix).
constexpr int kMaxBFragments = 5;
struct BFragmentsBatch {
  BFragments m[kMaxBFragments];
};

template <int kThreadsPerBlock>
__global__ void __launch_bounds__(kThreadsPerBlock) pack_b_fragments_kernel(const BFragmentsBatch batch) {
  // Picked with constant indices (a dynamic index would copy the batch to
  // local memory).
  BFragments b = batch.m[0];
#pragma unroll
  for (int i = 1; i < kMaxBFragments; ++i)
    if (int(blockIdx.y) == i) b = batch.m[i];
  const int tiles = (b.N + 7) / 8;
  // Value (s, T, lane, e), e fastest: consecutive threads write consecutive
  // packed floats within a tile.
  const int64_t total = b_fragment_size(b.N, b.ksteps);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int e = int(i % 2), lane = int(i / 2 % kWarpSize);
    const int64_t f = i / (kWarpSize * 2);
    const int T = int(f % tiles), s = int(f / tiles);
    const int n = 8 * T + lane / 4, k = 8 * s + lane % 4 + 4 * e;
    const float v = (n < b.N && k < b.K) ? b.w[int64_t(n) * b.ld + k] : 0.f;
    float* frag = b.out + b_fragment_offset(b.N, b.ksteps, b.pass_tiles, s, T, b.split);
    if (b.split) {
      const SplitTf32 sp = split_tf32(v);
      frag[lane * 4 + e] = __uint_as_float(sp.big);
      frag[lane * 4 + 2 + e] = __uint_as_float(sp.small);
    } else {
      frag[lane * 2 + e] = v;
    }
  }
}

// Packs batch.m[0 .. count) on `stream`.
inline void pack_b_fragments(cudaStream_t stream, const BFragmentsBatch& batch, int count) {
  constexpr int kPackThreads = 256;
  int64_t largest = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t n = b_fragment_size(batch.m[i].N, batch.m[i].ksteps);  // values, split or not
    largest = n > largest ? n : largest;
  }
  const int64_t blocks = (largest + kPackThreads - 1) / kPackThreads;
  const dim3 grid(unsigned(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks)), unsigned(count));
  pack_b_fragments_kernel<kPackThreads><<<grid, kPackThreads, 0, stream>>>(batch);
}

}  // namespace cuda
}  // namespace fused_ops
