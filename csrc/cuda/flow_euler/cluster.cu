// \brief fused_ops::flow_euler, cluster path: small float32 batches of any
// D and H on sm_90, all steps in ONE launch of one thread-block cluster.
//
// Chosen for float32, compute capability >= 9.0, B <= 32, when a cluster
// of 16 blocks (8 where 16 cannot be co-scheduled) holds the weight slices
// in shared memory (the default B=8, D=64, H=256 needs ~50 KB per block);
// at the default D and H the split and row paths come first.
//
// Design.  Block r owns the neurons [r*n1, (r+1)*n1) of layers 1 and 2 and
// [r*n3, (r+1)*n3) of layer 3 (n1 = ceil(H/C), n3 = ceil(D/C)); its rows of
// w1, w2, w3 stay in its shared memory for the whole integration, so the
// weights are read from global memory once per call, not once per step.
// Every block holds full copies of the activations x, h1, h2 (all rows).
// A layer (cluster_layer): partial dot products per (neuron, k-segment,
// 8-row chunk), one per thread; a fixed-order sum of each output's segments
// with the bias and SiLU or the Euler update; the block's slice pushed into
// all blocks' copies as float4 runs (distributed shared memory stores); one
// cluster barrier per layer (3 per step) publishes the pushes.  Single
// buffers suffice because a buffer is only overwritten two barriers after
// its last reader.  The exchange (push + barrier) is most of a step; the
// rest is instruction latency: 8 warps per SM, each with short dependent
// chains, so the work split (ClusterLayer) spreads even the short layers
// over all warps and the index arithmetic uses host-prepared dividers
// (cuda/primitives/int_divider.cuh).  Every sum has a fixed order.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/flow_euler/paths.cuh"
#include "cuda/primitives/cluster_mlp.cuh"
#include "cuda/primitives/int_divider.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

namespace cg = cooperative_groups;

constexpr int kClusterMaxB = 32;
// Activation rows are padded (with zeros) to a multiple of kClusterLd floats:
// then every block's full-width slice fits, C * ceil(N / C) <= round_up(N, 16)
// for clusters of C = 8 or 16 blocks, so the push needs no per-block width.
constexpr int kClusterLd = 16;

using cuda::cluster_mlp::ClusterLayer;  // the work split of a layer (see the header)
using cuda::cluster_mlp::weight_ld;

struct ClusterArgs : FlowParams {
  int n1, n3;    // neurons per block: layers 1-2, layer 3
  int ldD, ldH;  // activation row lengths: D, H padded to a multiple of kClusterLd
  int rows;      // B rounded up to a multiple of 8
  int partials;  // floats of the partial-sum buffer (the largest layer's)
  ClusterLayer l1, l2, l3;
};

// Shared memory of one cluster block, in floats.  Every array's size is a
// multiple of 4 floats, so each starts 16-byte aligned (float4 reads).
struct ClusterLayout {
  int W1, W2, W3, X, H1, H2, PART, STAGE, B1, WT, B2, B3, total;
  __host__ __device__ ClusterLayout(int n1, int n3, int ldD, int ldH, int rows, int partials) {
    W1 = 0;
    W2 = W1 + n1 * weight_ld(ldD);
    W3 = W2 + n1 * weight_ld(ldH);
    X = W3 + n3 * weight_ld(ldH);
    H1 = X + rows * ldD;
    H2 = H1 + rows * ldH;
    PART = H2 + rows * ldH;
    STAGE = PART + (partials + 3) / 4 * 4;  // this block's slice of a layer's output, [rows][n]
    B1 = STAGE + (rows * max(n1, n3) + 3) / 4 * 4;
    WT = B1 + n1;
    B2 = WT + n1;
    B3 = B2 + n1;
    total = B3 + n3;
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// One layer of the cluster kernel: cuda::cluster_mlp::cluster_layer (dot
// products, fixed-order sums, the push into every block's `out`) with this
// op's epilogue.  `in` is this block's full copy of the layer input
// ([rows][g.ld_in], zero past the true length), `w` its weight rows
// (zero-padded alike, as are the biases of neurons past the layer's width,
// which therefore come out exactly 0: SiLU(0) and x + dt * 0 of a zero
// padding column).  The update reads x[row, col] in the epilogue and the
// push overwrites it after the routine's block barrier between them.
template <int MODE>
__device__ __forceinline__ void cluster_layer(cg::cluster_group& cluster, int num_blocks,
                                              const ClusterLayer& g, const float* in, const float* w,
                                              int first_neuron, const float* bias,
                                              const float* w_time, float t, float* out,
                                              int ld_out, int rows, float dt, float* partial,
                                              float* stage) {
  auto epilogue = [&](unsigned, unsigned row, unsigned j, float sum) {
    float value;
    if (MODE == kHidden) {
      if (w_time != nullptr) sum += t * w_time[j];
      value = silu(sum + bias[j]);
    } else {
      value = euler_step(out[row * ld_out + first_neuron + j], dt, sum + bias[j]);
    }
    return value;
  };
  cuda::cluster_mlp::cluster_layer(cluster, num_blocks, g, in, w, first_neuron, out, ld_out, rows, partial,
                                   stage, epilogue);
}
#endif

__global__ void __launch_bounds__(kThreads, 1) flow_cluster_kernel(ClusterArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ float4 cluster_smem4[];
  float* smem = reinterpret_cast<float*>(cluster_smem4);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), num_blocks = int(cluster.num_blocks());
  const ClusterLayout L(a.n1, a.n3, a.ldD, a.ldH, a.rows, a.partials);
  const int D = a.D, H = a.H, tid = threadIdx.x;
  const int j0 = rank * a.n1, nj = max(0, min(a.n1, H - j0));
  const int d0 = rank * a.n3, nd = max(0, min(a.n3, D - d0));

  // Weights slices, full x0, zeroed h1/h2; every padding element is zero so
  // whole-segment dot products read only zeros past the true lengths.
  // (Blocks without neurons of a layer, nj or nd == 0, stage only zeros and
  // never form their out-of-range source pointer's addresses.)
  stage_rows(smem + L.W1, a.n1, weight_ld(a.ldD), a.w1 + int64_t(min(j0, H)) * (D + 1), D + 1, nj, D);
  stage_rows(smem + L.W2, a.n1, weight_ld(a.ldH), a.w2 + int64_t(min(j0, H)) * H, H, nj, H);
  stage_rows(smem + L.W3, a.n3, weight_ld(a.ldH), a.w3 + int64_t(min(d0, D)) * H, H, nd, H);
  stage_rows(smem + L.X, a.rows, a.ldD, a.x0, D, a.B, D);
  for (int i = tid; i < 2 * a.rows * a.ldH; i += kThreads) smem[L.H1 + i] = 0.f;
  for (int r = tid; r < a.n1; r += kThreads) {
    const bool ok = r < nj;
    smem[L.B1 + r] = ok ? a.b1[j0 + r] : 0.f;
    smem[L.WT + r] = ok ? a.w1[int64_t(j0 + r) * (D + 1) + D] : 0.f;
    smem[L.B2 + r] = ok ? a.b2[j0 + r] : 0.f;
  }
  for (int r = tid; r < a.n3; r += kThreads) smem[L.B3 + r] = r < nd ? a.b3[d0 + r] : 0.f;
  // All blocks initialised (and running) before anyone stores into them.
  cluster.sync();

  float* const partial = smem + L.PART;
  float* const stage = smem + L.STAGE;
  for (int k = 0; k < a.num_steps; ++k) {
    const float t = flow_step_time<float>(k, a.num_steps);
    cluster_layer<kHidden>(cluster, num_blocks, a.l1, smem + L.X, smem + L.W1, j0, smem + L.B1,
                           smem + L.WT, t, smem + L.H1, a.ldH, a.rows, a.dt, partial, stage);
    cluster.sync();
    cluster_layer<kHidden>(cluster, num_blocks, a.l2, smem + L.H1, smem + L.W2, j0, smem + L.B2,
                           nullptr, t, smem + L.H2, a.ldH, a.rows, a.dt, partial, stage);
    cluster.sync();
    cluster_layer<kUpdate>(cluster, num_blocks, a.l3, smem + L.H2, smem + L.W3, d0, smem + L.B3,
                           nullptr, t, smem + L.X, a.ldD, a.rows, a.dt, partial, stage);
    cluster.sync();
  }
  // After the last barrier no block touches another's shared memory, so each
  // writes the columns it owns and may exit.
  for (int i = tid; i < a.B * nd; i += kThreads) {
    const int b = i / nd, d = d0 + (i - b * nd);
    a.x[int64_t(b) * D + d] = smem[L.X + b * a.ldD + d];
  }
#else
  __trap();  // launched only on compute capability >= 9.0
#endif
}

ClusterArgs cluster_args(const FlowEulerCall& c, int num_blocks) {
  ClusterArgs a{};
  static_cast<FlowParams&>(a) = flow_params(c);
  a.n1 = (a.H + num_blocks - 1) / num_blocks;
  a.n3 = (a.D + num_blocks - 1) / num_blocks;
  a.ldD = round_up(a.D, kClusterLd);
  a.ldH = round_up(a.H, kClusterLd);
  a.rows = round_up(a.B, 8);
  a.l1 = cuda::cluster_mlp::cluster_layer_geometry(a.n1, a.ldD, a.rows);
  a.l2 = cuda::cluster_mlp::cluster_layer_geometry(a.n1, a.ldH, a.rows);
  a.l3 = cuda::cluster_mlp::cluster_layer_geometry(a.n3, a.ldH, a.rows);
  a.partials = 0;
  for (const ClusterLayer* g : {&a.l1, &a.l2, &a.l3}) a.partials = std::max(a.partials, g->nseg * g->s_stride);
  return a;
}

size_t cluster_smem(const ClusterArgs& a) {
  return sizeof(float) * size_t(ClusterLayout(a.n1, a.n3, a.ldD, a.ldH, a.rows, a.partials).total);
}

// The cluster size to use for this call, or 0 when the cluster path does not apply.
int cluster_blocks_for(const FlowEulerCall& c) {
  if (c.B > kClusterMaxB || c.x.scalar_type() != ScalarType::Float) return 0;
  if (cuda::compute_capability_major() < 9) return 0;
  if (c.D > (1 << 20) || c.H > (1 << 20)) return 0;
  for (int num_blocks : {16, 8}) {
    if (cuda::cluster_fits(flow_cluster_kernel, num_blocks, kThreads,
                           cluster_smem(cluster_args(c, num_blocks)))) {
      return num_blocks;
    }
  }
  return 0;
}

}  // namespace

namespace flow_euler_paths {

bool cluster_applies(const FlowEulerCall& c) { return cluster_blocks_for(c) != 0; }

void launch_cluster(const FlowEulerCall& c) {
  const int num_blocks = cluster_blocks_for(c);
  const ClusterArgs a = cluster_args(c, num_blocks);
  const size_t smem = cluster_smem(a);
  cuda::allow_dynamic_smem(flow_cluster_kernel, smem);  // cached: a no-op after the first call
  const cuda::ClusterLaunch launch(num_blocks, num_blocks, kThreads, smem,
                                   cuda::current_stream(cuda::current_device()));
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, flow_cluster_kernel, a));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace flow_euler_paths
}  // namespace fused_ops
