// \brief fused_ops::flow_euler: what the row and split paths share, the
// lane layout of one batch row per block (or per cluster) at the default
// D = 64, H = 256 with 512 threads.
//
// Work split, 8 lanes per group, lane s of a group summing the k-range s:
//   layers 1, 2  group g owns neurons 4g .. 4g+3 and each lane holds their
//                weights for its k-range (8 of K = 64, 32 of K = 256), so an
//                input float4 feeds 16 FMAs; the four sums are reduced over
//                the group's lanes by a reduce-scatter (row_reduce4);
//   layer 3      group d owns output d, 32 k per lane, a 3-shuffle butterfly.
// Every lane that ends up holding a sum holds the identical value (the two
// lanes of the last shuffle add the same two numbers, a + b == b + a).
// Activations live in shared memory with 4 floats of padding after every 32
// (row_pad); weights in registers or shared memory as each path decides.
#pragma once

#include <cstdint>

#include "cuda/flow_euler/paths.cuh"
#include "cuda/primitives/cp_async.cuh"

namespace fused_ops {
namespace {

constexpr int kRowThreads = 2 * kRowH;
constexpr int kRowK1 = kRowD / 8, kRowK2 = kRowH / 8, kRowK3 = kRowH / 8;  // k per lane in layers 1-3
constexpr int kRowW2RegK = 8;                                  // of a lane's kRowK2 layer-2 k, in registers
constexpr int kRowW2Chunks = (kRowK2 - kRowW2RegK) / 4 * 4;    // the rest: float4 chunks (k-quad x neuron)
static_assert(kRowThreads / 8 == kRowH / 4 && kRowThreads / 8 == kRowD, "a group per 4 neurons / per output");

// Activation index with 4 floats of padding after every 32: the 8 lanes of a
// group read one float4 each at the same offset into their own k-ranges,
// and the padding puts those 8 float4s in 8 distinct bank quads.
__host__ __device__ constexpr int row_pad(int k) { return k + k / 32 * 4; }
// Sums of four neurons' partials over the 8 lanes of a group, returned for
// neuron 2 * lane bit 2 + lane bit 1 (lanes L and L ^ 1 get the same one):
// each step keeps half of the remaining neurons and trades the other half
// with the partner lane, 4 shuffles instead of 3 per neuron.  Fixed order.
__device__ __forceinline__ float row_reduce4(const float (&v)[4]) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const bool hi = lane & 4, mid = lane & 2;
  float a0 = hi ? v[2] : v[0], a1 = hi ? v[3] : v[1];
  a0 += __shfl_xor_sync(kFullMask, hi ? v[0] : v[2], 4);
  a1 += __shfl_xor_sync(kFullMask, hi ? v[1] : v[3], 4);
  float b = mid ? a1 : a0;
  b += __shfl_xor_sync(kFullMask, mid ? a0 : a1, 2);
  return b + __shfl_xor_sync(kFullMask, b, 1);
}

// The sum of a over the 8 lanes of a group, identical on all 8 (a
// butterfly: both lanes of each shuffle add the same two numbers).
__device__ __forceinline__ float group_sum8(float a) {
  a += __shfl_xor_sync(kFullMask, a, 4);
  a += __shfl_xor_sync(kFullMask, a, 2);
  return a + __shfl_xor_sync(kFullMask, a, 1);
}

// acc += w . v, the four products in a fixed order.
__device__ __forceinline__ void row_fma4(float& acc, const float4& w, const float4& v) {
  acc = fmaf(w.x, v.x, acc);
  acc = fmaf(w.y, v.y, acc);
  acc = fmaf(w.z, v.z, acc);
  acc = fmaf(w.w, v.w, acc);
}

// This lane's partial sums of N neurons over its K-float range `in`
// (weights(i, k): neuron i's weights k .. k+3 as a float4), one chain per
// neuron.  Fully unrolled, so register weights are indexed by constants.
template <int N, int K, typename Weights>
__device__ __forceinline__ void row_partial_dots(float (&acc)[N], const float* in, Weights weights) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = 0.f;
#pragma unroll
  for (int k = 0; k < K; k += 4) {
    const float4 v = *reinterpret_cast<const float4*>(in + k);
#pragma unroll
    for (int i = 0; i < N; ++i) row_fma4(acc[i], weights(i, k), v);
  }
}

// Layers 1 and 2 of the row path (layer 1 of the split path): the group's
// four neurons, reduced over the group (row_reduce4).
template <int K, typename Weights>
__device__ __forceinline__ float row_dots4(const float* in, Weights weights) {
  float acc[4];
  row_partial_dots<4, K>(acc, in, weights);
  return row_reduce4(acc);
}

// Layer 3's dot product w3[d] . h2 for the group's output d = g, lane s
// summing k in [32 s, 32 s + 32) with its register weights w3r (four
// partial sums, then a 3-shuffle butterfly): identical on all 8 lanes.
__device__ __forceinline__ float row_out_dot(const float* h2, const float (&w3r)[kRowK3]) {
  const int s = int(threadIdx.x) & 7;
  const float* in = h2 + row_pad(kRowK3 * s);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < kRowK3; k += 4) {
    const float4 v = *reinterpret_cast<const float4*>(in + k);
    acc[0] = fmaf(w3r[k], v.x, acc[0]);
    acc[1] = fmaf(w3r[k + 1], v.y, acc[1]);
    acc[2] = fmaf(w3r[k + 2], v.z, acc[2]);
    acc[3] = fmaf(w3r[k + 3], v.w, acc[3]);
  }
  return group_sum8((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

// Layer 3 of the row and split paths: x[d] += dt * (w3[d] . h2 + b3) for the
// group's output d = g (row_out_dot); lane 0 of the group writes.
__device__ __forceinline__ void row_euler_update(float* xs, const float* h2, const float (&w3r)[kRowK3],
                                                 float b3, float dt) {
  const int g = int(threadIdx.x) >> 3, s = int(threadIdx.x) & 7;
  const float sum = row_out_dot(h2, w3r);
  if (s == 0) xs[row_pad(g)] = euler_step(xs[row_pad(g)], dt, sum + b3);
}

// v = p[0..3] as one float4 load when `vec` (16-byte aligned), else four.
[[maybe_unused]] __device__ __forceinline__ float4 row_load4(const float* p, bool vec) {
  return vec ? *reinterpret_cast<const float4*>(p) : make_float4(p[0], p[1], p[2], p[3]);
}

// *dst = src[0..3]: an asynchronous 16-byte copy (cp.async: no registers,
// every copy of a thread in flight at once) when `vec` (src 16-byte
// aligned), else four loads and a store.  Callers end a round of copies
// with row_copies_done.
__device__ __forceinline__ void row_put4(float4* dst, const float* src, bool vec) {
  if (vec) {
    cuda::cp_async_16(dst, src);
  } else {
    *dst = make_float4(src[0], src[1], src[2], src[3]);
  }
}

__device__ __forceinline__ void row_copies_done() {
  cuda::cp_async_commit();
  cuda::cp_async_wait<0>();
  __syncthreads();
}

// float4 f of dst = float4 src_quad(f) of src, for f < N (all threads).
template <int N, typename SrcQuad>
__device__ __forceinline__ void row_copy(float* dst, const float* src, SrcQuad src_quad) {
  const bool vec = reinterpret_cast<uintptr_t>(src) % 16 == 0;
#pragma unroll 4
  for (int f = int(threadIdx.x); f < N; f += kRowThreads) {
    row_put4(reinterpret_cast<float4*>(dst) + f, src + 4 * src_quad(f), vec);
  }
}

}  // namespace
}  // namespace fused_ops
