// \brief fused_ops::flow_euler, split path: C = 4 or 2 blocks per batch row
// (a thread-block cluster of C) at the default D = 64, H = 256, so that
// every weight a block uses fits in its registers.
//
// Chosen for float32 at exactly D = 64, H = 256 on sm_90 when all C * B
// blocks are resident at once: C = 4 when 4 B <= the number of SMs, else
// C = 2 when 2 B <= the number of SMs (the small-batch default B = 8 takes
// C = 4); above, the row path.
//
// Design.  The row path is bound by streaming three quarters of w2 from
// shared memory every step; here each block computes layers 1 and 3 in
// full (the same values in every block of the cluster) but only its 1/C of
// layer 2's 256 neurons.  With C = 4 every weight a block uses fits in its
// registers (w1, w2's quarter and w3: 96 floats per thread) and no weight
// is read from shared memory in the loop; with C = 2 w2's half and w3 fill
// the registers and w1 streams from shared memory each step (16,384 floats,
// against 49,152 in the row path).  The price is one exchange per step
// instead of none: each block stores its slice of h2 into its own copy and,
// by st.async, into every partner's (cuda/primitives/mbarrier.cuh); after
// the block barrier that publishes its own slice it waits on an mbarrier
// that completes when the partners' bytes have landed -- no cluster
// barrier.  h2 and its mbarrier are double buffered by step parity: a block
// may run one layer-2 ahead of a partner's layer 3, never two (its layer 3
// needs the partner's next slice, which the partner computes only after its
// own layer 3), so a store never lands in a buffer still being read, nor on
// a phase still open.  The block's own slice is published by a block
// barrier, not by per-warp arrivals on the mbarrier: compute-sanitizer's
// racecheck can follow the former.
// Work split (groups of 8 lanes, lane s sums the k-range s; row_lanes.cuh):
//   layer 1  as the row path (C = 4: the same registers; C = 2: each lane's
//            8 float4s in shared memory, stored [chunk][thread]:
//            conflict-free);
//   layer 2  group g owns the block's neurons 4g/C .. (4g+4)/C - 1, 32 k per
//            lane in registers; C = 2: a 3-shuffle reduce-scatter
//            (pair_reduce2), C = 4: a 3-shuffle butterfly (group_sum8);
//   layer 3  as the row path.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/flow_euler/paths.cuh"
#include "cuda/flow_euler/row_lanes.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

namespace cg = cooperative_groups;

template <int C>
struct Split {
  static_assert(C == 2 || C == 4, "two or four blocks per row");
  static constexpr int kNeurons2 = kRowH / C;          // layer-2 neurons per block
  static constexpr int kPerGroup2 = kNeurons2 / (kRowThreads / 8);  // ... per group of 8 lanes
  static constexpr bool kW1InRegisters = C == 4;
  static constexpr int kW1Chunks = kW1InRegisters ? 0 : 4 * kRowK1 / 4;  // float4s of w1 per thread
  // The partners' h2 bytes per step.
  static constexpr uint32_t peer_bytes() { return uint32_t((C - 1) * kNeurons2 * sizeof(float)); }
  // Shared memory (floats): w1 [chunk][thread] float4s (C = 2), w1's plain
  // copy (staging while loading), x, h1, h2 twice, biases (b1, w1's time
  // column, b2, b3), two mbarriers.
  static constexpr int kStage = kW1Chunks * kRowThreads * 4;
  static constexpr int kX = kStage + (kRowH * (kRowD + 1) + 3) / 4 * 4;
  static constexpr int kH1 = kX + row_pad(kRowD);
  static constexpr int kH2 = kH1 + row_pad(kRowH);  // two buffers of row_pad(kRowH)
  static constexpr int kB1 = kH2 + 2 * row_pad(kRowH);
  static constexpr int kWT = kB1 + kRowH;
  static constexpr int kB2 = kWT + kRowH;
  static constexpr int kB3 = kB2 + kRowH;
  static constexpr int kBars = kB3 + kRowD;
  static_assert(kBars % 2 == 0, "mbarriers are 8-byte aligned");
  static constexpr size_t kSmem = sizeof(float) * size_t(kBars) + 2 * sizeof(uint64_t);
};
static_assert(Split<2>::kPerGroup2 == 2 && Split<4>::kPerGroup2 == 1, "groups own 2 or 1 layer-2 neurons");

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

template <int C>
__global__ void __launch_bounds__(kRowThreads, 1) flow_split_kernel(FlowParams a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Split<C>;
  constexpr int kPer = S::kPerGroup2;
  extern __shared__ float4 split_smem4[];
  float* smem = reinterpret_cast<float*>(split_smem4);
  float* const xs = smem + S::kX;
  float* const h1 = smem + S::kH1;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int tid = threadIdx.x;
  const int g = tid >> 3, s = tid & 7;
  const int own = 4 * g + 2 * ((tid >> 2) & 1) + ((tid >> 1) & 1);  // layer-1 neuron (row_reduce4)
  // Layer-2 neuron of this lane's reduced sum, and whether the lane stores it.
  const int own2 = S::kNeurons2 * rank + kPer * g + (kPer == 2 ? (tid >> 2) & 1 : 0);
  const bool stores2 = (tid & (kPer == 2 ? 3 : 7)) == 0;
  const int64_t row = blockIdx.x / C;

  // Loading: w1 copied whole (coalesced, cp.async where aligned) into the
  // staging area, from which each thread takes its own part (registers or
  // its [chunk][thread] float4s); the other register weights (w2's slice,
  // w3) straight from global memory as float4s, all in flight at once; the
  // scalar fallbacks serve misaligned tensors.
  row_copy<kRowH * (kRowD + 1) / 4>(smem + S::kStage, a.w1, [](int f) { return f; });
  float w1r[S::kW1InRegisters ? 4 : 1][kRowK1], w2r[kPer][kRowK2], w3r[kRowK3];
  const bool vec2 = reinterpret_cast<uintptr_t>(a.w2) % 16 == 0;
  const bool vec3 = reinterpret_cast<uintptr_t>(a.w3) % 16 == 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j)
#pragma unroll
    for (int e = 0; e < kRowK2; e += 4) {
      const float4 v = row_load4(a.w2 + (S::kNeurons2 * rank + kPer * g + j) * kRowH + kRowK2 * s + e, vec2);
      w2r[j][e] = v.x, w2r[j][e + 1] = v.y, w2r[j][e + 2] = v.z, w2r[j][e + 3] = v.w;
    }
#pragma unroll
  for (int e = 0; e < kRowK3; e += 4) {
    const float4 v = row_load4(a.w3 + g * kRowH + kRowK3 * s + e, vec3);
    w3r[e] = v.x, w3r[e + 1] = v.y, w3r[e + 2] = v.z, w3r[e + 3] = v.w;
  }
  for (int j = tid; j < kRowH; j += kRowThreads) {
    smem[S::kB1 + j] = a.b1[j];
    smem[S::kWT + j] = a.w1[j * (kRowD + 1) + kRowD];
    smem[S::kB2 + j] = a.b2[j];
  }
  for (int d = tid; d < kRowD; d += kRowThreads) {
    smem[S::kB3 + d] = a.b3[d];
    xs[row_pad(d)] = a.x0[row * kRowD + d];
  }
  row_copies_done();
  // Each thread reads only the staged weights it needs and writes only its
  // own chunks: no barrier after.
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int q = 0; q < kRowK1 / 4; ++q) {
      const float* w = smem + S::kStage + (4 * g + i) * (kRowD + 1) + kRowK1 * s + 4 * q;
      if constexpr (S::kW1InRegisters) {
#pragma unroll
        for (int e = 0; e < 4; ++e) w1r[i][4 * q + e] = w[e];
      } else {
        split_smem4[(i * (kRowK1 / 4) + q) * kRowThreads + tid] = make_float4(w[0], w[1], w[2], w[3]);
      }
    }
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + S::kBars);
  if (tid == 0) {
    cuda::mbarrier_init(bars, 1);
    cuda::mbarrier_init(bars + 1, 1);
    cuda::mbarrier_init_fence();
  }
  // Every block running and initialised (its mbarriers too) before any
  // stores into another.
  cluster.sync();

  const float4* w1s = split_smem4 + tid;
  for (int step = 0; step < a.num_steps; ++step) {
    const float t = flow_step_time<float>(step, a.num_steps);
    float* const h2 = smem + S::kH2 + (step & 1) * row_pad(kRowH);
    uint64_t* const h2_ready = bars + (step & 1);
    // This step's phase of h2_ready: one arrival (here, early, off the
    // critical path) and the partners' bytes.
    if (tid == 0) cuda::mbarrier_arrive_expect_tx(h2_ready, S::peer_bytes());
    {  // h1 = silu(w1 [x, t] + b1), all 256 neurons
      const float sum = row_dots4<kRowK1>(xs + row_pad(kRowK1 * s), [&](int i, int k) {
        if constexpr (S::kW1InRegisters) {
          return make_float4(w1r[i][k], w1r[i][k + 1], w1r[i][k + 2], w1r[i][k + 3]);
        } else {
          return w1s[(i * (kRowK1 / 4) + k / 4) * kRowThreads];
        }
      });
      if ((tid & 1) == 0) h1[row_pad(own)] = silu(sum + t * smem[S::kWT + own] + smem[S::kB1 + own]);
    }
    __syncthreads();
    {  // h2 = silu(w2 h1 + b2), this block's slice, stored into every block
      float acc[kPer];
      row_partial_dots<kPer, kRowK2>(acc, h1 + row_pad(kRowK2 * s), [&](int j, int k) {
        return make_float4(w2r[j][k], w2r[j][k + 1], w2r[j][k + 2], w2r[j][k + 3]);
      });
      float sum;
      if constexpr (kPer == 2) {
        sum = pair_reduce2(acc);
      } else {
        sum = group_sum8(acc[0]);
      }
      if (stores2) {
        const float value = silu(sum + smem[S::kB2 + own2]);
        float* const dst = h2 + row_pad(own2);
        *dst = value;
#pragma unroll
        for (int p = 1; p < C; ++p) cuda::st_async(dst, value, h2_ready, rank ^ p);
      }
    }
    // The own slice by a block barrier, the partners' by the mbarrier phase.
    __syncthreads();
    cuda::mbarrier_wait(h2_ready, (step >> 1) & 1);
    // x += dt * (w3 h2 + b3), all 64 outputs (the same values in every block)
    row_euler_update(xs, h2, w3r, smem[S::kB3 + g], a.dt);
    __syncthreads();
  }
  // Each block has waited for every store into it, but none leaves while a
  // partner may still read or write the cluster's shared memory; x is the
  // same in every block.
  cluster.sync();
  if (rank == 0) {
    for (int k = tid; k < kRowD; k += kRowThreads) a.x[row * kRowD + k] = xs[row_pad(k)];
  }
#else
  __trap();  // launched only on compute capability >= 9.0
#endif
}

// Blocks per row for the split path (4, else 2), or 0 when it does not take
// this call: row_sizes, sm_90, and all C * B blocks resident at once (one
// wave).
int split_blocks_for(const FlowEulerCall& c) {
  if (!row_sizes(c)) return 0;
  if (cuda::compute_capability_major() < 9) return 0;
  const int64_t sms = cuda::multiprocessor_count(cuda::current_device());
  if (4 * c.B <= sms && cuda::cluster_fits(flow_split_kernel<4>, 4, kRowThreads, Split<4>::kSmem)) return 4;
  if (2 * c.B <= sms && cuda::cluster_fits(flow_split_kernel<2>, 2, kRowThreads, Split<2>::kSmem)) return 2;
  return 0;
}

template <int C>
void launch_split_cluster(const FlowEulerCall& c) {
  cuda::allow_dynamic_smem(flow_split_kernel<C>, Split<C>::kSmem);
  const cuda::ClusterLaunch launch(C * c.B, C, kRowThreads, Split<C>::kSmem,
                                   cuda::current_stream(cuda::current_device()));
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, flow_split_kernel<C>, flow_params(c)));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

namespace flow_euler_paths {

bool split_applies(const FlowEulerCall& c) { return split_blocks_for(c) != 0; }

void launch_split(const FlowEulerCall& c) {
  if (split_blocks_for(c) == 4) {
    launch_split_cluster<4>(c);
  } else {
    launch_split_cluster<2>(c);
  }
}

}  // namespace flow_euler_paths
}  // namespace fused_ops
