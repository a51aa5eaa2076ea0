// \brief The cluster path's warp products (cluster.cu): 16 sample rows held
// in shared memory times weight rows read straight from global memory, on
// the CUDA cores in float32, in a fixed summation order.
//
// A warp takes kNB = 4 neurons (weight rows) at a time and applies each
// weight column to all 16 rows, so every weight is read once per CTA,
// coalesced (as float4 when VEC).  Each lane accumulates a strip of K for
// all 16 rows and 4 neurons; a reduce-scatter over the warp then leaves each
// lane with one (row, neuron) total.  Layers with few neurons per CTA split
// K over several warps instead (split_linear), their partial sums added in
// segment order.  PREFETCH: the next weight column is requested before this
// column's products (software pipelining, ~230 registers: one CTA per SM);
// without it a CTA fits in 128 registers (two CTAs per SM).
#pragma once

#include "cuda/vae_elbo/paths.cuh"

namespace fused_ops {
namespace vae_elbo_kernels {

constexpr int kRows = 16;  // samples per cluster tile (the reduction below assumes 16)
[[maybe_unused]] constexpr int kNB = 4;     // neurons per warp pass (an even number: reduced in pairs)

// Sums a[r] and b[r] (r < 16) over the 32 lanes of the warp: afterwards lane l
// holds the total of (l & 1 ? b : a)[l >> 1].  A reduce-scatter (each step
// halves the values a lane keeps) costs 2 * (8 + 4 + 2 + 1) + 1 shuffles
// instead of 2 * 16 * 5 for two full butterflies; the order is fixed.
// One reduce-scatter step: lanes whose `offset` bit (offset = 2 * HALF) is set
// keep the upper HALF values, the others the lower HALF, each plus its
// partner's copy of them.
template <int HALF>
__device__ __forceinline__ void reduce_step(float (&a)[kRows], float (&b)[kRows], int lane) {
  constexpr int offset = 2 * HALF;
  const bool up = lane & offset;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float sa = up ? a[i] : a[i + HALF], ka = up ? a[i + HALF] : a[i];
    const float sb = up ? b[i] : b[i + HALF], kb = up ? b[i + HALF] : b[i];
    a[i] = ka + __shfl_xor_sync(cuda::kFullMask, sa, offset);
    b[i] = kb + __shfl_xor_sync(cuda::kFullMask, sb, offset);
  }
}

[[maybe_unused]] __device__ __forceinline__ float reduce_pair(float (&a)[kRows], float (&b)[kRows], int lane) {
  static_assert(kRows == 16, "the reduce-scatter below is written for 16 rows");
  reduce_step<8>(a, b, lane);  // offset 16
  reduce_step<4>(a, b, lane);  // offset 8
  reduce_step<2>(a, b, lane);  // offset 4
  reduce_step<1>(a, b, lane);  // offset 2
  // Now a[0] / b[0] hold row (lane >> 1): bits 4..1 of the lane chose the halves.
  const bool odd = lane & 1;
  const float send = odd ? a[0] : b[0], keep = odd ? b[0] : a[0];
  return keep + __shfl_xor_sync(cuda::kFullMask, send, 1);
}

// acc[j][r] += the dot product of float4 column k of row r of `in` (row
// stride K floats) with wv[j].
__device__ __forceinline__ void fma_column4(float (&acc)[kNB][kRows], const float4 (&wv)[kNB],
                                            const float* in, int K, int k) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float4 xv = reinterpret_cast<const float4*>(in + r * K)[k];
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      float s = acc[j][r];
      s = fmaf(wv[j].x, xv.x, s);
      s = fmaf(wv[j].y, xv.y, s);
      s = fmaf(wv[j].z, xv.z, s);
      acc[j][r] = fmaf(wv[j].w, xv.w, s);
    }
  }
}

// Dot products of the kRows rows of `in` (shared memory, row stride K) with
// the kNB weight rows row(g + j), j < kNB, over the float4 columns [k0, k1)
// (VEC; element columns otherwise) split among the lanes, so a warp reads each
// weight row once, coalesced, and applies it to all rows.  Afterwards lane l
// holds out[j / 2] = the dot product of row l >> 1 with weight row
// g + j + (l & 1), for j = 0, 2, ... (rows past `count` read a valid row; the
// caller drops their results).  PREFETCH (VEC only): software-pipelined,
// ~230 registers instead of 128 (one CTA per SM).
template <bool VEC, bool PREFETCH, typename RowFn>
__device__ __forceinline__ void warp_dots(const float* in, int K, int k0, int k1, int g, int count,
                                          RowFn row, float (&out)[kNB / 2]) {
  const int lane = threadIdx.x % cuda::kWarpSize;
  float acc[kNB][kRows];
#pragma unroll
  for (int j = 0; j < kNB; ++j)
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[j][r] = 0.0f;
  const float* w[kNB];
#pragma unroll
  for (int j = 0; j < kNB; ++j) w[j] = row(min(g + j, count - 1));
  if constexpr (VEC && PREFETCH) {
    // The next column's weights are requested before this column's
    // products, so a warp waits for an L2 round trip once per call instead
    // of once per column: at 784-256-32 the encoder's lanes run 6-7 columns
    // each, and these loads would be its critical path.
    float4 wv[kNB];
    int k = k0 + lane;
    if (k < k1) {
#pragma unroll
      for (int j = 0; j < kNB; ++j) wv[j] = __ldg(reinterpret_cast<const float4*>(w[j]) + k);
    }
#pragma unroll 1
    for (; k < k1; k += cuda::kWarpSize) {
      const int next = min(k + cuda::kWarpSize, k1 - 1);  // the last column reloads itself: in range
      float4 wn[kNB];
#pragma unroll
      for (int j = 0; j < kNB; ++j) wn[j] = __ldg(reinterpret_cast<const float4*>(w[j]) + next);
      fma_column4(acc, wv, in, K, k);
#pragma unroll
      for (int j = 0; j < kNB; ++j) wv[j] = wn[j];
    }
  } else if constexpr (VEC) {
    // Not unrolled: unrolling doubles the registers (~250), one CTA per SM
    // instead of two, and a GPC could then hold only one 16-CTA cluster.
#pragma unroll 1
    for (int k = k0 + lane; k < k1; k += cuda::kWarpSize) {
      float4 wv[kNB];
#pragma unroll
      for (int j = 0; j < kNB; ++j) wv[j] = __ldg(reinterpret_cast<const float4*>(w[j]) + k);
      fma_column4(acc, wv, in, K, k);
    }
  } else {
#pragma unroll 2
    for (int k = k0 + lane; k < k1; k += cuda::kWarpSize) {
      float wv[kNB];
#pragma unroll
      for (int j = 0; j < kNB; ++j) wv[j] = __ldg(w[j] + k);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float xv = in[r * K + k];
#pragma unroll
        for (int j = 0; j < kNB; ++j) acc[j][r] = fmaf(wv[j], xv, acc[j][r]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kNB; j += 2) out[j / 2] = reduce_pair(acc[j], acc[j + 1], lane);
}

// out(r, n) = dot(in[r, 0:K], row(n)[0:K]) for the kRows rows of `in` and
// local neurons n < count, handed to epi(r, n, v) by the lane that holds it
// (lane (r << 1) | (n & 1) of some warp: the decoder's BCE sums rely on it).
// Warps take kNB neurons at a time over the whole of K.
template <bool VEC, bool PREFETCH, typename RowFn, typename Epi>
__device__ __forceinline__ void warp_linear(const float* in, int K, int count, RowFn row, Epi epi) {
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int kcols = VEC ? K / 4 : K;
  for (int g = warp * kNB; g < count; g += kWarps * kNB) {
    float v[kNB / 2];
    warp_dots<VEC, PREFETCH>(in, K, 0, kcols, g, count, row, v);
#pragma unroll
    for (int j = 0; j < kNB; j += 2) {
      const int n = g + j + (lane & 1);
      if (n < count) epi(lane >> 1, n, v[j / 2]);
    }
  }
}

// The same product for layers with fewer than kWarps * kNB neurons per CTA
// (the encoder's 16, mu/logvar's 4, the decoder's first layer's 16 at
// 784-256-32 in 16-CTA clusters): warp_linear would leave warps idle while
// the others run the whole of K.  Here the neuron groups' K is cut into
// `split` segments, one warp each; the segments' sums meet in `partial`
// (split * kRows * count floats) and are added in segment order (fixed:
// bitwise reproducible), then epi(r, n, v) runs on any thread.  Contains a
// block barrier (unless there are kWarps groups or more, when it is
// warp_linear): every thread of the CTA must call it.
template <bool VEC, bool PREFETCH, typename RowFn, typename Epi>
__device__ __forceinline__ void split_linear(const float* in, int K, int count, RowFn row, Epi epi,
                                             float* partial) {
  const int groups = (count + kNB - 1) / kNB;
  if (groups >= kWarps) {  // enough neuron groups to keep every warp busy
    warp_linear<VEC, PREFETCH>(in, K, count, row, epi);
    return;
  }
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int split = kWarps / max(groups, 1);
  const int kcols = VEC ? K / 4 : K;
  const int seg = (kcols + split - 1) / split;
  if (warp < groups * split) {
    const int g = (warp / split) * kNB, s = warp % split;
    float v[kNB / 2];
    warp_dots<VEC, PREFETCH>(in, K, min(kcols, s * seg), min(kcols, (s + 1) * seg), g, count, row, v);
#pragma unroll
    for (int j = 0; j < kNB; j += 2) {
      const int n = g + j + (lane & 1);
      if (n < count) partial[(s * kRows + (lane >> 1)) * count + n] = v[j / 2];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * count; idx += kThreads) {
    float v = 0.0f;
    for (int s = 0; s < split; ++s) v += partial[s * kRows * count + idx];
    epi(idx / count, idx % count, v);
  }
}

}  // namespace vae_elbo_kernels
}  // namespace fused_ops
