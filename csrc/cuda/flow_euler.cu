// CUDA kernels of fused_ops::flow_euler.  Three paths, chosen per call on the
// host (choose_path below) from the dtype, the sizes and the device:
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
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>

#include "cuda/cp_async.cuh"
#include "cuda/int_divider.cuh"
#include "cuda/reductions.cuh"
#include "cuda/runtime.cuh"
#include "cuda/tf32x3.cuh"
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
  T* x = c.x.mutable_data_ptr<T>();
  const T* w1 = c.w1.const_data_ptr<T>();
  Tensor h1 = empty_like_device(c.x, {B, H});
  Tensor h2 = empty_like_device(c.x, {B, H});
  FUSED_OPS_CUDA_CHECK(cudaMemcpyAsync(x, c.x0.const_data_ptr<T>(), sizeof(T) * B * D, cudaMemcpyDeviceToDevice, stream));
  auto grid = [](int64_t n) { return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 8192)); };
  const T dt = flow_step_size<T>(c.num_steps);
  for (int64_t k = 0; k < c.num_steps; ++k) {
    const T t = flow_step_time<T>(k, c.num_steps);
    general_layer_kernel<T, kHidden><<<grid(B * H), kThreads, 0, stream>>>(
        x, B, D, w1, D + 1, w1 + D, c.b1.const_data_ptr<T>(), H, t, dt, h1.mutable_data_ptr<T>());
    FUSED_OPS_CUDA_LAUNCH_CHECK();
    general_layer_kernel<T, kHidden><<<grid(B * H), kThreads, 0, stream>>>(
        h1.mutable_data_ptr<T>(), B, H, c.w2.const_data_ptr<T>(), H, nullptr, c.b2.const_data_ptr<T>(), H, t, dt,
        h2.mutable_data_ptr<T>());
    FUSED_OPS_CUDA_LAUNCH_CHECK();
    general_layer_kernel<T, kUpdate><<<grid(B * D), kThreads, 0, stream>>>(
        h2.mutable_data_ptr<T>(), B, H, c.w3.const_data_ptr<T>(), H, nullptr, c.b3.const_data_ptr<T>(), D, t, dt, x);
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
  p.x0 = c.x0.const_data_ptr<float>();
  p.w1 = c.w1.const_data_ptr<float>();
  p.b1 = c.b1.const_data_ptr<float>();
  p.w2 = c.w2.const_data_ptr<float>();
  p.b2 = c.b2.const_data_ptr<float>();
  p.w3 = c.w3.const_data_ptr<float>();
  p.b3 = c.b3.const_data_ptr<float>();
  p.x = c.x.mutable_data_ptr<float>();
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
      cuda::mma_3xtf32_tiles(acc, ab, as, bb, bs, NV);
    }
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
  float* pw = packed.mutable_data_ptr<float>();
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
// entry point
// ---------------------------------------------------------------------------

Tensor flow_euler_cuda(const Tensor& x0, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                       const Tensor& b2, const Tensor& w3, const Tensor& b3, int64_t num_steps) {
  // x0 may be the CPU tensor of a CPU/CUDA mix: the checks in FlowEulerCall
  // then name it, so only guard a CUDA device here.
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  if (x0.is_cuda()) guard.emplace(x0.get_device_index());
  FlowEulerCall c(x0, w1, b1, w2, b2, w3, b3, num_steps);
  FUSED_OPS_CHECK(x0.is_cuda(), "x0 must be a CUDA tensor, got ", device_str(x0));
  FUSED_OPS_CHECK(num_steps <= INT_MAX, "num_steps must fit in int32, got ", num_steps);
  if (c.B == 0) return c.x;
  // Path rule (see the file comment): cluster for small float32 batches on
  // sm_90 when the weight slices fit, else the tensor-core tile kernel for
  // float32 on sm_80+ when a tile fits, else the general kernels.
  if (const int blocks = cluster_blocks_for(c)) {
    launch_cluster(c, blocks);
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
