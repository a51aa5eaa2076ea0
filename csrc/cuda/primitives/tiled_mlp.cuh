// \brief One layer of a fused MLP on a 32-row tile, on sm_80+ tensor cores in
// 3xTF32 (float32 accuracy): the product core shared by flow_euler's and
// ode_mlp's "tiled" paths (cuda/flow_euler/tiled.cu, cuda/ode_mlp/tiled.cu).
//
// What: out[r, n] = epilogue(r, n, sum_k in[r, k] W[n, k]) for the tile's 32
// rows and n < N, computed by one block of kThreads = 256 threads.
// - The A operand (the layer's input) lives in shared memory split into TF32
//   big and small planes (cuda::SplitRows, read by ldmatrix), split once when
//   written instead of by each of the 8 warps at every read.
// - The weights are packed once per call (cuda::pack_b_fragments with
//   kPassTiles tiles per pass and k padded to whole kKChunk chunks: see
//   packed_chunk_offset) so that each chunk (pass p, k-chunk kc) is one
//   contiguous 32 KB block; the layer streams the chunks from L2 into
//   STAGES shared buffers by cp.async (16 bytes per instruction; STAGES = 3
//   keeps three in flight: compute q, land q+1, load q+2; STAGES = 2, for
//   callers short of shared memory, loads q+1 while computing q), and a
//   lane reads its B fragment with one 8-byte shared load.
// - Output columns go in passes of kPassCols = 256 spread over the 8 warps
//   (n8-tiles warp, warp+8, ..., so small N still uses every warp); each
//   chunk's products go into a fresh accumulator added to the pass's in
//   float32 (the tensor cores' own accumulation over a long K is less
//   accurate: docs/flow_euler.md, Numerics).
// - KEEP = 0 hands each pass to the epilogue as it completes; KEEP > 0 (the
//   layer overwrites its own input buffer) keeps all passes in registers
//   until every warp is past its last read of the input; KEEP must then be
//   the number of passes, ceil(N / kPassCols).
// The epilogue is a functor called as epi(row, col, value) for col < N (rows
// 0..31 all: callers keep rows past their batch harmless).  It is inlined
// into the pass loop; it runs between passes, outside the product loop.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/primitives/cp_async.cuh"
#include "cuda/primitives/tf32x3.cuh"

namespace fused_ops {
namespace cuda {
namespace tiled_mlp {

constexpr int kThreads = 256;                  // one block per tile
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kTileRows = 32;                  // two m16 tiles
constexpr int kKChunk = 32;                    // weight columns (k) per staged chunk
constexpr int kPassCols = kWarps * 4 * 8;      // output columns per pass: 4 n8-tiles per warp
constexpr int kPassTiles = kPassCols / 8;      // n8-tiles per pass
constexpr int kFragFloats = b_fragment_floats(false);                  // one B fragment (k8 x n8) of a warp
constexpr int kChunkFloats = kKChunk / 8 * kPassTiles * kFragFloats;  // a full chunk: 32 KB
constexpr int kStages = 3;                     // chunks in flight: compute q, land q+1, load q+2
constexpr int kChunkSteps = kKChunk / 8;       // k-steps of mma.m16n8k8 per chunk

__host__ __device__ inline int pass_tiles(int N, int p) { return b_fragment_pass_tiles(N, kPassTiles, p); }
__host__ __device__ inline int64_t packed_chunk_offset(int N, int kchunks, int p, int kc) {
  return b_fragment_offset(N, kchunks * kChunkSteps, kPassTiles, kc * kChunkSteps, p * kPassTiles);
}

// The pack_b_fragments entry of an [N, K] weight (row stride ld) for this
// core: k padded to Kp (a multiple of kKChunk) and passes of kPassTiles.
// Its size, b_fragment_size(N, Kp / 8), is a multiple of 64 floats, so
// layers packed back to back keep every chunk 16-byte aligned for cp.async.
inline BFragments packed_layer(const float* w, int64_t ld, int N, int K, int Kp, float* out) {
  return {w, ld, N, K, Kp / 8, kPassTiles, out, false};
}

// One layer: `in` holds the split input, k < Kp (zero for k >= the true K:
// the packed weights are zero there too, but 0 * inf would not be);
// Wp the layer's packed weights; wbuf STAGES * kChunkFloats floats of
// shared memory (16-byte aligned).  Starts with a block barrier (the
// previous layer's last chunks may still be read from wbuf and its output,
// this layer's input, written); ends without one.
template <int KEEP, int STAGES = kStages, typename Epilogue>
__device__ __forceinline__ void tiled_layer(const SplitRows in, int Kp, const float* __restrict__ Wp, int N,
                                            float* wbuf, Epilogue&& epi) {
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, tq = lane % 4;
  const int kchunks = Kp / kKChunk, passes = (N + kPassCols - 1) / kPassCols;
  const int num_chunks = kchunks * passes;
  const float* a_lane = in.big + ldmatrix_lane_offset<float>(in.ld);
  static_assert(STAGES == 2 || STAGES == 3, "chunk buffers: two or three");

  // Chunk q's copies into buffer q % STAGES, one commit group per chunk
  // (empty past the last chunk, so every thread's group count is uniform).
  auto issue = [&](int q) {
    if (q < num_chunks) {
      const int p = q / kchunks, kc = q - p * kchunks;
      const float* src = Wp + packed_chunk_offset(N, kchunks, p, kc);
      float* dst = wbuf + (q % STAGES) * kChunkFloats;
      const int granules = pass_tiles(N, p) * (kKChunk / 8 * kFragFloats / 4);
      for (int i = tid; i < granules; i += kThreads) cp_async_16(dst + 4 * i, src + 4 * i);
    }
    cp_async_commit();
  };

  // Adds chunk q (k-chunk kc of pass p, landed in its buffer) to acc for
  // this warp's NV tiles of the pass (warp + kWarps * i, i < NV).  NV is a
  // compile-time constant (run_pass switches on it per chunk, outside the
  // barriers): tile guards inside the product sequence made the compiler
  // fence every mma.sync with a WARPSYNC.
  auto add_chunk = [&](float (&acc)[2][4][4], int q, int kc, int tiles, auto nv) {
    constexpr int NV = decltype(nv)::value;
    const float* buf = wbuf + (q % STAGES) * kChunkFloats + warp * kFragFloats + lane * 2;
    // The chunk's products into a fresh accumulator, added to acc in float32:
    // the tensor cores' own accumulation over a whole K is far less accurate
    // (docs/flow_euler.md, Numerics).
    float part[2][4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKChunk / 8; ++kk) {
      const float* ap = a_lane + kc * kKChunk + kk * 8;
      uint32_t ab[2][4], as[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        ldmatrix_x4(ab[m], ap + m * 16 * in.ld);
        ldmatrix_x4(as[m], ap + m * 16 * in.ld + in.plane_floats);
      }
      uint32_t bb[4][2] = {}, bs[4][2] = {};
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const float2 w = *reinterpret_cast<const float2*>(buf + (kk * tiles + kWarps * i) * kFragFloats);
        const SplitTf32 b0 = split_tf32(w.x), b1 = split_tf32(w.y);
        bb[i][0] = b0.big, bb[i][1] = b1.big, bs[i][0] = b0.small, bs[i][1] = b1.small;
      }
      mma_3xtf32_tiles(part, ab, as, bb, bs, NV);
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][i][e] += part[m][i][e];
  };

  // Accumulates pass p (all its k-chunks) into acc.
  auto run_pass = [&](float (&acc)[2][4][4], int p) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][i][e] = 0.f;
    const int tiles = pass_tiles(N, p);
    const int nv = tiles > warp ? min(4, (tiles - warp + kWarps - 1) / kWarps) : 0;  // warp-uniform
    for (int kc = 0; kc < kchunks; ++kc) {
      const int q = p * kchunks + kc;
      // Chunk q has landed (this thread's copies; chunk q + 1 may still be
      // pending when STAGES = 3), then everyone's; every thread is past
      // chunk q - 1, whose buffer chunk q + STAGES - 1 now reuses.
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      issue(q + STAGES - 1);
      switch (nv) {
        case 4: add_chunk(acc, q, kc, tiles, std::integral_constant<int, 4>{}); break;
        case 3: add_chunk(acc, q, kc, tiles, std::integral_constant<int, 3>{}); break;
        case 2: add_chunk(acc, q, kc, tiles, std::integral_constant<int, 2>{}); break;
        case 1: add_chunk(acc, q, kc, tiles, std::integral_constant<int, 1>{}); break;
        default: break;
      }
    }
  };

  // Output of pass p.  Accumulator e of tile (m, i) is row m*16 + g + 8*(e/2),
  // column 2*tq + e%2 of the n-tile.
  auto epilogue = [&](const float (&acc)[2][4][4], int p) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = m * 16 + g + 8 * (e / 2);
          const int col = p * kPassCols + (warp + kWarps * i) * 8 + 2 * tq + (e % 2);
          if (col >= N) continue;
          epi(row, col, acc[m][i][e]);
        }
  };

  __syncthreads();
  issue(0);
  if (STAGES == 3) issue(1);
  if (KEEP == 0) {
    for (int p = 0; p < passes; ++p) {
      float acc[2][4][4];
      run_pass(acc, p);
      epilogue(acc, p);
    }
  } else {
    float acc[KEEP > 0 ? KEEP : 1][2][4][4];
#pragma unroll
    for (int p = 0; p < KEEP; ++p) run_pass(acc[p], p);
    __syncthreads();  // every warp is past its last read of `in` == `out`
#pragma unroll
    for (int p = 0; p < KEEP; ++p) epilogue(acc[p], p);
  }
}

}  // namespace tiled_mlp
}  // namespace cuda
}  // namespace fused_ops
