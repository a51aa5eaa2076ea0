// \brief fused_ops::ode_mlp, split path: the seed field (D = 64, three
// Linear layers 64 -> 256 -> 256 -> 64, SiLU) in float32 on sm_90 with
// C = 4 or 2 blocks per batch row (a thread-block cluster of C), every
// method, all steps and stages in one launch.
//
// When chosen: float32, compute capability >= 9.0, exactly D = 64, widths
// 256, 256, 64, SiLU, and all C * B blocks resident at once: C = 4 when
// 4 B <= the number of SMs, else C = 2 when 2 B <= the number of SMs (an
// H200's 132 SMs: B <= 33 takes C = 4, B <= 66 C = 2).
//
// Design: flow_euler's split kernel generalised from Euler with a time
// column to torchdiffeq's Runge-Kutta tableaux with per-evaluation
// time_bias rows; the cluster layout, the exchange of layer 2's slices and
// why it is safe are in cuda/flow_euler/split_lanes.cuh (double buffering
// by evaluation parity, as there).  Per evaluation e (step k, stage i):
//   layer 1  h1 = silu(W0 Y + time_bias[e] (+ sample_bias[row])): time_bias
//            row e+1 is copied into shared memory (cp.async) during
//            evaluation e, sample_bias's row once;
//   layer 2  this block's slice of silu(W1 h1 + b1), pushed to the cluster;
//   layer 3  K_i = W2 h2 + b2 for output d = group g; the group's lane 0
//            keeps y[d] and K_0..K_i[d] in shared memory (its own slots, no
//            barrier needed) and writes either the next stage input
//            Y = y + dt sum_j a_{i+1,j} K_j or, after the last stage, the
//            new state y + dt sum_j b_j K_j as layer 1's next input (and,
//            all_states, into states[k + 1] from block 0).
// dt = t[k+1] - t[k] in float32 from device memory, t read one step ahead.
//
// Numerics: float32 FMA dot products in a fixed order (bitwise
// reproducible; flow_euler's order, not general.cu's lane-strided one, so
// the two paths agree to rounding); bias then sample_bias added as
// general.cu adds them; the Runge-Kutta combinations are general.cu's
// expressions term by term (zero tableau entries skipped).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/flow_euler/row_lanes.cuh"
#include "cuda/flow_euler/split_lanes.cuh"
#include "cuda/ode_mlp/paths.cuh"
#include "cuda/primitives/cp_async.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

namespace cg = cooperative_groups;

// The field's activation: the path is compiled for SiLU only (the seed
// program's); other activations take the cluster or fused paths.
constexpr int64_t kSplitAct = kActSiLU;

struct OdeSplitParams {
  const float *x0, *t, *time_bias, *sample_bias;  // sample_bias: nullptr when none
  const float *w0, *w1, *w2, *b1, *b2;            // [256, 64], [256, 256], [64, 256]; b1 [256], b2 [64]
  float* states;
  int S, stages, num_evals, all_states;
  float A[kOdeMaxStages][kOdeMaxStages], Bw[kOdeMaxStages];  // the tableau in float32
};

// Shared memory (floats; every array a multiple of 4): W0 [chunk][thread]
// float4s (C = 2), W0's plain copy (staging while loading), the layer-1
// input xs, h1, h2 twice, time_bias rows twice, sample_bias's row, b1, b2,
// y, K [stages][64], two mbarriers.
template <int C>
struct OdeSplit : SplitLanes<C> {
  static constexpr int kStage = SplitLanes<C>::kW1Chunks * kRowThreads * 4;
  static constexpr int kX = kStage + kRowH * kRowD;
  static constexpr int kH1 = kX + row_pad(kRowD);
  static constexpr int kH2 = kH1 + row_pad(kRowH);  // two buffers of row_pad(kRowH)
  static constexpr int kTB = kH2 + 2 * row_pad(kRowH);
  static constexpr int kSB = kTB + 2 * kRowH;
  static constexpr int kB1 = kSB + kRowH;
  static constexpr int kB2 = kB1 + kRowH;
  static constexpr int kY = kB2 + kRowD;
  static constexpr int kK = kY + kRowD;
  static constexpr int kBars = kK + kOdeMaxStages * kRowD;
  static_assert(kBars % 4 == 0 && kTB % 4 == 0, "16-byte aligned arrays, 8-byte aligned mbarriers");
  static constexpr size_t kSmem = sizeof(float) * size_t(kBars) + 2 * sizeof(uint64_t);
};

// Copies time_bias row e (256 floats) into dst: 64 threads' 16-byte
// cp.async when the row is 16-byte aligned, else 256 threads' 4-byte ones;
// then commits (an empty group on the other threads).
__device__ __forceinline__ void ode_split_fetch_tb(const OdeSplitParams& a, int e, float* dst) {
  const float* src = a.time_bias + int64_t(e) * kRowH;
  const int tid = int(threadIdx.x);
  if (reinterpret_cast<uintptr_t>(a.time_bias) % 16 == 0) {
    if (tid < kRowH / 4) cuda::cp_async_16(dst + 4 * tid, src + 4 * tid);
  } else if (tid < kRowH) {
    cuda::cp_async_4(dst + tid, src + tid);
  }
  cuda::cp_async_commit();
}

template <int C>
__global__ void __launch_bounds__(kRowThreads, 1) ode_split_kernel(const __grid_constant__ OdeSplitParams a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = OdeSplit<C>;
  extern __shared__ float4 ode_split_smem4[];
  float* smem = reinterpret_cast<float*>(ode_split_smem4);
  float* const xs = smem + S::kX;
  float* const h1 = smem + S::kH1;
  float* const tbs = smem + S::kTB;
  float* const ys = smem + S::kY;
  float* const ks = smem + S::kK;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int tid = threadIdx.x;
  const int g = tid >> 3, s = tid & 7;
  const int own = 4 * g + 2 * ((tid >> 2) & 1) + ((tid >> 1) & 1);  // layer-1 neuron (row_reduce4)
  // Values used only outside the loop or once per evaluation are read from
  // the parameters where used (no registers held across the loop: the
  // C = 2 kernel has none to spare).
  const int64_t row = blockIdx.x / C;

  // Loading, as flow_euler's split kernel: W0 whole through the staging
  // area, the register weights of W1 and W2 straight from global memory.
  row_copy<kRowH * kRowD / 4>(smem + S::kStage, a.w0, [](int f) { return f; });
  float w0r[S::kW1Rows][kRowK1], w1r[S::kPer][kRowK2], w2r[kRowK3];
  split_load_registers<C>(w1r, w2r, a.w1, a.w2, rank);
  for (int j = tid; j < kRowH; j += kRowThreads) {
    smem[S::kB1 + j] = a.b1[j];
    smem[S::kSB + j] = a.sample_bias ? a.sample_bias[row * kRowH + j] : 0.f;
  }
  for (int d = tid; d < kRowD; d += kRowThreads) {
    const float v = a.x0[row * kRowD + d];
    smem[S::kB2 + d] = a.b2[d];
    xs[row_pad(d)] = v;
    ys[d] = v;
    if (a.all_states && rank == 0) a.states[row * kRowD + d] = v;
  }
  if (a.num_evals > 0) ode_split_fetch_tb(a, 0, tbs);
  row_copies_done();  // also completes time_bias row 0
  split_take_w1<C, kRowD>(w0r, ode_split_smem4, smem + S::kStage);
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + S::kBars);
  split_init_barriers(bars, cluster);

  const int own2 = S::own2(rank);
  const bool stores2 = S::stores2();
  const auto act = [](float z) { return activate<float>(kSplitAct, 0.f, z); };
  float t0 = a.S > 0 ? a.t[0] : 0.f, t1 = a.S > 0 ? a.t[1] : 0.f;
  int e = 0;  // evaluation index k * stages + i
  for (int k = 0; k < a.S; ++k) {
    const float dt = t1 - t0;
    const float t2 = k + 2 <= a.S ? a.t[k + 2] : 0.f;  // next step's, its latency hidden by this step
    for (int i = 0; i < a.stages; ++i, ++e) {
      float* const h2 = smem + S::kH2 + (e & 1) * row_pad(kRowH);
      uint64_t* const h2_ready = bars + (e & 1);
      const float* const tb = tbs + (e & 1) * kRowH;
      if (tid == 0) cuda::mbarrier_arrive_expect_tx(h2_ready, S::peer_bytes());
      // The next evaluation's time_bias row into the other buffer (last read
      // by evaluation e - 1's layer 1, before its barriers).
      if (e + 1 < a.num_evals) ode_split_fetch_tb(a, e + 1, tbs + ((e + 1) & 1) * kRowH);
      {  // h1 = silu(W0 Y + time_bias[e] (+ sample_bias)), all 256 neurons
        const float sum = split_layer1<C>(xs, w0r, ode_split_smem4);
        if ((tid & 1) == 0) {
          float z = sum + tb[own];
          if (a.sample_bias) z += smem[S::kSB + own];
          h1[row_pad(own)] = act(z);
        }
      }
      __syncthreads();
      // h2 = silu(W1 h1 + b1), this block's slice, stored into every block
      split_layer2<C>(h1, w1r, smem + S::kB1, h2, h2_ready, rank, own2, stores2, act);
      __syncthreads();
      cuda::mbarrier_wait(h2_ready, (e >> 1) & 1);
      {  // K_i = W2 h2 + b2 for output g, then the Runge-Kutta combination (general.cu's order)
        const float v = row_out_dot(h2, w2r) + smem[S::kB2 + g];
        if (s == 0) {
          ks[i * kRowD + g] = v;
          float acc = 0.f;
          if (i + 1 < a.stages) {
            for (int m = 0; m <= i; ++m) {
              if (a.A[i + 1][m] != 0.f) acc += a.A[i + 1][m] * ks[m * kRowD + g];
            }
            xs[row_pad(g)] = ys[g] + dt * acc;
          } else {
            for (int m = 0; m < a.stages; ++m) {
              if (a.Bw[m] != 0.f) acc += a.Bw[m] * ks[m * kRowD + g];
            }
            const float y1 = ys[g] + dt * acc;
            ys[g] = y1;
            xs[row_pad(g)] = y1;
            if (a.all_states && rank == 0) {
              a.states[(int64_t(k + 1) * (gridDim.x / C) + blockIdx.x / C) * kRowD + g] = y1;
            }
          }
        }
      }
      // The next time_bias row complete (issued at this evaluation's start)
      // and published, with the new layer-1 input, by the barrier.
      cuda::cp_async_wait<0>();
      __syncthreads();
    }
    t0 = t1;
    t1 = t2;
  }
  // Each block has waited for every store into it, but none leaves while a
  // partner may still read or write the cluster's shared memory.
  cluster.sync();
  if (!a.all_states && rank == 0) {
    for (int d = tid; d < kRowD; d += kRowThreads) a.states[row * kRowD + d] = ys[d];
  }
#else
  __trap();  // launched only on compute capability >= 9.0
#endif
}

// float32, exactly D = 64 and widths 256, 256, 64, SiLU, sm_90, int-sized
// evaluation counts.
bool split_sizes(const OdeMlpCall& c) {
  if (c.x0.scalar_type() != ScalarType::Float || c.D != kRowD || c.L != 3 || c.act != kSplitAct) return false;
  if (c.widths[0] != kRowH || c.widths[1] != kRowH || c.widths[2] != kRowD) return false;
  if (c.S * c.stages >= (int64_t(1) << 30)) return false;
  return cuda::compute_capability_major() >= 9;
}

// Blocks per row (4, else 2), or 0 when the path does not take this call:
// all C * B blocks resident at once (one wave).
int split_blocks_for(const OdeMlpCall& c) {
  if (!split_sizes(c)) return 0;
  const int64_t sms = cuda::multiprocessor_count(cuda::current_device());
  if (4 * c.B <= sms && cuda::cluster_fits(ode_split_kernel<4>, 4, kRowThreads, OdeSplit<4>::kSmem)) return 4;
  if (2 * c.B <= sms && cuda::cluster_fits(ode_split_kernel<2>, 2, kRowThreads, OdeSplit<2>::kSmem)) return 2;
  return 0;
}

template <int C>
void launch_split_cluster(const OdeMlpCall& c) {
  const OdeMlpPtrs<float> p(c);
  OdeSplitParams a{};
  a.x0 = p.x0, a.t = p.t, a.time_bias = p.time_bias, a.sample_bias = p.sample_bias;
  a.w0 = p.w[0], a.w1 = p.w[1], a.w2 = p.w[2], a.b1 = p.b[1], a.b2 = p.b[2];
  a.states = mdata<float>(c.states);
  a.S = int(c.S), a.stages = int(c.stages), a.num_evals = int(c.S * c.stages), a.all_states = c.all_states;
  const OdeTableau tab = ode_tableau(c.method);
  for (int i = 0; i < kOdeMaxStages; ++i) {
    a.Bw[i] = float(tab.b[i]);
    for (int j = 0; j < kOdeMaxStages; ++j) a.A[i][j] = float(tab.a[i][j]);
  }
  cuda::allow_dynamic_smem(ode_split_kernel<C>, OdeSplit<C>::kSmem);
  const cuda::ClusterLaunch launch(C * c.B, C, kRowThreads, OdeSplit<C>::kSmem,
                                   cuda::current_stream(cuda::current_device()));
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, ode_split_kernel<C>, a));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

namespace ode_mlp_paths {

bool split_applies(const OdeMlpCall& c) { return split_blocks_for(c) != 0; }

void launch_split(const OdeMlpCall& c) {
  if (split_blocks_for(c) == 4) {
    launch_split_cluster<4>(c);
  } else {
    launch_split_cluster<2>(c);
  }
}

}  // namespace ode_mlp_paths
}  // namespace fused_ops
