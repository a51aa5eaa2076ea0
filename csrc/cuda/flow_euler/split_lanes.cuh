// \brief What the split paths (cuda/flow_euler/split.cu, cuda/ode_mlp/split.cu)
// share: one batch row per thread-block cluster of C = 2 or 4 blocks, the
// row paths' lane layout (row_lanes.cuh) with layer 2's 256 neurons split
// C ways and its slices exchanged by st.async.
//
// Per block: layers 1 and 3 in full (the same values in every block of the
// cluster), layer 2 for its 1/C of the neurons.  Registers: C = 4 keeps
// every weight a block uses in registers (layer 1, the layer-2 slice,
// layer 3: 96 floats per thread); C = 2 keeps the layer-2 half and layer 3,
// and layer 1 streams from shared memory as [chunk][thread] float4s
// (conflict-free).  Layer 2: group g owns the block's neurons 4g/C ..
// (4g+4)/C - 1, 32 k per lane in registers, reduced by a 3-shuffle
// reduce-scatter (C = 2, pair_reduce2) or butterfly (C = 4, group_sum8);
// each block stores its slice into its own copy of h2 and, by st.async,
// into every partner's, completing the partner's mbarrier phase
// (cuda/primitives/mbarrier.cuh).  h2 and its mbarrier are double buffered
// by evaluation parity: a block may run one layer 2 ahead of a partner's
// layer 3, never two (its layer 3 needs the partner's next slice, which the
// partner computes only after its own layer 3), so a store never lands in a
// buffer still being read, nor on a phase still open.  The block's own
// slice is published by a block barrier, not by per-warp arrivals on the
// mbarrier: compute-sanitizer's racecheck can follow the former.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "cuda/flow_euler/row_lanes.cuh"
#include "cuda/primitives/mbarrier.cuh"

namespace fused_ops {
namespace {

template <int C>
struct SplitLanes {
  static_assert(C == 2 || C == 4, "two or four blocks per row");
  static constexpr int kNeurons2 = kRowH / C;                   // layer-2 neurons per block
  static constexpr int kPer = kNeurons2 / (kRowThreads / 8);    // ... per group of 8 lanes
  static constexpr bool kW1InRegisters = C == 4;                // layer 1's weights: registers or shared
  static constexpr int kW1Rows = kW1InRegisters ? 4 : 1;        // register rows of layer 1 per thread
  static constexpr int kW1Chunks = kW1InRegisters ? 0 : kRowK1;  // float4s of layer 1 per thread in shared
  // Layer 2's neuron whose reduced sum this lane holds in block `rank`,
  // and whether the lane is the one that stores it; kept across the loop.
  __device__ static int own2(int rank) {
    const int tid = int(threadIdx.x);
    return kNeurons2 * rank + kPer * (tid >> 3) + (kPer == 2 ? (tid >> 2) & 1 : 0);
  }
  __device__ static bool stores2() { return (int(threadIdx.x) & (kPer == 2 ? 3 : 7)) == 0; }
  // The partners' h2 bytes per evaluation.
  __host__ __device__ static constexpr uint32_t peer_bytes() { return uint32_t((C - 1) * kNeurons2 * sizeof(float)); }
};
static_assert(SplitLanes<2>::kPer == 2 && SplitLanes<4>::kPer == 1, "groups own 2 or 1 layer-2 neurons");

// Sums of two neurons' partials over the 8 lanes of a group, returned for
// neuron lane bit 2 (all four lanes that share it get the identical value:
// each step adds the same two numbers on both lanes).  Fixed order.
[[maybe_unused]] __device__ __forceinline__ float pair_reduce2(const float (&v)[2]) {
  const bool hi = int(threadIdx.x) & 4;
  float a = hi ? v[1] : v[0];
  a += __shfl_xor_sync(kFullMask, hi ? v[0] : v[1], 4);
  a += __shfl_xor_sync(kFullMask, a, 2);
  return a + __shfl_xor_sync(kFullMask, a, 1);
}

// Layer 2's register weights (block `rank`'s neurons of this lane's group,
// its k-range) and layer 3's (output g), straight from global memory as
// float4s, all in flight at once; scalar loads for misaligned tensors.
template <int C>
__device__ __forceinline__ void split_load_registers(float (&w2r)[SplitLanes<C>::kPer][kRowK2],
                                                     float (&w3r)[kRowK3], const float* w2, const float* w3,
                                                     int rank) {
  using S = SplitLanes<C>;
  const int g = int(threadIdx.x) >> 3, s = int(threadIdx.x) & 7;
  const bool vec2 = reinterpret_cast<uintptr_t>(w2) % 16 == 0;
  const bool vec3 = reinterpret_cast<uintptr_t>(w3) % 16 == 0;
#pragma unroll
  for (int j = 0; j < S::kPer; ++j)
#pragma unroll
    for (int e = 0; e < kRowK2; e += 4) {
      const float4 v = row_load4(w2 + (S::kNeurons2 * rank + S::kPer * g + j) * kRowH + kRowK2 * s + e, vec2);
      w2r[j][e] = v.x, w2r[j][e + 1] = v.y, w2r[j][e + 2] = v.z, w2r[j][e + 3] = v.w;
    }
#pragma unroll
  for (int e = 0; e < kRowK3; e += 4) {
    const float4 v = row_load4(w3 + g * kRowH + kRowK3 * s + e, vec3);
    w3r[e] = v.x, w3r[e + 1] = v.y, w3r[e + 2] = v.z, w3r[e + 3] = v.w;
  }
}

// Layer 1's weights of this lane (its group's 4 neurons, its k-range) from
// the staged copy (rows of kStride floats, after row_copies_done) into
// registers (C = 4) or into its own [chunk][thread] float4s of `chunks`
// (C = 2).  Each thread reads only the staged weights it needs and writes
// only its own chunks: no barrier after.
template <int C, int kStride>
__device__ __forceinline__ void split_take_w1(float (&w1r)[SplitLanes<C>::kW1Rows][kRowK1], float4* chunks,
                                              const float* staged) {
  const int tid = int(threadIdx.x), g = tid >> 3, s = tid & 7;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int q = 0; q < kRowK1 / 4; ++q) {
      const float* w = staged + (4 * g + i) * kStride + kRowK1 * s + 4 * q;
      if constexpr (SplitLanes<C>::kW1InRegisters) {
#pragma unroll
        for (int e = 0; e < 4; ++e) w1r[i][4 * q + e] = w[e];
      } else {
        chunks[(i * (kRowK1 / 4) + q) * kRowThreads + tid] = make_float4(w[0], w[1], w[2], w[3]);
      }
    }
}

// Layer 1's dot products for the lane's group (row_dots4) over the input
// xs, with the weights where split_take_w1 put them (`chunks` as there).
template <int C>
__device__ __forceinline__ float split_layer1(const float* xs, const float (&w1r)[SplitLanes<C>::kW1Rows][kRowK1],
                                              const float4* chunks) {
  const int s = int(threadIdx.x) & 7;
  const float4* w1s = chunks + threadIdx.x;
  return row_dots4<kRowK1>(xs + row_pad(kRowK1 * s), [&](int n, int q) {
    if constexpr (SplitLanes<C>::kW1InRegisters) {
      return make_float4(w1r[n][q], w1r[n][q + 1], w1r[n][q + 2], w1r[n][q + 3]);
    } else {
      return w1s[(n * (kRowK1 / 4) + q / 4) * kRowThreads];
    }
  });
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // st.async and mbarriers: the kernels' sm_90 code only
// Layer 2: this block's slice of act(w2 h1 + b2) (b2 the full bias vector,
// in shared memory), stored by the lanes `stores` (SplitLanes::stores2)
// into the block's own h2 at neuron own2 (SplitLanes::own2) and into
// every partner's by st.async against h2_ready.  The caller publishes its
// own slice by a block barrier and waits on h2_ready for the partners'.
template <int C, typename Act>
__device__ __forceinline__ void split_layer2(const float* h1, const float (&w2r)[SplitLanes<C>::kPer][kRowK2],
                                             const float* b2, float* h2, uint64_t* h2_ready, int rank, int own2,
                                             bool stores, Act act) {
  constexpr int kPer = SplitLanes<C>::kPer;
  const int s = int(threadIdx.x) & 7;
  float acc[kPer];
  row_partial_dots<kPer, kRowK2>(acc, h1 + row_pad(kRowK2 * s), [&](int j, int q) {
    return make_float4(w2r[j][q], w2r[j][q + 1], w2r[j][q + 2], w2r[j][q + 3]);
  });
  float sum;
  if constexpr (kPer == 2) {
    sum = pair_reduce2(acc);
  } else {
    sum = group_sum8(acc[0]);
  }
  if (stores) {
    const float value = act(sum + b2[own2]);
    float* const dst = h2 + row_pad(own2);
    *dst = value;
#pragma unroll
    for (int p = 1; p < C; ++p) cuda::st_async(dst, value, h2_ready, rank ^ p);
  }
}

// The two h2 mbarriers initialised, then every block of the cluster running
// and initialised before any stores into another.
__device__ __forceinline__ void split_init_barriers(uint64_t* bars, cooperative_groups::cluster_group& cluster) {
  if (threadIdx.x == 0) {
    cuda::mbarrier_init(bars, 1);
    cuda::mbarrier_init(bars + 1, 1);
    cuda::mbarrier_init_fence();
  }
  cluster.sync();
}

#endif

}  // namespace
}  // namespace fused_ops
