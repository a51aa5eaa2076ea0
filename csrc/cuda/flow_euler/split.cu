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
// full but only its 1/C of layer 2's 256 neurons, so that no weight (C = 4)
// or only w1 (C = 2: 16,384 floats, against 49,152 in the row path) is read
// from shared memory in the loop.  The price is one exchange of h2 per step
// instead of none; the cluster layout, the exchange and why it is safe are
// in cuda/flow_euler/split_lanes.cuh.  Layer 1 as the row path (w1's time
// column added as t * w1[:, D]), layer 3 as the row path.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/flow_euler/paths.cuh"
#include "cuda/flow_euler/row_lanes.cuh"
#include "cuda/flow_euler/split_lanes.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

namespace cg = cooperative_groups;

// Shared memory (floats): w1 [chunk][thread] float4s (C = 2), w1's plain
// copy (staging while loading), x, h1, h2 twice, biases (b1, w1's time
// column, b2, b3), two mbarriers.
template <int C>
struct Split : SplitLanes<C> {
  static constexpr int kStage = SplitLanes<C>::kW1Chunks * kRowThreads * 4;
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

template <int C>
__global__ void __launch_bounds__(kRowThreads, 1) flow_split_kernel(FlowParams a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Split<C>;
  extern __shared__ float4 split_smem4[];
  float* smem = reinterpret_cast<float*>(split_smem4);
  float* const xs = smem + S::kX;
  float* const h1 = smem + S::kH1;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int tid = threadIdx.x;
  const int g = tid >> 3;
  const int own = 4 * g + 2 * ((tid >> 2) & 1) + ((tid >> 1) & 1);  // layer-1 neuron (row_reduce4)
  const int64_t row = blockIdx.x / C;

  // Loading: w1 copied whole (coalesced, cp.async where aligned) into the
  // staging area, from which each thread takes its own part; the register
  // weights of w2 and w3 straight from global memory.
  row_copy<kRowH * (kRowD + 1) / 4>(smem + S::kStage, a.w1, [](int f) { return f; });
  float w1r[S::kW1Rows][kRowK1], w2r[S::kPer][kRowK2], w3r[kRowK3];
  split_load_registers<C>(w2r, w3r, a.w2, a.w3, rank);
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
  split_take_w1<C, kRowD + 1>(w1r, split_smem4, smem + S::kStage);
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + S::kBars);
  split_init_barriers(bars, cluster);

  const int own2 = S::own2(rank);
  const bool stores2 = S::stores2();
  const auto act = [](float z) { return silu(z); };
  for (int step = 0; step < a.num_steps; ++step) {
    const float t = flow_step_time<float>(step, a.num_steps);
    float* const h2 = smem + S::kH2 + (step & 1) * row_pad(kRowH);
    uint64_t* const h2_ready = bars + (step & 1);
    // This step's phase of h2_ready: one arrival (here, early, off the
    // critical path) and the partners' bytes.
    if (tid == 0) cuda::mbarrier_arrive_expect_tx(h2_ready, S::peer_bytes());
    {  // h1 = silu(w1 [x, t] + b1), all 256 neurons
      const float sum = split_layer1<C>(xs, w1r, split_smem4);
      if ((tid & 1) == 0) h1[row_pad(own)] = silu(sum + t * smem[S::kWT + own] + smem[S::kB1 + own]);
    }
    __syncthreads();
    // h2 = silu(w2 h1 + b2), this block's slice, stored into every block
    split_layer2<C>(h1, w2r, smem + S::kB2, h2, h2_ready, rank, own2, stores2, act);
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
