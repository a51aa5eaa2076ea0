// \brief fused_ops::flow_euler, wgmma path: large float32 batches at the
// default D = 64, H = 256 on Hopper's warpgroup products (sm_90a), a CTA
// pair per 64 rows.
//
// Chosen for float32 at exactly D = 64, H = 256 on compute capability 9.0
// in a build with the sm_90a code (FUSED_OPS_SM90A), when a 2-CTA cluster
// fits, after the split, row and cluster paths (so for B above the number
// of SMs, e.g. the large-batch default B = 4096).
//
// Design: the tiled path's work with warpgroup products
// (cuda/primitives/wgmma.cuh, wgmma_stream.cuh); see the comment above the
// kernel.  A packing kernel first lays the weights out in the core-matrix
// order the products read, each CTA rank's half separately.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/flow_euler/paths.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/wgmma_stream.cuh"

namespace fused_ops {
namespace {

namespace cg = cooperative_groups;

// The tile kernel's work with Hopper's warpgroup products
// (cuda/primitives/wgmma.cuh, wgmma_stream.cuh).  wgmma's M is 64, and
// 64-row tiles alone would leave half of an H200 idle at B=4096 (64
// tiles), so each tile runs on a
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
// Publishing each layer with a proxy fence and a second cluster barrier
// instead would order memory at GPU scope (MEMBAR.GPU in the SASS), and the
// kernel would stall on those fences (docs/flow_euler.md, variants).
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
// acc_col(i) of them; its row is acc_row(i) (cuda/primitives/wgmma_stream.cuh).
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

}  // namespace

namespace flow_euler_paths {

// row_sizes, B small enough for the tile arithmetic, a device that runs the
// sm_90a code (compute capability exactly 9.0) and a 2-CTA cluster with the
// kernel's shared memory that fits.
bool wgmma_applies(const FlowEulerCall& c) {
#if defined(FUSED_OPS_SM90A)
  static_assert(fwg::kD == kRowD && fwg::kH == kRowH, "the wgmma kernel is written for row_sizes");
  return row_sizes(c) && c.B <= int64_t(INT_MAX) - fwg::kRowsW && cuda::wgs::device_runs_sm90a() &&
         cuda::cluster_fits(fwg::flow_wgmma_kernel, 2, fwg::kThreadsW, fwg::kSmem);
#else
  (void)c;
  return false;  // no sm_90a code in this build
#endif
}

void launch_wgmma(const FlowEulerCall& c) {
#if defined(FUSED_OPS_SM90A)
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
#else
  (void)c;
  FUSED_OPS_CHECK(false, "flow_euler: the wgmma path needs a build with the sm_90a code (FUSED_OPS_SM90A)");
#endif
}

}  // namespace flow_euler_paths
}  // namespace fused_ops
