// \brief fused_ops::flow_euler, row path: one block per batch row, every
// weight held by that block for all steps, at the default D = 64, H = 256.
//
// Chosen for float32 at exactly D = 64, H = 256 with B <= the number of SMs
// (one wave; beyond it the tensor-core paths win) where a block may have
// the ~200 KB of shared memory it needs (sm_90); below half the SM count
// the split path comes first.
//
// Design.  All 98,560 weights stay in the block for the whole integration:
// 96 per thread in registers (49,152), the rest (three quarters of w2) in
// shared memory (192 KB).  Rows are independent, so blocks never talk to
// each other and a layer ends with a block barrier, not a cluster barrier
// plus an exchange (what bounds the cluster path).  What bounds a step
// instead is shared-memory bandwidth: each step streams the shared part of
// the weights once (49,152 floats at 32 per clock, ~1,540 clocks, against
// ~770 clocks of FMAs) -- hence as many weights in registers as fit (512
// threads x 128 registers is the whole register file), and each activation
// read serves several neurons.  Lane layout: row_lanes.cuh.  Loading is one
// coalesced, fully asynchronous pass (cp.async) through the still unused
// w2 region of shared memory.  Sums have a fixed order.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/flow_euler/paths.cuh"
#include "cuda/flow_euler/row_lanes.cuh"
#include "cuda/primitives/cp_async.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

// Shared memory: w2's shared part [chunk][thread] as float4s (a warp's read
// of one chunk is 512 contiguous bytes: conflict-free), then x, h1, h2.
constexpr int kRowX = kRowW2Chunks * kRowThreads * 4;
constexpr int kRowH1 = kRowX + row_pad(kRowD);
constexpr int kRowH2 = kRowH1 + row_pad(kRowH);
constexpr size_t kRowSmem = sizeof(float) * size_t(kRowH2 + row_pad(kRowH));

__global__ void __launch_bounds__(kRowThreads, 1) flow_row_kernel(FlowParams a) {
  extern __shared__ float4 row_smem4[];
  float* smem = reinterpret_cast<float*>(row_smem4);
  float* const xs = smem + kRowX;
  float* const h1 = smem + kRowH1;
  float* const h2 = smem + kRowH2;
  const int tid = threadIdx.x;
  const int g = tid >> 3, s = tid & 7;               // group, lane in group
  const int own = 4 * g + 2 * ((tid >> 2) & 1) + ((tid >> 1) & 1);  // neuron of row_reduce4's result
  const int64_t row = blockIdx.x;

  // Loading: ~400 KB per block once, every global read coalesced and all of
  // a thread's reads in flight (cp.async: direct per-thread register loads
  // are scalar and scattered and fill the load queue; docs/flow_euler.md).
  // The register weights go through the (still free) w2 region
  // of shared memory: w1 and w3 first, then w2's register part; then w2's
  // shared part goes to its place.  (w1's rows of D + 1 floats are not
  // 16-byte aligned, but the whole tensor is, as a copy of it needs.)
  float w1r[4][kRowK1], w2r[4][kRowW2RegK], w3r[kRowK3];
  {
    constexpr int kW1 = kRowH * (kRowD + 1), kW3 = kRowD * kRowH;
    static_assert(kW1 % 4 == 0 && kW1 + kW3 <= kRowX, "w1 and w3 fit the staging region");
    row_copy<kW1 / 4>(smem, a.w1, [](int f) { return f; });
    row_copy<kW3 / 4>(smem + kW1, a.w3, [](int f) { return f; });
    row_copies_done();
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < kRowK1; ++e) w1r[i][e] = smem[(4 * g + i) * (kRowD + 1) + kRowK1 * s + e];
#pragma unroll
    for (int e = 0; e < kRowK3; ++e) w3r[e] = smem[kW1 + g * kRowH + kRowK3 * s + e];
    __syncthreads();
    // w2's register part: float4 r of row n is float4 q = r % (kRowW2RegK / 4)
    // of lane s = r / (kRowW2RegK / 4)'s range, staged as [n][s][kRowW2RegK].
    constexpr int kPerRow = 8 * kRowW2RegK / 4;
    row_copy<kRowH * kPerRow>(smem, a.w2, [](int f) {
      const int n = f / kPerRow, r = f % kPerRow;
      return n * (kRowH / 4) + r / (kRowW2RegK / 4) * (kRowK2 / 4) + r % (kRowW2RegK / 4);
    });
    row_copies_done();
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < kRowW2RegK; ++e) w2r[i][e] = smem[((4 * g + i) * 8 + s) * kRowW2RegK + e];
    __syncthreads();
  }
  // w2's shared part, scattered to [chunk][thread]: element (n, k) belongs
  // to thread 8 (n / 4) + k / 32, chunk (k % 32 / 4 - kRowW2RegK / 4) * 4 +
  // n % 4, when k % 32 is past the register part.
  {
    const bool vec = reinterpret_cast<uintptr_t>(a.w2) % 16 == 0;
    for (int f = tid; f < kRowH * kRowH / 4; f += kRowThreads) {
      const int n = f / (kRowH / 4), q = f % (kRowH / 4);
      const int c = (q % (kRowK2 / 4) - kRowW2RegK / 4) * 4 + n % 4;
      if (c >= 0) row_put4(row_smem4 + c * kRowThreads + 8 * (n / 4) + q / (kRowK2 / 4), a.w2 + 4 * f, vec);
    }
  }
  for (int k = tid; k < kRowD; k += kRowThreads) xs[row_pad(k)] = a.x0[row * kRowD + k];
  row_copies_done();
  const float w_time = a.w1[own * (kRowD + 1) + kRowD], b1 = a.b1[own], b2 = a.b2[own], b3 = a.b3[g];

  const float4* w2s = row_smem4 + tid;
  for (int step = 0; step < a.num_steps; ++step) {
    const float t = flow_step_time<float>(step, a.num_steps);
    {  // h1 = silu(w1 [x, t] + b1)
      const float sum = row_dots4<kRowK1>(xs + row_pad(kRowK1 * s), [&](int i, int k) {
        return make_float4(w1r[i][k], w1r[i][k + 1], w1r[i][k + 2], w1r[i][k + 3]);
      });
      if ((tid & 1) == 0) h1[row_pad(own)] = silu(sum + t * w_time + b1);
    }
    __syncthreads();
    {  // h2 = silu(w2 h1 + b2)
      const float sum = row_dots4<kRowK2>(h1 + row_pad(kRowK2 * s), [&](int i, int k) {
        return k < kRowW2RegK ? make_float4(w2r[i][k], w2r[i][k + 1], w2r[i][k + 2], w2r[i][k + 3])
                              : w2s[((k - kRowW2RegK) + i) * kRowThreads];
      });
      if ((tid & 1) == 0) h2[row_pad(own)] = silu(sum + b2);
    }
    __syncthreads();
    row_euler_update(xs, h2, w3r, b3, a.dt);  // x += dt * (w3 h2 + b3)
    __syncthreads();
  }
  for (int k = tid; k < kRowD; k += kRowThreads) a.x[row * kRowD + k] = xs[row_pad(k)];
}

}  // namespace

namespace flow_euler_paths {

// row_sizes, one block per SM for all rows (one wave; beyond it the tiled
// and wgmma paths' tensor cores win), and the block's shared memory
// available (sm_90).
bool row_applies(const FlowEulerCall& c) {
  if (!row_sizes(c)) return false;
  if (c.B > cuda::multiprocessor_count(cuda::current_device())) return false;
  return kRowSmem <= cuda::max_shared_memory_per_block();
}

void launch_row(const FlowEulerCall& c) {
  cuda::allow_dynamic_smem(flow_row_kernel, kRowSmem);
  flow_row_kernel<<<unsigned(c.B), kRowThreads, kRowSmem, cuda::current_stream(cuda::current_device())>>>(
      flow_params(c));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace flow_euler_paths
}  // namespace fused_ops
