// CUDA kernels of fused_ops::flow_euler.  Six paths, chosen per call on the
// host (flow_euler_cuda below) from the dtype, the sizes and the device:
//
// split    float32 at exactly D = 64, H = 256 (the default), sm_90, B <= half
//          the number of SMs: one launch, a cluster of four blocks per row
//          (two when B > a quarter of the SMs) that split layer 2 between
//          them (every weight then fits in registers) and exchange h2 once
//          per step by asynchronous stores.  See "split path".
//
// row      float32 at exactly D = 64, H = 256 (the default), B <= the number
//          of SMs, where a block may have ~200 KB of shared memory (sm_90):
//          one launch, one block per row, each block holding all the
//          weights (registers and shared memory) for all steps and never
//          talking to another block.  Faster than the cluster path below
//          because a layer ends with a block barrier instead of a cluster
//          barrier plus an exchange; bounded by shared-memory bandwidth.
//          See "row path" for the numbers.
//
// cluster  float32, compute capability >= 9.0, B <= 32 and the weight slices
//          fit shared memory (the default B=8, D=64, H=256 does, with ~50 KB
//          per block): ONE launch of one thread-block cluster of 16 blocks (8
//          where 16 cannot be co-scheduled) for all steps.  Block r owns the
//          neurons [r*n1, (r+1)*n1) of layers 1 and 2 and [r*n3, (r+1)*n3) of
//          layer 3 (n1 = ceil(H/C), n3 = ceil(D/C)); its rows of w1, w2, w3
//          stay in its shared memory for the whole integration, so weights
//          are read from global memory once per call, not once per step.
//          Every block holds full copies of the activations x, h1, h2 (all
//          rows).  A layer (cluster_layer): partial dot products per (neuron,
//          k-segment, 8-row chunk), one per thread; a fixed-order sum of each
//          output's segments with the bias and SiLU or the Euler update; the
//          block's slice pushed into all blocks' copies as float4 runs
//          (distributed shared memory stores); one cluster barrier per layer
//          (3 per step) publishes the pushes.  Single buffers suffice because
//          a buffer is only overwritten two barriers after its last reader.
//          Measured on the H200 (bench/cluster_sync.cu, bench/results/
//          nvidia-h200-gpu-run.txt): a cluster barrier alone costs 0.24 us at
//          any cluster size, but a push of the default's slices to 16 blocks
//          plus the barrier 0.85 us (layers 1-2) and 0.62 us (layer 3), so
//          ~2.3 us of each step is exchange; pulling the slices with remote
//          loads after the barrier instead measured no better (0.96 / 0.62
//          us, and 172 vs 176 us per call), nor did 8-block clusters (190 us).
//          The rest is instruction latency: 8 warps per SM, each with short
//          dependent chains, so the work split (ClusterLayer) spreads even
//          the short layers over all warps and the index arithmetic uses
//          host-prepared dividers (cuda/int_divider.cuh).
//
// wgmma    float32 at exactly D = 64, H = 256 on compute capability 9.0 with
//          the sm_90a code built (FUSED_OPS_SM90A), B beyond the paths above
//          (the large-batch default B=4096): a packing kernel, then one
//          launch of a CTA pair per 64 rows, each CTA computing half of
//          every layer's columns with warpgroup products.  See "wgmma path".
//
// tiled    float32, compute capability >= 8.0, any B, when a 32-row tile's
//          activations and three weight chunks fit shared memory (H <= 512
//          and, at D = 64, H <= 384): a packing kernel, then one launch,
//          one block of 256 threads per 32 rows, running its rows through
//          all steps with x and h in shared memory.  Each layer is a
//          [32 x K] x [K x N] product on tensor cores in 3xTF32
//          (cuda/tf32x3.cuh: float32 accuracy).  The weights are packed once
//          per call into the order and fragment layout the products consume
//          (cuda::pack_b_fragments), so they stream from L2 through shared
//          memory in 32 KB chunks by cp.async (cuda/cp_async.cuh: 16 bytes
//          per instruction, three chunks in flight) and a lane reads its B
//          fragment with one 8-byte load; output columns go in passes of 256
//          spread over the 8 warps (n-tiles warp, warp+8, ... so small N
//          still uses every warp).  The activations are stored split into
//          TF32 big and small parts (read by ldmatrix), so each is split
//          once, not by every warp that reads it.  The first version staged
//          the raw weights through registers with per-element index
//          arithmetic, which with the splits made ~18 instructions per
//          tensor-core product (ncu, run Q); with packed weights it was
//          still ~13 (run V: the A splits repeated per warp).
//          B = 4096 is 128 blocks: one wave on the H200's 132 SMs.
//
// general  anything else (float64, larger sizes, older GPUs): one simple
//          kernel per layer and step, one thread per output element,
//          sequential sums.  Correctness first; it is 3 * num_steps launches.
//
// Every sum has a fixed order (no atomics), so results are bitwise
// reproducible for the same inputs and device.

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <climits>
#include <tuple>
#include <type_traits>

#include "cuda/primitives/cp_async.cuh"
#include "cuda/primitives/int_divider.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/reductions.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/tf32x3.cuh"
#include "cuda/primitives/wgmma_stream.cuh"
#include "flow_euler.h"

namespace fused_ops {
namespace {

namespace cg = cooperative_groups;
using cuda::kFullMask;
using cuda::kWarpSize;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;

template <typename T>
__device__ __forceinline__ T silu(T z) {
  // z / (1 + exp(-z)): exp overflows to inf for very negative z and the
  // quotient is -0, as PyTorch's SiLU gives.
  return z / (T(1) + exp(-z));
}

// silu with the hardware's exponential and division (MUFU.EX2, MUFU.RCP):
// __expf's documented error is 2 + 1.16 |z| ulp (so ~1.5e-6 relative at
// |z| = 20, a few ulp for the usual |z| < 4), __fdividef's 2 ulp, against
// ~1 ulp for silu(), at a third of the instructions.  Only in the wgmma
// kernel, whose epilogues (SiLU of 64 values per thread per step) sit
// between its products on every step's critical path: 596 -> 492 us per
// call at B=4096, its error vs float64 unchanged (1.00-1.08x eager's;
// twelfth session's run 3).  -inf..inf map as silu() maps them (exp
// overflows to inf, the quotient is -0).
[[maybe_unused]] __device__ __forceinline__ float silu_fast(float z) { return __fdividef(z, 1.0f + __expf(-z)); }

// x + dt * v rounded like the reference (dt * v first, no fused multiply-add).
__device__ __forceinline__ float euler_step(float x, float dt, float v) {
  return __fadd_rn(x, __fmul_rn(dt, v));
}
__device__ __forceinline__ double euler_step(double x, double dt, double v) {
  return __dadd_rn(x, __dmul_rn(dt, v));
}

// dst[r, k] (row stride ld, total_rows rows) = src[r, k] (row stride src_ld)
// for r < nrows and k < ncols, else 0; all threads of the block cooperate.
// Eight loads in flight per thread: the one-off staging of a persistent
// kernel is otherwise a chain of dependent L2 round trips.
__device__ __forceinline__ void stage_rows(float* dst, int total_rows, int ld, const float* src,
                                           int64_t src_ld, int nrows, int ncols) {
  constexpr int kUnroll = 8;
  const int n = total_rows * ld;
  for (int base = 0; base < n; base += kThreads * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + int(threadIdx.x);
      const int r = i / ld, k = i - r * ld;
      v[u] = (i < n && r < nrows && k < ncols) ? src[r * src_ld + k] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + int(threadIdx.x);
      if (i < n) dst[i] = v[u];
    }
  }
}

// ---------------------------------------------------------------------------
// general path
// ---------------------------------------------------------------------------

// out[b, j] for one layer, one thread per (b, j):
//   kHidden  out = silu(sum_k in[b, k] W[j, k] + t * w_time[j] + bias[j])  (w_time may be null)
//   kUpdate  out[b, j] = out[b, j] + dt * (sum_k in[b, k] W[j, k] + bias[j])
enum LayerMode { kHidden = 0, kUpdate = 1 };

template <typename T, int MODE>
__global__ void __launch_bounds__(kThreads)
    general_layer_kernel(const T* __restrict__ in, int64_t B, int64_t K, const T* __restrict__ W,
                         int64_t ld_w, const T* __restrict__ w_time, const T* __restrict__ bias,
                         int64_t N, T t, T dt, T* __restrict__ out) {
  const int64_t total = B * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / N, j = i - b * N;
    const T* row = in + b * K;
    const T* w = W + j * ld_w;
    T acc = 0;
    for (int64_t k = 0; k < K; ++k) acc += row[k] * w[k];
    if (MODE == kHidden) {
      if (w_time != nullptr) acc += t * w_time[j * ld_w];
      out[i] = silu(acc + bias[j]);
    } else {
      out[i] = euler_step(out[i], dt, acc + bias[j]);
    }
  }
}

template <typename T>
void launch_general(const FlowEulerCall& c) {
  const int64_t B = c.B, D = c.D, H = c.H;
  const auto stream = cuda::current_stream(cuda::current_device());
  T* x = mdata<T>(c.x);
  const T* w1 = cdata<T>(c.w1);
  Tensor h1 = empty_like_device(c.x, {B, H});
  Tensor h2 = empty_like_device(c.x, {B, H});
  FUSED_OPS_CUDA_CHECK(cudaMemcpyAsync(x, cdata<T>(c.x0), sizeof(T) * B * D, cudaMemcpyDeviceToDevice, stream));
  auto grid = [](int64_t n) { return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 8192)); };
  const T dt = flow_step_size<T>(c.num_steps);
  for (int64_t k = 0; k < c.num_steps; ++k) {
    const T t = flow_step_time<T>(k, c.num_steps);
    general_layer_kernel<T, kHidden><<<grid(B * H), kThreads, 0, stream>>>(
        x, B, D, w1, D + 1, w1 + D, cdata<T>(c.b1), H, t, dt, mdata<T>(h1));
    FUSED_OPS_CUDA_LAUNCH_CHECK();
    general_layer_kernel<T, kHidden><<<grid(B * H), kThreads, 0, stream>>>(
        mdata<T>(h1), B, H, cdata<T>(c.w2), H, nullptr, cdata<T>(c.b2), H, t, dt,
        mdata<T>(h2));
    FUSED_OPS_CUDA_LAUNCH_CHECK();
    general_layer_kernel<T, kUpdate><<<grid(B * D), kThreads, 0, stream>>>(
        mdata<T>(h2), B, H, cdata<T>(c.w3), H, nullptr, cdata<T>(c.b3), D, t, dt, x);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
}

// ---------------------------------------------------------------------------
// cluster path (sm_90)
// ---------------------------------------------------------------------------

constexpr int kClusterMaxB = 32;
// Activation rows are padded (with zeros) to a multiple of kClusterLd floats:
// then every block's full-width slice fits, C * ceil(N / C) <= round_up(N, 16)
// for clusters of C = 8 or 16 blocks, so the push needs no per-block width.
constexpr int kClusterLd = 16;

// What every float32 fast path reads: the op's tensors as raw pointers, the
// sizes as int (the paths apply only where they fit) and the step size.
struct FlowParams {
  const float *x0, *w1, *b1, *w2, *b2, *w3, *b3;
  float* x;
  int B, D, H, num_steps;
  float dt;
};

FlowParams flow_params(const FlowEulerCall& c) {
  FlowParams p{};
  p.x0 = cdata<float>(c.x0);
  p.w1 = cdata<float>(c.w1);
  p.b1 = cdata<float>(c.b1);
  p.w2 = cdata<float>(c.w2);
  p.b2 = cdata<float>(c.b2);
  p.w3 = cdata<float>(c.w3);
  p.b3 = cdata<float>(c.b3);
  p.x = mdata<float>(c.x);
  p.B = int(c.B), p.D = int(c.D), p.H = int(c.H), p.num_steps = int(c.num_steps);
  p.dt = flow_step_size<float>(c.num_steps);
  return p;
}

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

int round_up(int v, int m) { return (v + m - 1) / m * m; }

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

void launch_cluster(const FlowEulerCall& c, int num_blocks) {
  const ClusterArgs a = cluster_args(c, num_blocks);
  const size_t smem = cluster_smem(a);
  cuda::allow_dynamic_smem(flow_cluster_kernel, smem);  // cached: a no-op after the first call
  const cuda::ClusterLaunch launch(num_blocks, num_blocks, kThreads, smem,
                                   cuda::current_stream(cuda::current_device()));
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, flow_cluster_kernel, a));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// row path (the default D = 64, H = 256; sm_90-size shared memory)
// ---------------------------------------------------------------------------

// One block per batch row (taken for B between half the SM count and the
// SM count; below, the split path is faster), all 98,560 weights held by
// that block for the whole integration: 96 per thread in registers (49,152), the rest (three
// quarters of w2) in shared memory (192 KB).  Rows are independent, so
// blocks never talk to each other and a layer ends with a block barrier,
// not a cluster barrier plus an exchange (the cluster path's ~2.3 us per
// step, see the file comment).  What bounds a step instead is shared-memory
// bandwidth: each step streams the shared part of the weights once (49,152
// floats at 32 per clock, ~1,540 clocks, against ~770 clocks of FMAs) --
// hence as many weights in registers as fit (512 threads x 128 registers is
// the whole register file), and each activation read serves several
// neurons.  Measured on the H200 (eighth session's runs 1-5 in
// bench/results/nvidia-h200-gpu-run.txt): 78 us per call at the default
// (the cluster path: ~160 us); 16 / 24 / 32 w2 weights per thread in
// registers gave 104 / 102 / 87 us in a first layout.  ncu: ~2 us per
// step, half of it layer 2 waiting on its shared-memory weight loads (no
// registers are left to issue them ahead), layers 1 and 3 ~0.35 us each
// (latency: a shuffle chain, SiLU, a barrier); loading the weights ~12 us
// of the samples, though a leaner two-round load (run 7) measured no faster.
// Work split (8 lanes per group, lane s of a group sums the k-range s):
//   layers 1, 2  group g owns neurons 4g .. 4g+3 and each lane holds their
//                weights for its k-range (8 of K = 64, 32 of K = 256), so an
//                input float4 feeds 16 FMAs; the four sums are reduced over
//                the group's lanes by a reduce-scatter (row_reduce4);
//   layer 3      group d owns output d, 32 k per lane, a 3-shuffle butterfly.
// Every lane that ends up holding a sum holds the identical value (the two
// lanes of the last shuffle add the same two numbers, a + b == b + a).
constexpr int kRowD = 64, kRowH = 256;
constexpr int kRowThreads = 2 * kRowH;
constexpr int kRowK1 = kRowD / 8, kRowK2 = kRowH / 8, kRowK3 = kRowH / 8;  // k per lane in layers 1-3
constexpr int kRowW2RegK = 8;                                  // of a lane's kRowK2 layer-2 k, in registers
constexpr int kRowW2Chunks = (kRowK2 - kRowW2RegK) / 4 * 4;    // the rest: float4 chunks (k-quad x neuron)
static_assert(kRowThreads / 8 == kRowH / 4 && kRowThreads / 8 == kRowD, "a group per 4 neurons / per output");

// Activation index with 4 floats of padding after every 32: the 8 lanes of a
// group read one float4 each at the same offset into their own k-ranges,
// and the padding puts those 8 float4s in 8 distinct bank quads.
__host__ __device__ constexpr int row_pad(int k) { return k + k / 32 * 4; }

// Shared memory: w2's shared part [chunk][thread] as float4s (a warp's read
// of one chunk is 512 contiguous bytes: conflict-free), then x, h1, h2.
constexpr int kRowX = kRowW2Chunks * kRowThreads * 4;
constexpr int kRowH1 = kRowX + row_pad(kRowD);
constexpr int kRowH2 = kRowH1 + row_pad(kRowH);
constexpr size_t kRowSmem = sizeof(float) * size_t(kRowH2 + row_pad(kRowH));

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

// Layer 3 of the row and split paths: x[d] += dt * (w3[d] . h2 + b3) for the
// group's output d = g, lane s summing k in [32 s, 32 s + 32) with its
// register weights w3r (four partial sums, then a 3-shuffle butterfly);
// lane 0 of the group writes.
__device__ __forceinline__ void row_euler_update(float* xs, const float* h2, const float (&w3r)[kRowK3],
                                                 float b3, float dt) {
  const int g = int(threadIdx.x) >> 3, s = int(threadIdx.x) & 7;
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
  const float sum = group_sum8((acc[0] + acc[1]) + (acc[2] + acc[3]));
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
  // a thread's reads in flight (cp.async; direct per-thread register loads,
  // scalar and scattered, took ~28 us of a 90 us call: the load queue was
  // full, ncu).  The register weights go through the (still free) w2 region
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

// float32 at exactly the default D and H: the sizes the row and split
// kernels are written for.
bool row_sizes(const FlowEulerCall& c) {
  return c.x.scalar_type() == ScalarType::Float && c.D == kRowD && c.H == kRowH;
}

// Whether the row path takes this call: row_sizes, one block per SM for all
// rows (one wave; beyond it the tiled path's tensor cores win), and the
// block's shared memory available (sm_90).
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

// ---------------------------------------------------------------------------
// split path (the default D = 64, H = 256, B <= half the SM count; sm_90)
// ---------------------------------------------------------------------------

// C = 4 or 2 blocks per batch row (a thread-block cluster of C), which
// removes what bounds the row path: each block computes layers 1 and 3 in
// full (the same values in every block of the cluster) but only its 1/C of
// layer 2's 256 neurons.  With C = 4 (B <= a quarter of the SM count) every
// weight a block uses fits in its registers (w1, w2's quarter and w3: 96
// floats per thread) and no weight is read from shared memory in the loop;
// with C = 2 (B <= half the SM count) w2's half and w3 fill the registers
// and w1 streams from shared memory each step (16,384 floats, against
// 49,152 in the row path).  The price is one exchange per step instead of
// none: each block stores its slice of h2 into its own copy and, by
// st.async, into every partner's (cuda/mbarrier.cuh); after the block
// barrier that publishes its own slice it waits on an mbarrier that
// completes when the partners' bytes have landed -- no cluster barrier.
// h2 and its mbarrier are double buffered by step parity: a block may run
// one layer-2 ahead of a partner's layer 3, never two (its layer 3 needs
// the partner's next slice, which the partner computes only after its own
// layer 3), so a store never lands in a buffer still being read, nor on a
// phase still open.
// Work split (groups of 8 lanes, lane s sums the k-range s):
//   layer 1  as the row path (C = 4: the same registers; C = 2: each lane's
//            8 float4s in shared memory, stored [chunk][thread]:
//            conflict-free);
//   layer 2  group g owns the block's neurons 4g/C .. (4g+4)/C - 1, 32 k per
//            lane in registers; C = 2: a 3-shuffle reduce-scatter
//            (pair_reduce2), C = 4: a 3-shuffle butterfly (group_sum8);
//   layer 3  as the row path.
// Measured on the H200 (bench/results/nvidia-h200-gpu-run.txt): C = 2 with
// a cluster barrier per step instead of the mbarrier, 65.1 us per call at
// the default (eighth session's run 8); C = 2 with an mbarrier that also
// counted one arrival per local warp instead of the block barrier 60.6 us
// (ninth session's run 1; compute-sanitizer's racecheck cannot follow a
// warp's stores through its lane 0's arrival, so it reported races); this
// version C = 2 60.6 us, C = 4 51.6 us (run 2); the row path 78.2 us, the
// 16-block cluster path ~160 us.
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
void launch_split(const FlowEulerCall& c) {
  cuda::allow_dynamic_smem(flow_split_kernel<C>, Split<C>::kSmem);
  const cuda::ClusterLaunch launch(C * c.B, C, kRowThreads, Split<C>::kSmem,
                                   cuda::current_stream(cuda::current_device()));
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, flow_split_kernel<C>, flow_params(c)));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// tiled path (sm_80+, 3xTF32 tensor cores)
// ---------------------------------------------------------------------------

constexpr int kTileRows = 32;                   // two m16 tiles
constexpr int kKChunk = 32;                     // weight columns (k) per staged chunk
constexpr int kPassCols = kWarps * 4 * 8;       // output columns per pass: 4 n8-tiles per warp
constexpr int kPassTiles = kPassCols / 8;       // n8-tiles per pass
constexpr int kFragFloats = cuda::b_fragment_floats(false);  // one B fragment (k8 x n8) of a warp
constexpr int kChunkFloats = kKChunk / 8 * kPassTiles * kFragFloats;  // a full chunk: 32 KB
constexpr int kStages = 3;                      // chunks in flight: compute q, land q+1, load q+2

// Packed weights (cuda::pack_b_fragments, once per call): each layer's
// [N, K] weight in mma B-fragment order with passes of kPassTiles n8-tiles
// (256 output columns), k padded to whole chunks, so the chunk (pass p,
// k-chunk kc) the tile kernel consumes is one contiguous block: cp.async
// copies it 16 bytes per instruction and a lane reads its fragment with one
// 8-byte shared load.
constexpr int kChunkSteps = kKChunk / 8;  // k-steps of mma.m16n8k8 per chunk

__host__ __device__ inline int pass_tiles(int N, int p) { return cuda::b_fragment_pass_tiles(N, kPassTiles, p); }
__host__ __device__ inline int64_t packed_chunk_offset(int N, int kchunks, int p, int kc) {
  return cuda::b_fragment_offset(N, kchunks * kChunkSteps, kPassTiles, kc * kChunkSteps, p * kPassTiles);
}

struct TiledArgs : FlowParams {
  int KpD, KpH;                   // D, H rounded up to kKChunk
  const float *pw1, *pw2, *pw3;   // packed weights (w1 without its time column)
};

// The hidden layer h is the A operand of the next product only, so it lives
// in shared memory split (cuda::SplitRows: TF32 big and small planes, read
// by ldmatrix), split once when written instead of by each of the 8 warps
// at every read (before: with the B splits, ~7% of the issued instructions
// were mma, ncu run V).  x is kept in float32 for the Euler
// update and split beside it for the first layer.  One h buffer serves both
// hidden layers: the second layer keeps its whole output in registers (at
// most kMaxKeptPasses passes of 256 columns, so H <= 512) until every warp
// has read its input, then overwrites it -- two split buffers would not fit
// next to the weight stages at H = 256.
constexpr int kMaxKeptPasses = 2;

// Shared memory of one tile block, in floats.  Activation rows are K padded
// to kKChunk plus 4 (an odd multiple of 16 bytes: conflict-free ldmatrix);
// kStages chunk buffers.
struct TiledLayout {
  int ldD, ldH, X, XS, H, W, B1, WT, B2, B3, total;
  __host__ __device__ TiledLayout(int KpD, int KpH, int D, int H_) {
    ldD = KpD + 4;
    ldH = KpH + 4;
    X = 0;
    XS = X + kTileRows * ldD;       // x split: two planes
    H = XS + 2 * kTileRows * ldD;   // h split: two planes
    W = H + 2 * kTileRows * ldH;
    B1 = W + kStages * kChunkFloats;
    WT = B1 + H_;
    B2 = WT + H_;
    B3 = B2 + H_;
    total = B3 + D;
  }
};

// One layer of the tile kernel: out[r, n] for the tile's 32 rows and n < N
// from the split in[r, k < Kp] (zero for k >= the true K) and the layer's
// packed weights Wp.  See the file comment for the schedule.
//   kHidden: hs <- silu(acc + t * w_time + bias)     (w_time may be null)
//   kUpdate: x  <- x + dt * (acc + bias), x32 and its split copy xs
// KEEP = 0 writes each pass's output as it completes; KEEP > 0 (the layer
// overwrites its own input, N <= KEEP * kPassCols) keeps all passes in
// registers until every warp is past its last read of the input.
template <int MODE, int KEEP>
__device__ __forceinline__ void tiled_layer(const cuda::SplitRows in, int Kp, const float* __restrict__ Wp,
                                            int N, const cuda::SplitRows out, float* x32, const float* bias,
                                            const float* w_time, float t, float dt, float* wbuf) {
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, tq = lane % 4;
  const int kchunks = Kp / kKChunk, passes = (N + kPassCols - 1) / kPassCols;
  const int num_chunks = kchunks * passes;
  const float* a_lane = in.big + cuda::ldmatrix_lane_offset(in.ld);

  // Chunk q's copies into buffer q % kStages, one commit group per chunk
  // (empty past the last chunk, so every thread's group count is uniform).
  auto issue = [&](int q) {
    if (q < num_chunks) {
      const int p = q / kchunks, kc = q - p * kchunks;
      const float* src = Wp + packed_chunk_offset(N, kchunks, p, kc);
      float* dst = wbuf + (q % kStages) * kChunkFloats;
      const int granules = pass_tiles(N, p) * (kKChunk / 8 * kFragFloats / 4);
      for (int i = tid; i < granules; i += kThreads) cuda::cp_async_16(dst + 4 * i, src + 4 * i);
    }
    cuda::cp_async_commit();
  };

  // Adds chunk q (k-chunk kc of pass p, landed in its buffer) to acc for
  // this warp's NV tiles of the pass (warp + kWarps * i, i < NV).  NV is a
  // compile-time constant (run_pass switches on it per chunk, outside the
  // barriers): tile guards inside the product sequence made the compiler
  // fence every mma.sync with a WARPSYNC (ncu source counters, run X).
  auto add_chunk = [&](float (&acc)[2][4][4], int q, int kc, int tiles, auto nv) {
    constexpr int NV = decltype(nv)::value;
    const float* buf = wbuf + (q % kStages) * kChunkFloats + warp * kFragFloats + lane * 2;
    // The chunk's products into a fresh accumulator, added to acc in float32:
    // the tensor cores' own accumulation over a whole K is far less accurate
    // (vae_elbo.cu's wgmma section, "Accuracy").
    float part[2][4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKChunk / 8; ++kk) {
      const float* ap = a_lane + kc * kKChunk + kk * 8;
      uint32_t ab[2][4], as[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        cuda::ldmatrix_x4(ab[m], ap + m * 16 * in.ld);
        cuda::ldmatrix_x4(as[m], ap + m * 16 * in.ld + in.plane_floats);
      }
      uint32_t bb[4][2] = {}, bs[4][2] = {};
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const float2 w = *reinterpret_cast<const float2*>(buf + (kk * tiles + kWarps * i) * kFragFloats);
        const cuda::SplitTf32 b0 = cuda::split_tf32(w.x), b1 = cuda::split_tf32(w.y);
        bb[i][0] = b0.big, bb[i][1] = b1.big, bs[i][0] = b0.small, bs[i][1] = b1.small;
      }
      cuda::mma_3xtf32_tiles(part, ab, as, bb, bs, NV);
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
      // Chunk q has landed (this thread's copies), then everyone's; every
      // thread is past chunk q - 1, whose buffer chunk q + 2 now reuses.
      cuda::cp_async_wait<1>();
      __syncthreads();
      issue(q + 2);
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
          const float s = acc[m][i][e];
          if (MODE == kHidden) {
            out.store(row, col, silu(s + (w_time != nullptr ? t * w_time[col] : 0.f) + bias[col]));
          } else {
            float* o = x32 + row * out.ld + col;
            *o = euler_step(*o, dt, s + bias[col]);
            out.store(row, col, *o);
          }
        }
  };

  // The previous layer's last chunks may still be read from wbuf, and its
  // output (this layer's input) written: wait for every warp.
  __syncthreads();
  issue(0);
  issue(1);
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

template <int KEEP>
__global__ void __launch_bounds__(kThreads, 1) flow_tiled_kernel(TiledArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ float4 tiled_smem4[];
  float* smem = reinterpret_cast<float*>(tiled_smem4);
  const TiledLayout L(a.KpD, a.KpH, a.D, a.H);
  const int D = a.D, H = a.H, tid = threadIdx.x;
  const int64_t row0 = int64_t(blockIdx.x) * kTileRows;
  const int64_t remaining = a.B - row0;
  const int rows = remaining < kTileRows ? int(remaining) : kTileRows;
  const cuda::SplitRows xs{smem + L.XS, L.ldD, kTileRows * L.ldD};
  const cuda::SplitRows hs{smem + L.H, L.ldH, kTileRows * L.ldH};

  // Rows past B and columns past D / H are zero and stay zero in the
  // columns (never written); the extra rows evolve harmlessly and are not
  // stored.
  stage_rows(smem + L.X, kTileRows, L.ldD, a.x0 + row0 * D, D, rows, D);
  for (int i = tid; i < 2 * kTileRows * L.ldH; i += kThreads) smem[L.H + i] = 0.f;
  for (int j = tid; j < H; j += kThreads) {
    smem[L.B1 + j] = a.b1[j];
    smem[L.WT + j] = a.w1[int64_t(j) * (D + 1) + D];
    smem[L.B2 + j] = a.b2[j];
  }
  for (int d = tid; d < D; d += kThreads) smem[L.B3 + d] = a.b3[d];
  __syncthreads();
  for (int i = tid; i < kTileRows * L.ldD; i += kThreads) xs.store(i / L.ldD, i % L.ldD, smem[L.X + i]);
  // (tiled_layer begins with a barrier.)

  float* wbuf = smem + L.W;
  for (int k = 0; k < a.num_steps; ++k) {
    const float t = flow_step_time<float>(k, a.num_steps);
    tiled_layer<kHidden, 0>(xs, a.KpD, a.pw1, H, hs, nullptr, smem + L.B1, smem + L.WT, t, a.dt, wbuf);
    tiled_layer<kHidden, KEEP>(hs, a.KpH, a.pw2, H, hs, nullptr, smem + L.B2, nullptr, t, a.dt, wbuf);
    tiled_layer<kUpdate, 0>(hs, a.KpH, a.pw3, D, xs, smem + L.X, smem + L.B3, nullptr, t, a.dt, wbuf);
  }
  __syncthreads();
  for (int i = tid; i < rows * D; i += kThreads) {
    const int r = i / D, d = i - r * D;
    a.x[(row0 + r) * D + d] = smem[L.X + r * L.ldD + d];
  }
#else
  __trap();  // launched only on compute capability >= 8.0
#endif
}

TiledArgs tiled_args(const FlowEulerCall& c) {
  TiledArgs a{};
  static_cast<FlowParams&>(a) = flow_params(c);
  a.KpD = round_up(a.D, kKChunk);
  a.KpH = round_up(a.H, kKChunk);
  return a;
}

size_t tiled_smem(const TiledArgs& a) {
  return sizeof(float) * size_t(TiledLayout(a.KpD, a.KpH, a.D, a.H).total);
}

bool tiled_applies(const FlowEulerCall& c) {
  if (c.x.scalar_type() != ScalarType::Float) return false;
  if (cuda::compute_capability_major() < 8) return false;
  if (c.D > (1 << 16) || c.B > int64_t(INT_MAX) - kTileRows) return false;
  if (c.H > kMaxKeptPasses * kPassCols) return false;  // the second layer's output in registers
  return tiled_smem(tiled_args(c)) <= cuda::max_shared_memory_per_block();
}

void launch_tiled(const FlowEulerCall& c) {
  TiledArgs a = tiled_args(c);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  // Pack the three weights (w1 without its time column) into one workspace;
  // each layer's size is a multiple of 64 floats, so every chunk stays
  // 16-byte aligned for cp.async.
  const int kD = a.KpD / kKChunk * kChunkSteps, kH = a.KpH / kKChunk * kChunkSteps;  // k-steps
  const int64_t s1 = cuda::b_fragment_size(a.H, kD), s2 = cuda::b_fragment_size(a.H, kH),
                s3 = cuda::b_fragment_size(a.D, kH);
  Tensor packed = empty_like_device(c.x, {s1 + s2 + s3});
  float* pw = mdata<float>(packed);
  cuda::BFragmentsBatch batch{};
  batch.m[0] = {a.w1, a.D + 1, a.H, a.D, kD, kPassTiles, pw};
  batch.m[1] = {a.w2, a.H, a.H, a.H, kH, kPassTiles, pw + s1};
  batch.m[2] = {a.w3, a.H, a.D, a.H, kH, kPassTiles, pw + s1 + s2};
  cuda::pack_b_fragments(stream, batch, 3);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  a.pw1 = pw, a.pw2 = pw + s1, a.pw3 = pw + s1 + s2;

  const size_t smem = tiled_smem(a);
  static_assert(kMaxKeptPasses == 2, "one kernel per number of kept passes below");
  void (*kernel)(TiledArgs) = a.H <= kPassCols ? flow_tiled_kernel<1> : flow_tiled_kernel<2>;
  cuda::allow_dynamic_smem(kernel, smem);
  const unsigned grid = unsigned((c.B + kTileRows - 1) / kTileRows);
  kernel<<<grid, kThreads, smem, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// wgmma path (sm_90a: H100 / H200; D = 64, H = 256, float32)
// ---------------------------------------------------------------------------
//
// The tile kernel's work with Hopper's warpgroup products (cuda/wgmma.cuh,
// cuda/wgmma_stream.cuh).  wgmma's M is 64, and 64-row tiles alone would
// leave half of an H200 idle at B=4096 (64 tiles), so each tile runs on a
// pair of CTAs (a 2-CTA cluster) that split every layer's output columns:
// CTA r computes columns [r N/2, (r+1) N/2) of each layer (its warpgroups a
// quarter each), streaming only its half of the weights, and stores its half
// of the activations into both CTAs' copies (distributed shared memory), so
// each CTA holds the full A operand of the next layer.  Shared memory: h
// split (64 x 256, two planes: 128 KB; x's split copy lives in its first
// eight k-step blocks, the A operand of layer 1) and a ring of three 32 KB
// weight chunks (layer 3's 8 KB K chunks four to one); the chunk sequence
// (12 per step) repeats every step, so the bulk copies run ahead across
// layers and steps.  x itself stays in
// registers, in the layer-3 accumulators' layout (each thread its 8 values),
// and is updated there in float32.  A layer: products (per-chunk float32
// sums, as in every wgmma kernel here; a stage of the ring is refilled by
// whichever warpgroup finishes it second, no block barrier per chunk) ->
// relaxed cluster arrival (done reading the layer's input, which the output
// overwrites) -> bias, SiLU / Euler update -> cluster wait -> split, stores
// into this CTA's copy and asynchronous stores (st.async) into the
// partner's, whose bytes complete on its exchange mbarrier -> proxy fence,
// block barrier.  The next layer's products take this CTA's own half of K
// first and wait for the partner's half (its mbarrier) only when they
// reach it, so the exchange travels while the tensor cores work.
// The first version published each layer with a proxy fence and a second
// cluster barrier instead: both order memory at GPU scope (MEMBAR.GPU in
// the SASS), and waiting for those fences and the per-chunk block barrier
// was ~25% of the kernel's stall samples (ncu, twelfth session's run 2).
namespace fwg {

using cuda::wgs::kBlock;
using cuda::wgs::kKChunk;
using cuda::wgs::kS;
using cuda::wgs::kStages;
using cuda::wgs::chunk_floats;

constexpr int kD = 64, kH = 256;
constexpr int kThreadsW = 256;
constexpr int kRowsW = 64;
constexpr int kNp12 = kH / 2;                 // layer 1-2 columns per CTA (n64 per warpgroup)
constexpr int kNp3 = kD / 2;                  // layer 3 columns per CTA (n16 per warpgroup)
constexpr int kChunks1 = kD / kKChunk;        // 2
constexpr int kChunks23 = kH / kKChunk;       // 8
constexpr int kHPlane = kH / 8 * kBlock;      // one plane of h (floats)
constexpr int kStage = chunk_floats(kNp12);   // 32 KB: the largest chunk
constexpr int kRing = 2 * kHPlane;
constexpr int kBarsAt = kRing + kStages * kStage;  // the ring's mbarriers
constexpr int kXbarAt = kBarsAt + 2 * kStages;     // the exchange's mbarrier
constexpr int kDoneAt = kXbarAt + 2;               // the ring's completion counters (ChunkStream::done)
// The epilogues' per-column constants of this CTA's columns, read from
// shared memory every step instead of global memory: b1, w1's time column,
// b2 (kNp12 each), b3 (kNp3).
constexpr int kConstsAt = kDoneAt + kStages;
constexpr int kConsts = 3 * kNp12 + kNp3;
constexpr size_t kSmem = sizeof(float) * (kConstsAt + kConsts);
// Bytes of one layer's output that the partner stores into this CTA (its
// half of the columns, both planes, 64 rows) in exchange e = 0, 1, ...: the
// outputs of layers 1, 2, 3 of each step in turn.
[[maybe_unused]] __host__ __device__ constexpr uint32_t peer_bytes(int e) {
  return uint32_t(kRowsW * (e % 3 == 2 ? kNp3 : kNp12) * 2 * sizeof(float));
}
// Layer 3's K chunks (chunk_floats(kNp3) floats: 8 KB) travel kSub3 to a
// ring chunk (add_chunks' kSub), as layers 1-2's 32 KB chunks do.
constexpr int kSub3 = kStage / chunk_floats(kNp3);  // 4
static_assert(kSub3 * chunk_floats(kNp3) == kStage && kChunks23 % (2 * kSub3) == 0, "layer 3's ring chunks");
// Packed weights of one CTA rank: layer 1 then layer 2 (chunks of kStage
// floats), then layer 3 (chunks of chunk_floats(kNp3), kSub3 to a stage).
constexpr int64_t kPackedPerRank = int64_t(kChunks1 + kChunks23) * kStage + int64_t(kChunks23) * chunk_floats(kNp3);

#if defined(FUSED_OPS_WGMMA)
// The column of this thread's x value i: its warpgroup's 16 columns of the
// layer-3 accumulator (m64n32, a quarter of x's columns per warpgroup),
// acc_col(i) of them; its row is acc_row(i) (cuda/wgmma_stream.cuh).
__device__ __forceinline__ int acc3_col(int i, int rank) {
  return rank * kNp3 + (int(threadIdx.x) / 128) * (kNp3 / 2) + cuda::wgs::acc_col(i);
}
#endif

__global__ void __launch_bounds__(kThreadsW, 1) flow_wgmma_kernel(const FlowParams p, const float* packed) {
#if defined(FUSED_OPS_WGMMA)
  extern __shared__ __align__(128) float smem[];
  namespace wgs = cuda::wgs;
  using wgs::ChunkStream;
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + kBarsAt);
  uint64_t* const xbar = reinterpret_cast<uint64_t*>(smem + kXbarAt);
  uint32_t* const done = reinterpret_cast<uint32_t*>(smem + kDoneAt);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int tid = int(threadIdx.x), wgi = tid / 128;
  const int row0 = int(blockIdx.x / 2) * kRowsW, rows = max(0, min(kRowsW, p.B - row0));
  float* const own = smem;                                             // h (x in its first blocks)
  const uint32_t other = cuda::cluster_addr(smem, rank ^ 1);           // the partner's copy
  const uint32_t other_xbar = cuda::cluster_addr(xbar, rank ^ 1);
  float* const consts = smem + kConstsAt;
  wgs::init_ring_barriers(bars);
  if (tid == 0) {
    cuda::mbarrier_init(xbar, 1);
    cuda::mbarrier_init_fence();
    if (p.num_steps > 0) cuda::mbarrier_arrive_expect_tx(xbar, peer_bytes(0));  // exchange 0 (below)
    for (int s = 0; s < kStages; ++s) done[s] = 0;
  }
  for (int i = tid; i < kConsts; i += kThreadsW) {
    const int layer = i / kNp12, c = i % kNp12, n = rank * kNp12 + c;
    consts[i] = layer == 0   ? p.b1[n]
                : layer == 1 ? p.w1[int64_t(n) * (kD + 1) + kD]
                : layer == 2 ? p.b2[n]
                             : p.b3[rank * kNp3 + c];
  }
  __syncthreads();
  const float* const mine = packed + rank * kPackedPerRank;
  ChunkStream st{mine, kStage, kChunks1 + kChunks23, mine + int64_t(kChunks1 + kChunks23) * kStage,
                 kStage, kChunks23 / kSub3, smem + kRing, kStage, kStages, 0, p.num_steps, done};
  st.prologue(bars);

  // x: this thread's 8 values in registers; the whole tile's split copy in
  // shared memory (each CTA stages all 64 columns itself at the start).
  float xm[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = wgs::acc_row(i);
    xm[i] = r < rows ? p.x0[int64_t(row0 + r) * kD + acc3_col(i, rank)] : 0.0f;
  }
  for (int idx = tid; idx < kRowsW * kD / 2; idx += kThreadsW) {
    const int r = idx / (kD / 2), k = 2 * (idx % (kD / 2));
    const float* src = p.x0 + int64_t(row0 + r) * kD + k;
    wgs::store_split_pair(own, kHPlane, r, k, r < rows ? src[0] : 0.0f, r < rows ? src[1] : 0.0f);
  }
  cuda::fence_proxy_async();
  cluster.sync();  // (also: the partner's mbarrier is initialised before anything is stored into it)

  // Stores the pair into both CTAs' copies of the A operand at (r, k).
  auto store_both = [&](int r, int k, float v0, float v1) {
    const wgs::SplitPair s = wgs::split_pair(r, k, v0, v1);
    wgs::store_split(own, kHPlane, s);
    cuda::st_async(other + sizeof(float) * s.at, s.big, other_xbar);
    cuda::st_async(other + sizeof(float) * (s.at + kHPlane), s.small, other_xbar);
  };
  // After the stores of a layer: this CTA's half of the output (both
  // warpgroups' quarters) visible to its tensor cores.
  auto publish_own = [&] {
    cuda::fence_proxy_async();
    __syncthreads();
  };
  // Exchange e = 0, 1, ..., 3 num_steps - 1 (peer_bytes) is phase e of
  // xbar, complete when the partner's half of that output has landed here.
  // partner_half waits for the next one (acquire at cluster scope), makes
  // the bytes visible to this thread's tensor-core reads and arms the phase
  // after it.
  const int exchanges = 3 * p.num_steps;
  int xe = 0;
  auto partner_half = [&] {
    cuda::mbarrier_wait(xbar, uint32_t(xe) & 1u);
    cuda::fence_proxy_async();
    if (tid == 0 && xe + 1 < exchanges) cuda::mbarrier_arrive_expect_tx(xbar, peer_bytes(xe + 1));
    ++xe;
  };
  // The A operand of chunk c of a layer with `chunks` K chunks: this CTA's
  // own half of K first (its weights are packed in that order: kshift in
  // launch_wgmma), so the products start as soon as its own half is stored
  // and the partner's half travels meanwhile; waited for (when it is still
  // to come) as this warpgroup's first chunk of it, first_partner, is
  // issued.
  auto a_of = [&](int chunks, bool partner_pending, int first_partner) {
    return [=, &partner_half](int c) {
      if (partner_pending && c == first_partner) partner_half();
      return own + (c + rank * (chunks / 2)) % chunks * (kS * kBlock);
    };
  };
  auto no_hook = [](int) {};

  int q = 0;
  for (int step = 0; step < p.num_steps; ++step) {
    const float t = flow_step_time<float>(step, p.num_steps);
    // Layer 1: x [64 x 64] -> h1, columns [rank * 128, +128); layer 2: h1 ->
    // h2 in place.  activate(nl, v): the output of this CTA's column nl from
    // its product.
    auto hidden_layer = [&](int chunks, bool partner_pending, auto activate) {
      float acc[kNp12 / 4];
      wgs::zero(acc);
      wgs::add_chunks<kNp12 / 2>(acc, st, q, chunks, a_of(chunks, partner_pending, chunks / 2), kHPlane, bars, no_hook,
                                 no_hook);
      q += chunks;
      // The activations are computed while the partner finishes reading the
      // layer's input; only the stores wait for it.
      cuda::cluster_arrive_relaxed();
      wgs::map_columns<kNp12 / 2>(acc, [&](int c, float v) { return activate(wgi * (kNp12 / 2) + c, v); });
      cuda::cluster_wait();
      wgs::for_each_pair<kNp12 / 2>(acc, [&](int r, int, int c, float v0, float v1) {
        store_both(r, rank * kNp12 + wgi * (kNp12 / 2) + c, v0, v1);
      });
      publish_own();
    };
    // (Step 0's x is staged whole in both CTAs.)
    hidden_layer(kChunks1, step > 0,
                 [&](int nl, float v) { return silu_fast(v + t * consts[kNp12 + nl] + consts[nl]); });
    hidden_layer(kChunks23, true, [&](int nl, float v) { return silu_fast(v + consts[2 * kNp12 + nl]); });
    // Layer 3 and the Euler update of this thread's x values; the new x goes
    // into both copies of layer 1's A operand.  The warpgroups split layer
    // 3's K, not its 32 columns (add_chunks' kSplitK: warpgroup w takes
    // chunks w, w + 2, ..., all columns): two warpgroups each reading the
    // whole of h2 for 16 columns spent the shared-memory bandwidth twice on
    // m64n16 products.  The partial sums meet in shared memory, in h's
    // blocks 8-11: nothing reads them once both warpgroups are done with h2
    // (the block barrier), and the partner's x lands in blocks 0-7 only.
    {
      float acc[kNp3 / 2];  // columns [16 w, 16 w + 16) in acc[8 w .. 8 w + 7]
      wgs::zero(acc);
      wgs::add_chunks<kNp3, true, kSub3>(acc, st, q, kChunks23, a_of(kChunks23, true, kChunks23 / 2 + wgi), kHPlane,
                                         bars, no_hook, no_hook);
      q += kChunks23 / kSub3;
      cuda::cluster_arrive_relaxed();
      __syncthreads();
      float* const part = own + 8 * kBlock;  // [warpgroup][thread of it][8]
#pragma unroll
      for (int i = 0; i < 8; ++i) part[(wgi * 128 + tid % 128) * 8 + i] = wgi == 0 ? acc[8 + i] : acc[i];
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float v = (wgi == 0 ? acc[i] : acc[8 + i]) + part[((1 - wgi) * 128 + tid % 128) * 8 + i];
        xm[i] = euler_step(xm[i], p.dt, v + consts[3 * kNp12 + acc3_col(i, rank) - rank * kNp3]);
      }
      cuda::cluster_wait();
#pragma unroll
      for (int i = 0; i < 8; i += 2) store_both(wgs::acc_row(i), acc3_col(i, rank), xm[i], xm[i + 1]);
      publish_own();
    }
  }
  if (exchanges > 0) partner_half();  // the last x half: landed before the barriers are invalidated
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = wgs::acc_row(i);
    if (r < rows) p.x[int64_t(row0 + r) * kD + acc3_col(i, rank)] = xm[i];
  }
  // Neither CTA exits while its stores into the other may be in flight.
  cuda::cluster_arrive_relaxed();
  cuda::cluster_wait();
  wgs::inval_ring_barriers(bars);
  if (tid == 0) cuda::mbarrier_inval(xbar);
#else
  (void)p;
  (void)packed;
  __trap();  // launched only where the sm_90a code was built (FUSED_OPS_SM90A)
#endif
}

}  // namespace fwg

// Launches the wgmma path; false when it does not apply.
bool launch_wgmma(const FlowEulerCall& c) {
#if defined(FUSED_OPS_SM90A)
  static_assert(fwg::kD == kRowD && fwg::kH == kRowH, "the wgmma kernel is written for row_sizes");
  if (!row_sizes(c) || c.B > int64_t(INT_MAX) - fwg::kRowsW || !cuda::wgs::device_runs_sm90a() ||
      !cuda::cluster_fits(fwg::flow_wgmma_kernel, 2, fwg::kThreadsW, fwg::kSmem)) {
    return false;
  }
  const FlowParams p = flow_params(c);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  Tensor packed = empty_like_device(c.x, {2 * fwg::kPackedPerRank});
  float* out = mdata<float>(packed);
  using cuda::wgs::CorePack;
  cuda::wgs::CorePackBatch batch{};
  for (int r = 0; r < 2; ++r) {
    float* base = out + r * fwg::kPackedPerRank;
    // (w0, w1, ld, rows, K, np, n_start, passes, kchunks, out, kshift): w1
    // without its time column; rank r's own half of each layer's K first.
    batch.p[3 * r] = CorePack{p.w1, nullptr, fwg::kD + 1, fwg::kH, fwg::kD, fwg::kNp12, r * fwg::kNp12, 1,
                              fwg::kChunks1, base, r * fwg::kChunks1 / 2};
    batch.p[3 * r + 1] = CorePack{p.w2, nullptr, fwg::kH, fwg::kH, fwg::kH, fwg::kNp12, r * fwg::kNp12, 1,
                                  fwg::kChunks23, base + fwg::kChunks1 * fwg::kStage, r * fwg::kChunks23 / 2};
    batch.p[3 * r + 2] = CorePack{p.w3, nullptr, fwg::kH, fwg::kD, fwg::kH, fwg::kNp3, r * fwg::kNp3, 1,
                                  fwg::kChunks23, base + (fwg::kChunks1 + fwg::kChunks23) * fwg::kStage,
                                  r * fwg::kChunks23 / 2};
  }
  cuda::wgs::pack_core(stream, batch, 6);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  const int64_t tiles = (c.B + fwg::kRowsW - 1) / fwg::kRowsW;
  const cuda::ClusterLaunch launch(2 * tiles, 2, fwg::kThreadsW, fwg::kSmem, stream);
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, fwg::flow_wgmma_kernel, p, static_cast<const float*>(out)));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  return true;
#else
  (void)c;
  return false;
#endif
}

// ---------------------------------------------------------------------------
// entry point
// ---------------------------------------------------------------------------

Tensor flow_euler_cuda(const Tensor& x0, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                       const Tensor& b2, const Tensor& w3, const Tensor& b3, int64_t num_steps) {
  const cuda::TensorDeviceGuard guard(x0);
  FlowEulerCall c(x0, w1, b1, w2, b2, w3, b3, num_steps);
  FUSED_OPS_CHECK(x0.is_cuda(), "x0 must be a CUDA tensor, got ", device_str(x0));
  FUSED_OPS_CHECK(num_steps <= INT_MAX, "num_steps must fit in int32, got ", num_steps);
  if (c.B == 0) return c.x;
  // Path rule (see the file comment): at the default D and H in float32 the
  // split path up to half the SMs' worth of rows, then the row path up to
  // one row per SM; else the cluster path for small float32 batches on
  // sm_90 when the weight slices fit, the tensor-core tile kernel for
  // float32 on sm_80+ when a tile fits, the general kernels otherwise.
  if (const int blocks = split_blocks_for(c)) {
    if (blocks == 4) {
      launch_split<4>(c);
    } else {
      launch_split<2>(c);
    }
  } else if (row_applies(c)) {
    launch_row(c);
  } else if (const int blocks = cluster_blocks_for(c)) {
    launch_cluster(c, blocks);
  } else if (launch_wgmma(c)) {
  } else if (tiled_applies(c)) {
    launch_tiled(c);
  } else {
    dispatch_float(c.x.scalar_type(), [&](auto zero) { launch_general<decltype(zero)>(c); });
  }
  return c.x;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) { m.impl("flow_euler", TORCH_BOX(&flow_euler_cuda)); }

}  // namespace fused_ops
