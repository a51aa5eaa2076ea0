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

// Weight rows in shared memory are 4 floats longer than the activation rows
// (ld + 4 is 4 or 20 mod 32), so the 8 lanes of a quarter-warp that read
// float4s of 8 consecutive neurons' rows at the same k hit 8 distinct bank
// quads (a multiple of 16 would put them in 2).
__host__ __device__ inline int weight_ld(int ld) { return ld + 4; }

// How one layer's work is cut, fixed for the launch (host-computed; the
// dividers turn the flat thread index into coordinates without the
// ~20-instruction integer division in every layer of every step).
//   dot products: items (neuron j, k-segment s, 8-row chunk), j fastest, one
//     per thread where possible: segments of `seg` floats (a multiple of 4),
//     doubled from 4 until the items fit the block's threads, so that the
//     short layers (K = D + 1, or N = D) still spread over all warps;
//   partial sums: [segment][row][neuron], segment stride s_stride (rows * n
//     rounded up to 32 / 2^log_parts mod 32, so a warp's finalisation reads
//     -- 32 / 2^log_parts consecutive outputs x 2^log_parts segments -- hit
//     32 distinct banks);
//   finalisation: 2^log_parts lanes per output each sum every 2^log_parts-th
//     segment, then a butterfly over those lanes (a fixed order);
//   exchange: the [rows][n] slice is pushed as `per_row` vectors per row
//     (float4s when n % 4 == 0, else floats), `per_dst` to each block.
struct ClusterLayer {
  int n, ld_in, seg, nseg, s_stride, log_parts, vec4;
  cuda::IntDivider by_n, by_nseg, by_per_row, by_per_dst;
};

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
// One layer of the cluster kernel.  `in` is this block's full copy of the
// layer input ([rows][g.ld_in], zero past the true length), `w` its weight
// rows ([g.n][weight_ld(g.ld_in)], zero-padded alike, as are the biases of
// neurons past the layer's width, which therefore come out exactly 0: SiLU(0)
// and x + dt * 0 of a zero padding column); the result for (row,
// first_neuron + j), j < g.n, goes to `out` (same offset in every block of
// the cluster; num_blocks * g.n <= the padded row length).  Three
// stages, each closed by a barrier (see ClusterLayer for the work split):
//   1. partial dot products: a thread's weight float4 stays in registers
//      across its 8 rows, and the threads of a warp that share a segment read
//      the same input float4 (a broadcast);
//   2. each output's segments are summed in a fixed order (bitwise
//      reproducible), then bias and SiLU or the Euler update, into `stage`;
//   3. the slice [rows][g.n] is pushed into every block's `out` (this one's
//      included) as contiguous runs: scattered scalar stores, one value to 16
//      blocks, cost far more than the arithmetic (distributed shared memory
//      traffic is per transaction).  The caller's cluster barrier publishes
//      the pushes.
// The update reads x[row, col] in stage 2 and overwrites it in stage 3,
// after the block barrier between them.
template <int MODE>
__device__ __forceinline__ void cluster_layer(cg::cluster_group& cluster, int num_blocks,
                                              const ClusterLayer& g, const float* in, const float* w,
                                              int first_neuron, const float* bias,
                                              const float* w_time, float t, float* out,
                                              int ld_out, int rows, float dt, float* partial,
                                              float* stage) {
  const int n = g.n, ld_in = g.ld_in, wld = weight_ld(ld_in);
  const unsigned tid = threadIdx.x;
  const unsigned items = unsigned(n * g.nseg * (rows / 8));
  for (unsigned item = tid; item < items; item += kThreads) {
    unsigned j, rest, s, chunk;
    g.by_n.divmod(item, rest, j);
    g.by_nseg.divmod(rest, chunk, s);
    const float* wrow = w + j * wld;
    const float* irow = in + chunk * 8 * ld_in;
    const int k_end = min(int(s + 1) * g.seg, ld_in);
    float acc[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[r] = 0.f;
#pragma unroll 4
    for (int k = int(s) * g.seg; k < k_end; k += 4) {
      const float4 wv = *reinterpret_cast<const float4*>(wrow + k);
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const float4 v = *reinterpret_cast<const float4*>(irow + r * ld_in + k);
        acc[r] = fmaf(wv.x, v.x, acc[r]);
        acc[r] = fmaf(wv.y, v.y, acc[r]);
        acc[r] = fmaf(wv.z, v.z, acc[r]);
        acc[r] = fmaf(wv.w, v.w, acc[r]);
      }
    }
    float* p = partial + s * g.s_stride + (chunk * 8) * n + j;
#pragma unroll
    for (int r = 0; r < 8; ++r) p[r * n] = acc[r];
  }
  __syncthreads();
  // Every thread runs every round (the butterfly needs whole warps); groups
  // of 2^log_parts lanes never straddle a warp.
  const int parts = 1 << g.log_parts;
  const unsigned slots = unsigned(rows * n) << g.log_parts;
  for (unsigned base = 0; base < slots; base += kThreads) {
    const unsigned idx = base + tid;
    const unsigned o = idx >> g.log_parts;
    const int part = int(idx) & (parts - 1);
    float sum = 0.f;
    if (idx < slots) {
      for (int s = part; s < g.nseg; s += parts) sum += partial[s * g.s_stride + o];
    }
    for (int off = parts / 2; off > 0; off /= 2) sum += __shfl_xor_sync(kFullMask, sum, off);
    if (idx < slots && part == 0) {
      unsigned row, j;
      g.by_n.divmod(o, row, j);
      float value;
      if (MODE == kHidden) {
        if (w_time != nullptr) sum += t * w_time[j];
        value = silu(sum + bias[j]);
      } else {
        value = euler_step(out[row * ld_out + first_neuron + j], dt, sum + bias[j]);
      }
      stage[o] = value;
    }
  }
  __syncthreads();
  const unsigned pushes = unsigned(num_blocks) * g.by_per_dst.divisor;
  for (unsigned i = tid; i < pushes; i += kThreads) {
    unsigned dst, rem, row, q;
    g.by_per_dst.divmod(i, dst, rem);
    g.by_per_row.divmod(rem, row, q);
    if (g.vec4) {
      const float4 v = reinterpret_cast<const float4*>(stage + row * n)[q];
      float* remote = cluster.map_shared_rank(out + row * ld_out + first_neuron, int(dst));
      reinterpret_cast<float4*>(remote)[q] = v;
    } else {
      *cluster.map_shared_rank(out + row * ld_out + first_neuron + q, int(dst)) = stage[rem];
    }
  }
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

// The work split of a layer with n neurons per block, input rows of ld_in
// floats and `rows` rows (see ClusterLayer).
ClusterLayer cluster_layer_geometry(int n, int ld_in, int rows) {
  ClusterLayer g{};
  g.n = n;
  g.ld_in = ld_in;
  const int chunks = rows / 8;
  auto segments = [&](int seg) { return (ld_in + seg - 1) / seg; };
  g.seg = 4;
  while (g.seg < ld_in && n * segments(g.seg) * chunks > kThreads) g.seg *= 2;
  g.nseg = segments(g.seg);
  const int outputs = rows * n;
  g.log_parts = 0;
  while ((2 << g.log_parts) <= std::min(kWarpSize, g.nseg) && (outputs << (g.log_parts + 1)) <= kThreads) {
    ++g.log_parts;
  }
  const int lanes_per_part = kWarpSize >> g.log_parts;  // outputs one warp finalises
  g.s_stride = outputs + ((lanes_per_part - outputs) % kWarpSize + kWarpSize) % kWarpSize;
  g.vec4 = n % 4 == 0;
  const int per_row = g.vec4 ? n / 4 : n;
  g.by_n = cuda::IntDivider(unsigned(n));
  g.by_nseg = cuda::IntDivider(unsigned(g.nseg));
  g.by_per_row = cuda::IntDivider(unsigned(per_row));
  g.by_per_dst = cuda::IntDivider(unsigned(rows * per_row));
  return g;
}

ClusterArgs cluster_args(const FlowEulerCall& c, int num_blocks) {
  ClusterArgs a{};
  static_cast<FlowParams&>(a) = flow_params(c);
  a.n1 = (a.H + num_blocks - 1) / num_blocks;
  a.n3 = (a.D + num_blocks - 1) / num_blocks;
  a.ldD = round_up(a.D, kClusterLd);
  a.ldH = round_up(a.H, kClusterLd);
  a.rows = round_up(a.B, 8);
  a.l1 = cluster_layer_geometry(a.n1, a.ldD, a.rows);
  a.l2 = cluster_layer_geometry(a.n1, a.ldH, a.rows);
  a.l3 = cluster_layer_geometry(a.n3, a.ldH, a.rows);
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
