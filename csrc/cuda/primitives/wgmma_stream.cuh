// \brief Streaming packed weights through Hopper warpgroup products (sm_90a):
// the pieces the wgmma kernels share.  A CTA of two warpgroups owns 64 rows of
// activations (the wgmma M), kept in shared memory split into TF32 big and
// small planes in wgmma.cuh's operand layout; the weights are packed once per
// call, split, in the same layout and in the order they are consumed, and
// arrive in chunks of kS k-steps by bulk copies (one thread issues them)
// through a ring of up to kStages stages, each completing on its own
// mbarrier.  Each chunk's 3xTF32 products go into a fresh accumulator that is
// added to the running sums in float32: the tensor cores' own accumulation
// over a whole K is far less accurate (docs/vae_elbo.md).
//
// Used by the wgmma paths of vae_elbo and flow_euler.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/tf32x3.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace fused_ops {
namespace cuda {
namespace wgs {

constexpr int kS = 4;                  // k-steps per weight chunk
constexpr int kKChunk = 8 * kS;        // K columns per chunk
constexpr int kStages = 3;             // mbarriers of the ring
constexpr int kBlock = 64 * 8;         // one k-step block of a 64-row A operand, floats
__host__ __device__ constexpr int chunk_floats(int np) { return 2 * kS * np * 8; }

// Packed weights: for each pass of np output columns, its K in chunks of kS
// k-steps, each chunk [plane: big, small][k-step][np / 8 column groups]
// [core matrices: k < 4, k >= 4][8 columns][4 k].  Column c of pass q is
// weight row n_start + q np + c; with w1 set, the first np / 2 columns are
// rows of w0 and the rest rows of w1.  Rows past `rows` and k past K are zero.
// Packed chunk c of a pass holds K chunk (c + kshift) % kchunks: a consumer
// that has some of its A operand's k sooner than the rest takes those first.
struct CorePack {
  const float *w0, *w1;
  int ld, rows, K, np, n_start, passes, kchunks;
  float* out;
  int kshift = 0;
  __host__ __device__ int64_t size() const { return int64_t(passes) * kchunks * chunk_floats(np); }
};
constexpr int kMaxPacks = 6;
struct CorePackBatch {
  CorePack p[kMaxPacks];  // blockIdx.y picks one; gridDim.y of them are used
};

// One thread per four consecutive k of a packed column (a float4 in each
// plane).  A template, as the header is compiled into several files.
template <int kThreadsPerBlock>
__global__ void __launch_bounds__(kThreadsPerBlock) pack_core_kernel(const CorePackBatch batch) {
  CorePack m = batch.p[0];
#pragma unroll
  for (int i = 1; i < kMaxPacks; ++i)
    if (int(blockIdx.y) == i) m = batch.p[i];
  const int plane = chunk_floats(m.np) / 2, quads = plane / 4;
  const int64_t total = int64_t(m.passes) * m.kchunks * quads;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int chunk = int(i / quads), o = int(i % quads) * 4;
    const int q = chunk / m.kchunks, c = chunk % m.kchunks;
    const int s = o / (m.np * 8), o3 = o % (m.np * 8);
    const int col = (o3 / 64) * 8 + (o3 % 32) / 4;
    const int k = ((c + m.kshift) % m.kchunks * kS + s) * 8 + ((o3 % 64) / 32) * 4;
    const float* src = m.w0;
    int row = m.n_start + q * m.np + col;
    if (m.w1 != nullptr) {
      const bool second = col >= m.np / 2;
      src = second ? m.w1 : m.w0;
      row = second ? col - m.np / 2 : col;
    }
    float big[4], small[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v = (row < m.rows && k + e < m.K) ? __ldg(src + int64_t(row) * m.ld + k + e) : 0.0f;
      const SplitTf32 sp = split_tf32(v);
      big[e] = __uint_as_float(sp.big);
      small[e] = __uint_as_float(sp.small);
    }
    float* const out = m.out + int64_t(chunk) * 2 * plane + o;
    *reinterpret_cast<float4*>(out) = make_float4(big[0], big[1], big[2], big[3]);
    *reinterpret_cast<float4*>(out + plane) = make_float4(small[0], small[1], small[2], small[3]);
  }
}

// Packs batch.p[0 .. count) on `stream` (out pointers set, 16-byte aligned).
inline void pack_core(cudaStream_t stream, const CorePackBatch& batch, int count) {
  int64_t largest = 1;
  for (int i = 0; i < count; ++i) largest = batch.p[i].size() > largest ? batch.p[i].size() : largest;
  constexpr int kPackThreads = 256;
  const int64_t blocks = (largest / 8 + kPackThreads - 1) / kPackThreads;  // a float4 of both planes per thread
  pack_core_kernel<kPackThreads>
      <<<dim3(unsigned(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks)), unsigned(count)), kPackThreads, 0,
         stream>>>(batch);
}

// Whether the current device runs the sm_90a kernels (compute capability
// exactly 9.0; the caller also needs a build with FUSED_OPS_SM90A).
inline bool device_runs_sm90a() {
  return compute_capability_major() == 9 && device_attribute(cudaDevAttrComputeCapabilityMinor) == 0;
}

#if defined(FUSED_OPS_WGMMA)

// The ring's kStages mbarriers at bars (one arrival each: the thread that
// issues the bulk copies): initialised by thread 0, before the block
// barrier that must follow; invalidated by thread 0 at the end.
__device__ __forceinline__ void init_ring_barriers(uint64_t* bars) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(bars + s, 1);
    mbarrier_init_fence();
  }
}
__device__ __forceinline__ void inval_ring_barriers(uint64_t* bars) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_inval(bars + s);
  }
}

// The weight chunks of a stretch of the kernel, in consumption order:
// `chunks` chunks of `floats` from src, then chunks2 of floats2 from src2,
// that sequence `repeats` times (a time-stepping kernel reads the same
// weights every step), through `depth` stages of `stage` floats at ring.
// Chunk q uses the mbarrier (g0 + q) % kStages, g0 counting the chunks
// consumed before, so each mbarrier's phases alternate in parity throughout.
struct ChunkStream {
  const float* src;
  int floats, chunks;
  const float* src2;
  int floats2, chunks2;
  float* ring;
  int stage, depth;
  int g0;
  int repeats = 1;
  // With `done` (kStages zeroed counters in shared memory), a chunk's stage
  // is refilled by whichever warpgroup finishes its products second, and
  // no block barrier is taken per chunk; without, release takes one.
  uint32_t* done = nullptr;
  __device__ int total() const { return (chunks + chunks2) * repeats; }
  __device__ float* slot(int q) const { return ring + (q % depth) * stage; }
  // Thread 0: arm chunk q's mbarrier with its bytes and start its copy.
  __device__ void issue(int q, uint64_t* bars) const {
    const int r = q % (chunks + chunks2);
    const bool first = r < chunks;
    const float* from = first ? src + int64_t(r) * floats : src2 + int64_t(r - chunks) * floats2;
    const uint32_t bytes = uint32_t(first ? floats : floats2) * uint32_t(sizeof(float));
    uint64_t* bar = bars + (g0 + q) % kStages;
    mbarrier_arrive_expect_tx(bar, bytes);
    bulk_copy_g2s(slot(q), from, bytes, bar);
  }
  // Thread 0: the first `depth` chunks, from chunk `from` on (the chunks
  // before it issued earlier, where their stages were free sooner).
  __device__ void prologue(uint64_t* bars, int from = 0) const {
    if (threadIdx.x == 0) {
      for (int q = from; q < depth && q < total(); ++q) issue(q, bars);
    }
  }
  // After chunk q's products completed in this warpgroup (wgmma_wait):
  // refill its stage once both warpgroups are done with it.  With `done`,
  // one thread per warpgroup counts the stage's completions (acquire-release
  // at block scope, as the consumer release of an mbarrier pipeline) and the
  // second one issues the copy, so neither warpgroup waits for the other;
  // without, a block barrier, then thread 0.
  __device__ void release(int q, uint64_t* bars) const {
    if (done != nullptr) {
      if (threadIdx.x % 128 == 0) {
        uint32_t old;
        asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;"
                     : "=r"(old)
                     : "r"(smem_addr(done + (g0 + q) % kStages))
                     : "memory");
        if ((old & 1u) != 0 && q + depth < total()) issue(q + depth, bars);
      }
      return;
    }
    __syncthreads();
    if (threadIdx.x == 0 && q + depth < total()) issue(q + depth, bars);
  }
  // release for a chunk that only this warpgroup reads (add_chunks'
  // split-K mode): its stage is refilled at once.
  __device__ void release_own(int q, uint64_t* bars) const {
    if (threadIdx.x % 128 == 0 && q + depth < total()) issue(q + depth, bars);
  }
};

// Issues chunk q's kS k-steps of acc = A * B^T for this warpgroup's np / 2 =
// N columns (warpgroup w takes columns [w N, (w + 1) N) of the chunk; with
// kWhole, the chunk holds N columns and this warpgroup takes them all): A's
// big plane at a (k-step blocks kBlock apart, its small plane a_plane
// further).  acc's old values are not read (the first product overwrites
// them), so a fresh accumulator needs no zeroing.  Waits for the chunk's
// bytes first; the products complete at the caller's wgmma_wait.
// sub: which of the chunk's consecutive sub-chunks (each of
// chunk_floats(np) floats) to take, for streams whose ring chunks hold
// several (add_chunks' kSub).
template <int N, bool kWhole = false>
__device__ __forceinline__ void chunk_products(float (&acc)[N / 2], const ChunkStream& st, int q, const float* a,
                                               int a_plane, uint64_t* bars, int sub = 0) {
  const int gq = st.g0 + q;
  mbarrier_wait_cta(bars + gq % kStages, uint32_t(gq / kStages) & 1u);
  const int np = kWhole ? N : 2 * N, wgi = int(threadIdx.x) / 128;
  const float* b = st.slot(q) + sub * chunk_floats(np) + (kWhole ? 0 : wgi * np * 4);
  const int b_plane = kS * np * 8;
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < kS; ++s) {
    const float* as = a + s * kBlock;
    const float* bs = b + s * np * 8;
    wgmma_3xtf32<N>(acc, wgmma_desc(as), wgmma_desc(as + a_plane), wgmma_desc(bs), wgmma_desc(bs + b_plane),
                    s == 0 ? 0 : 1);
  }
  wgmma_commit();
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = 0.0f;
}

// sum += the products of chunks q .. q + count - 1 (chunk c's A at a_of(c),
// called right before chunk c's products are issued: it may wait for them),
// each chunk in a fresh accumulator added in float32, releasing each chunk's
// stage after its products.  Two accumulators alternate so that chunk
// c + 1's products run while chunk c's complete and are added: waiting for
// each chunk before issuing the next left the tensor cores idle for the
// wait, the adds and the block barrier of every chunk.
// during(c) runs while chunk c's (and c + 1's) products are in flight;
// after(c) after chunk c's release (with a block barrier, st.done unset:
// its stage and its A free again, every thread past the barrier).  The
// loop is unrolled by two so that every wgmma names its accumulator
// registers statically: an accumulator that ptxas cannot tell apart from
// one in flight makes it serialise every wgmma of the kernel (warning
// C7514).
// kSplitK: the warpgroups split the chunks instead of the columns --
// warpgroup w takes chunks w, w + 2, ... (count even), all N columns of
// each (chunk_products' kWhole), and sum holds its partial sums over them;
// c in a_of, during and after still counts the chunks from q.  For narrow
// outputs, where two warpgroups each reading the whole A operand for a
// few columns would spend the shared-memory bandwidth twice.
// kSub: each ring chunk holds kSub consecutive K chunks (count of them in
// all, from ring chunk q on), each still in its own fresh accumulator: a
// stream of small chunks (narrow outputs) then keeps as many bytes in
// flight as one of wide chunks, instead of a few small copies whose L2
// latency the products wait for.  A ring chunk is released after its
// last K chunk that this warpgroup takes (count a multiple of kSub).
template <int N, bool kSplitK = false, int kSub = 1, typename AOf, typename During, typename After>
__device__ __forceinline__ void add_chunks(float (&sum)[N / 2], const ChunkStream& st, int q, int count, AOf a_of,
                                           int a_plane, uint64_t* bars, During during, After after) {
  // Split K over ring chunks of an even kSub: both warpgroups release each
  // ring chunk in the same iteration, which release's block barrier (a
  // stream without `done`) needs.
  static_assert(!kSplitK || kSub == 1 || kSub % 2 == 0, "split K takes an even kSub");
  const int wgi = int(threadIdx.x) / 128;
  // The index in [q, q + count) of this warpgroup's k-th chunk.
  auto chunk = [&](int k) { return kSplitK ? 2 * k + wgi : k; };
  if (kSplitK) count /= 2;
  float part0[N / 2], part1[N / 2];
  // This warpgroup's k-th chunk (its products in `cur`) completes and is
  // added while its (k + 1)-th chunk's products are in flight.
  auto finish = [&](float (&cur)[N / 2], int k, bool more) {
    const int c = chunk(k);
    during(c);
    if (more) {
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
#pragma unroll
    for (int i = 0; i < N / 2; ++i) sum[i] += cur[i];
    if (c % kSub + (kSplitK ? 2 : 1) >= kSub) {  // this warpgroup's last K chunk of its ring chunk
      if (kSplitK && kSub == 1) {
        st.release_own(q + c, bars);  // a ring chunk only this warpgroup reads
      } else {
        st.release(q + c / kSub, bars);
      }
    }
    after(c);
  };
  auto start = [&](float (&acc)[N / 2], int k) {
    const int c = chunk(k);
    chunk_products<N, kSplitK>(acc, st, q + c / kSub, a_of(c), a_plane, bars, c % kSub);
  };
  start(part0, 0);
  int k = 0;
  for (; k + 2 < count; k += 2) {
    start(part1, k + 1);
    finish(part0, k, true);
    start(part0, k + 2);
    finish(part1, k + 1, true);
  }
  if (k + 1 < count) {
    start(part1, k + 1);
    finish(part0, k, true);
    finish(part1, k + 1, false);
  } else {
    finish(part0, k, false);
  }
}

// add_chunks for A operands kS k-steps apart from a (a layer's K in order).
template <int N, int kSub = 1>
__device__ __forceinline__ void add_chunks(float (&sum)[N / 2], const ChunkStream& st, int q, int count,
                                           const float* a, int a_plane, uint64_t* bars) {
  add_chunks<N, false, kSub>(
      sum, st, q, count, [a](int c) { return a + c * (kS * kBlock); }, a_plane, bars, [](int) {}, [](int) {});
}

// The row and column, within its warpgroup's 64 x N tile, of a thread's
// accumulator acc[i]: tile i / 4, row g + 8 ((i / 2) % 2) of its warp (g =
// lane / 4), column 2 (lane % 4) + i % 2 of the tile.  for_each_pair and
// map_columns walk the same layout.
__device__ __forceinline__ int acc_row(int i) {
  return 16 * (int(threadIdx.x) / 32 % 4) + int(threadIdx.x) % kWarpSize / 4 + 8 * ((i / 2) % 2);
}
__device__ __forceinline__ int acc_col(int i) { return 8 * (i / 4) + 2 * (int(threadIdx.x) % 4) + i % 2; }

// Calls f(row, h, col, v0, v1) for the column pairs (col, col + 1) of this
// thread's accumulators: tile j, rows g + 8 h (h = 0, 1) of its warp.
template <int N, typename F>
__device__ __forceinline__ void for_each_pair(const float (&acc)[N / 2], F f) {
  const int lane = threadIdx.x % kWarpSize, r = 16 * (int(threadIdx.x) / 32 % 4) + lane / 4;
  const int c = 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    f(r, 0, 8 * j + c, acc[4 * j], acc[4 * j + 1]);
    f(r + 8, 1, 8 * j + c, acc[4 * j + 2], acc[4 * j + 3]);
  }
}

// acc[i] = f(column, acc[i]) for this thread's accumulators (the columns of
// for_each_pair), in place.
template <int N, typename F>
__device__ __forceinline__ void map_columns(float (&acc)[N / 2], F f) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = f(acc_col(i), acc[i]);
}

// The pair (v0, v1) at (r, k), k even, of a 64-row A operand, split: its
// offset in floats in the big plane (the small plane's copy is a plane
// further) and the two halves.
struct SplitPair {
  int at;
  float2 big, small;
};
__device__ __forceinline__ SplitPair split_pair(int r, int k, float v0, float v1) {
  const SplitTf32 s0 = split_tf32(v0), s1 = split_tf32(v1);
  return {(k / 8) * kBlock + core_offset(r, k % 8), make_float2(__uint_as_float(s0.big), __uint_as_float(s1.big)),
          make_float2(__uint_as_float(s0.small), __uint_as_float(s1.small))};
}

// Stores a split pair into the A operand whose big plane is at p (its small
// plane `plane` further).
__device__ __forceinline__ void store_split(float* p, int plane, const SplitPair& s) {
  *reinterpret_cast<float2*>(p + s.at) = s.big;
  *reinterpret_cast<float2*>(p + s.at + plane) = s.small;
}

// Stores the split pair (v0, v1) at (r, k), k even, of a 64-row A operand
// (big plane at p, small plane `plane` further).
__device__ __forceinline__ void store_split_pair(float* p, int plane, int r, int k, float v0, float v1) {
  store_split(p, plane, split_pair(r, k, v0, v1));
}

#endif  // FUSED_OPS_WGMMA

}  // namespace wgs
}  // namespace cuda
}  // namespace fused_ops
