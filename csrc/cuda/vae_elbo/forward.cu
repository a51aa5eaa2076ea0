// CUDA kernels of fused_ops::vae_elbo.
//
// Paths, chosen at run time from dtype, sizes and the device (vae_elbo_cuda):
//
// cluster  float32, compute capability >= 9.0, B < kTiledMinBatch (or the tiled
//          path does not apply) and a 16-row tile's activations fit in shared
//          memory (kRows * (I + 2H + 3L) floats plus scratch <= kMaxClusterSmem;
//          784-256-32 needs ~94 KB).  ONE launch.  Each
//          thread-block cluster owns kRows samples (16 CTAs when every
//          tile's cluster can have SMs of its own -- B <= 112 on an H200 --
//          else 8: cluster_size_for says why); every layer is
//          split across the cluster's CTAs by neurons, and each CTA pushes
//          its slice of the activations the next layer needs in full (h, z,
//          the decoder hidden layer) into the other CTAs' shared memory
//          (asynchronous distributed-shared-memory stores, st.async, each
//          completing its bytes on an mbarrier of the destination, which
//          waits for its copy only: no cluster barrier per layer; 24.0 us
//          at the default against 25.3 us with one, ninth session's run
//          3).  x stays in shared memory for the BCE, the decoder logits
//          never leave registers.  Weights are read straight from global
//          memory (each weight once per CTA), as float4 when I, H, L are
//          multiples of 4 and the pointers are 16-byte aligned (software-
//          pipelined, one CTA per SM, when all clusters are resident at once;
//          two CTAs per SM otherwise), element by element otherwise.
//          Launched with programmatic dependent launch (dependent_launch.cuh):
//          a call's kernel may start on the SMs the previous one leaves idle
//          and waits for it before its first global-memory access (B=128:
//          20.47 -> 19.66 us per call in CUDA graphs, sixteenth session's
//          run 5).  Hit by the default size (B=128, 784-256-32: kernel
//          ~20.5 us) and every float32 test size below 2048 rows.
// wgmma    float32, compute capability 9.0 with the sm_90a code built
//          (FUSED_OPS_SM90A, setup.py), B >= kTiledMinBatch (2048), H == 256,
//          L <= 32, any I.  The tiled path's design on Hopper's warpgroup
//          products: a packing launch, then one CTA per 64 samples whose two
//          warpgroups read both operands from shared memory, the weights
//          brought by bulk copies (the "wgmma path" section).  Hit by B=8192
//          at 784-256-32: 137 us against the tiled kernel's 185-193.
// tiled    float32, compute capability >= 8.0, B >= kTiledMinBatch (2048),
//          H % 8 == 0, H <= 256 and the tile's activations fit in the
//          device's shared memory (at H = 256 on an H200: L <= 72).  A packing launch for the weights, then one
//          launch of one CTA per 64 samples running the
//          whole pass on chip with 3xTF32 tensor-core products (see the
//          section below).  Hit by float32 sizes with B >= 2048 and H % 8 ==
//          0 that the wgmma path does not take (sm_80, H != 256, L > 32).
// general  everything else: float64, pre-sm_80 GPUs, sizes whose activations do
//          not fit in shared memory.  One block per sample, activations in a
//          global workspace, warp-per-neuron dot products.  Hit by float64 and
//          e.g. (B=64, I=4000, H=1500, L=40) in float32.
//
// Every reduction has a fixed order (butterfly shuffles, warps in order, CTAs
// in rank order), no atomics: results are bitwise reproducible.
//
// Numerics follow PyTorch: p = 1 / (1 + exp(-a)) with accurate expf (the
// build uses no fast math) and BCE = (x - 1) * max(log1p(-p), -100)
// - x * max(log(p), -100), the clamp PyTorch's binary_cross_entropy applies;
// each term from one exp and one log (common/bce.h says how float32 p's
// saturation and rounding are kept).

#include <cooperative_groups.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <array>
#include <climits>
#include <utility>
#include <tuple>
#include <type_traits>

#include "common/bce.h"
#include "cuda/primitives/dependent_launch.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/reductions.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/tf32x3.cuh"
#include "cuda/primitives/wgmma_stream.cuh"
#include "vae_elbo.h"

namespace fused_ops {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / cuda::kWarpSize;
constexpr int kRows = 16;  // samples per cluster tile (the reduction below assumes 16)
constexpr int kMaxCluster = 16;  // CTAs per cluster: 16 where the GPU allows it, else 8
[[maybe_unused]] constexpr int kNB = 4;     // neurons per warp pass (an even number: reduced in pairs)
constexpr size_t kMaxClusterSmem = 200 * 1024;
constexpr int64_t kTiledMinBatch = 2048;

template <typename T>
struct Args {
  const T *x, *eps, *w_enc, *b_enc, *w_mu, *b_mu, *w_lv, *b_lv, *w_d1, *b_d1, *w_d2, *b_d2;
  int B, I, H, L;
  T *elbo, *recon, *kl;
};

// A row's three outputs from its BCE sum and its sum of KL terms
// (kl = -0.5 * sum), as every kernel writes them.
template <typename T, typename Row>
__device__ __forceinline__ void store_losses(const Args<T>& a, Row row, T recon, T kl_sum) {
  const T kl = T(-0.5) * kl_sum;
  a.recon[row] = recon;
  a.kl[row] = kl;
  a.elbo[row] = -(recon + kl);
}

template <typename T>
__device__ __forceinline__ T relu(T v) {
  return v < T(0) ? T(0) : v;  // relu(NaN) = NaN
}

// [begin, end) of part p when n items are cut into `parts` contiguous slices.
struct Slice {
  int begin, end;
};
[[maybe_unused]] __host__ __device__ __forceinline__ Slice slice_of(int n, int parts, int p) {
  const int per = (n + parts - 1) / parts;
  const int b = min(n, p * per);
  return {b, min(n, b + per)};
}

// ---------------------------------------------------------------------------
// cluster path
// ---------------------------------------------------------------------------

// Sums a[r] and b[r] (r < 16) over the 32 lanes of the warp: afterwards lane l
// holds the total of (l & 1 ? b : a)[l >> 1].  A reduce-scatter (each step
// halves the values a lane keeps) costs 2 * (8 + 4 + 2 + 1) + 1 shuffles
// instead of 2 * 16 * 5 for two full butterflies; the order is fixed.
// One reduce-scatter step: lanes whose `offset` bit (offset = 2 * HALF) is set
// keep the upper HALF values, the others the lower HALF, each plus its
// partner's copy of them.
template <int HALF>
__device__ __forceinline__ void reduce_step(float (&a)[kRows], float (&b)[kRows], int lane) {
  constexpr int offset = 2 * HALF;
  const bool up = lane & offset;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float sa = up ? a[i] : a[i + HALF], ka = up ? a[i + HALF] : a[i];
    const float sb = up ? b[i] : b[i + HALF], kb = up ? b[i + HALF] : b[i];
    a[i] = ka + __shfl_xor_sync(cuda::kFullMask, sa, offset);
    b[i] = kb + __shfl_xor_sync(cuda::kFullMask, sb, offset);
  }
}

[[maybe_unused]] __device__ __forceinline__ float reduce_pair(float (&a)[kRows], float (&b)[kRows], int lane) {
  static_assert(kRows == 16, "the reduce-scatter below is written for 16 rows");
  reduce_step<8>(a, b, lane);  // offset 16
  reduce_step<4>(a, b, lane);  // offset 8
  reduce_step<2>(a, b, lane);  // offset 4
  reduce_step<1>(a, b, lane);  // offset 2
  // Now a[0] / b[0] hold row (lane >> 1): bits 4..1 of the lane chose the halves.
  const bool odd = lane & 1;
  const float send = odd ? a[0] : b[0], keep = odd ? b[0] : a[0];
  return keep + __shfl_xor_sync(cuda::kFullMask, send, 1);
}

// acc[j][r] += the dot product of float4 column k of row r of `in` (row
// stride K floats) with wv[j].
__device__ __forceinline__ void fma_column4(float (&acc)[kNB][kRows], const float4 (&wv)[kNB],
                                            const float* in, int K, int k) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float4 xv = reinterpret_cast<const float4*>(in + r * K)[k];
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      float s = acc[j][r];
      s = fmaf(wv[j].x, xv.x, s);
      s = fmaf(wv[j].y, xv.y, s);
      s = fmaf(wv[j].z, xv.z, s);
      acc[j][r] = fmaf(wv[j].w, xv.w, s);
    }
  }
}

// Dot products of the kRows rows of `in` (shared memory, row stride K) with
// the kNB weight rows row(g + j), j < kNB, over the float4 columns [k0, k1)
// (VEC; element columns otherwise) split among the lanes, so a warp reads each
// weight row once, coalesced, and applies it to all rows.  Afterwards lane l
// holds out[j / 2] = the dot product of row l >> 1 with weight row
// g + j + (l & 1), for j = 0, 2, ... (rows past `count` read a valid row; the
// caller drops their results).  PREFETCH (VEC only): software-pipelined,
// ~230 registers instead of 128 (one CTA per SM).
template <bool VEC, bool PREFETCH, typename RowFn>
__device__ __forceinline__ void warp_dots(const float* in, int K, int k0, int k1, int g, int count,
                                          RowFn row, float (&out)[kNB / 2]) {
  const int lane = threadIdx.x % cuda::kWarpSize;
  float acc[kNB][kRows];
#pragma unroll
  for (int j = 0; j < kNB; ++j)
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[j][r] = 0.0f;
  const float* w[kNB];
#pragma unroll
  for (int j = 0; j < kNB; ++j) w[j] = row(min(g + j, count - 1));
  if constexpr (VEC && PREFETCH) {
    // The next column's weights are requested before this column's
    // products, so a warp waits for an L2 round trip once per call instead
    // of once per column: at 784-256-32 the encoder's lanes run 6-7 columns
    // each, and these loads were its critical path.
    float4 wv[kNB];
    int k = k0 + lane;
    if (k < k1) {
#pragma unroll
      for (int j = 0; j < kNB; ++j) wv[j] = __ldg(reinterpret_cast<const float4*>(w[j]) + k);
    }
#pragma unroll 1
    for (; k < k1; k += cuda::kWarpSize) {
      const int next = min(k + cuda::kWarpSize, k1 - 1);  // the last column reloads itself: in range
      float4 wn[kNB];
#pragma unroll
      for (int j = 0; j < kNB; ++j) wn[j] = __ldg(reinterpret_cast<const float4*>(w[j]) + next);
      fma_column4(acc, wv, in, K, k);
#pragma unroll
      for (int j = 0; j < kNB; ++j) wv[j] = wn[j];
    }
  } else if constexpr (VEC) {
    // Not unrolled: unrolling doubles the registers (~250), one CTA per SM
    // instead of two, and a GPC could then hold only one 16-CTA cluster.
#pragma unroll 1
    for (int k = k0 + lane; k < k1; k += cuda::kWarpSize) {
      float4 wv[kNB];
#pragma unroll
      for (int j = 0; j < kNB; ++j) wv[j] = __ldg(reinterpret_cast<const float4*>(w[j]) + k);
      fma_column4(acc, wv, in, K, k);
    }
  } else {
#pragma unroll 2
    for (int k = k0 + lane; k < k1; k += cuda::kWarpSize) {
      float wv[kNB];
#pragma unroll
      for (int j = 0; j < kNB; ++j) wv[j] = __ldg(w[j] + k);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float xv = in[r * K + k];
#pragma unroll
        for (int j = 0; j < kNB; ++j) acc[j][r] = fmaf(wv[j], xv, acc[j][r]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kNB; j += 2) out[j / 2] = reduce_pair(acc[j], acc[j + 1], lane);
}

// out(r, n) = dot(in[r, 0:K], row(n)[0:K]) for the kRows rows of `in` and
// local neurons n < count, handed to epi(r, n, v) by the lane that holds it
// (lane (r << 1) | (n & 1) of some warp: the decoder's BCE sums rely on it).
// Warps take kNB neurons at a time over the whole of K.
template <bool VEC, bool PREFETCH, typename RowFn, typename Epi>
__device__ __forceinline__ void warp_linear(const float* in, int K, int count, RowFn row, Epi epi) {
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int kcols = VEC ? K / 4 : K;
  for (int g = warp * kNB; g < count; g += kWarps * kNB) {
    float v[kNB / 2];
    warp_dots<VEC, PREFETCH>(in, K, 0, kcols, g, count, row, v);
#pragma unroll
    for (int j = 0; j < kNB; j += 2) {
      const int n = g + j + (lane & 1);
      if (n < count) epi(lane >> 1, n, v[j / 2]);
    }
  }
}

// The same product for layers with fewer than kWarps * kNB neurons per CTA
// (the encoder's 16, mu/logvar's 4, the decoder's first layer's 16 at
// 784-256-32 in 16-CTA clusters): warp_linear would leave warps idle while
// the others run the whole of K.  Here the neuron groups' K is cut into
// `split` segments, one warp each; the segments' sums meet in `partial`
// (split * kRows * count floats) and are added in segment order (fixed:
// bitwise reproducible), then epi(r, n, v) runs on any thread.  Contains a
// block barrier (unless there are kWarps groups or more, when it is
// warp_linear): every thread of the CTA must call it.
template <bool VEC, bool PREFETCH, typename RowFn, typename Epi>
__device__ __forceinline__ void split_linear(const float* in, int K, int count, RowFn row, Epi epi,
                                             float* partial) {
  const int groups = (count + kNB - 1) / kNB;
  if (groups >= kWarps) {  // enough neuron groups to keep every warp busy
    warp_linear<VEC, PREFETCH>(in, K, count, row, epi);
    return;
  }
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int split = kWarps / max(groups, 1);
  const int kcols = VEC ? K / 4 : K;
  const int seg = (kcols + split - 1) / split;
  if (warp < groups * split) {
    const int g = (warp / split) * kNB, s = warp % split;
    float v[kNB / 2];
    warp_dots<VEC, PREFETCH>(in, K, min(kcols, s * seg), min(kcols, (s + 1) * seg), g, count, row, v);
#pragma unroll
    for (int j = 0; j < kNB; j += 2) {
      const int n = g + j + (lane & 1);
      if (n < count) partial[(s * kRows + (lane >> 1)) * count + n] = v[j / 2];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * count; idx += kThreads) {
    float v = 0.0f;
    for (int s = 0; s < split; ++s) v += partial[s * kRows * count + idx];
    epi(idx / count, idx % count, v);
  }
}

// Shared-memory layout of the cluster kernel, in floats (each array a
// multiple of 4 floats so float4 rows stay 16-byte aligned).  `partial` is
// split_linear's scratch; rall / klall collect every CTA's per-row partial
// sums of the BCE and KL terms in rank 0 (pushed there; kMaxCluster ranks);
// `bars` holds one mbarrier (8 bytes) per exchange (ClusterExchange).
enum ClusterExchange { kExH, kExZ, kExG, kExSums, kNumExchanges };
struct ClusterLayout {
  int xs, hs, zs, gs, mu, lv, klpart, wpart, partial, rall, klall, bars, total;
  __host__ __device__ ClusterLayout(int I, int H, int L) {
    auto up4 = [](int n) { return (n + 3) / 4 * 4; };
    xs = 0;
    hs = xs + up4(kRows * I);
    zs = hs + up4(kRows * H);
    gs = zs + up4(kRows * L);
    mu = gs + up4(kRows * H);
    lv = mu + up4(kRows * L);
    klpart = lv + up4(kRows * L);
    wpart = klpart + kRows;
    partial = wpart + kWarps * kRows;
    rall = partial + kWarps * kNB * kRows;
    klall = rall + kMaxCluster * kRows;
    bars = klall + kMaxCluster * kRows;
    total = bars + 2 * kNumExchanges;
  }
};

// Bytes the other CTAs of the cluster push into this one's copy of a
// [kRows, N] buffer when this CTA owns the columns s: everything else.
[[maybe_unused]] __device__ __forceinline__ uint32_t exchange_bytes(int N, Slice s) {
  return uint32_t(kRows) * uint32_t(N - (s.end - s.begin)) * uint32_t(sizeof(float));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Pushes this CTA's columns [s.begin, s.end) of buf [kRows, N] (row stride N)
// into the other CTAs' copies of buf by st.async (cuda/mbarrier.cuh), as
// float4 runs where the columns allow (distributed shared memory traffic is
// per transaction: one float4 store costs about what one float store does;
// flow_euler.cu measures it); each store completes its bytes on the
// destination's copy of `bar`, whose phase expects exchange_bytes, so a CTA
// waits only until its copy is complete -- no cluster barrier.  Stores need
// no reply, so a push costs the issue of the stores, where gathering the
// slices with remote loads waited on each load's round trip (run 1 of the
// seventh session: ~16% of the kernel's stall samples).
__device__ __forceinline__ void push_slice(float* buf, int N, Slice s, int C, int rank, uint64_t* bar) {
  const int n = s.end - s.begin;
  if (n <= 0) return;
  float* const src = buf + s.begin;
  if (N % 4 == 0 && s.begin % 4 == 0 && n % 4 == 0) {
    const int n4 = n / 4, per_dst = kRows * n4;
    for (int idx = threadIdx.x; idx < (C - 1) * per_dst; idx += kThreads) {
      const int d = idx / per_dst, rest = idx - d * per_dst;
      const int r = rest / n4, q = rest - r * n4;
      const int dst = d + (d >= rank);
      float4* const p = reinterpret_cast<float4*>(src + r * N) + q;
      cuda::st_async(p, *p, bar, dst);
    }
  } else {
    const int per_dst = kRows * n;
    for (int idx = threadIdx.x; idx < (C - 1) * per_dst; idx += kThreads) {
      const int d = idx / per_dst, rest = idx - d * per_dst;
      const int r = rest / n, q = rest - r * n;
      const int dst = d + (d >= rank);
      float* const p = src + r * N + q;
      cuda::st_async(p, *p, bar, dst);
    }
  }
}
#endif

template <bool VEC, bool PREFETCH>
__global__ void __launch_bounds__(kThreads) vae_elbo_cluster_kernel(const Args<float> a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) float smem[];
  // The next call's kernel may start launching now (it waits for this one
  // before touching global memory): at B=128 it finds 68 idle SMs.
  cuda::launch_dependents();
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int row0 = int(blockIdx.x / unsigned(C)) * kRows;
  const int I = a.I, H = a.H, L = a.L;
  const ClusterLayout lay(I, H, L);
  float* xs = smem + lay.xs;
  float* hs = smem + lay.hs;
  float* zs = smem + lay.zs;
  float* gs = smem + lay.gs;
  float* mus = smem + lay.mu;
  float* lvs = smem + lay.lv;
  float* klpart = smem + lay.klpart;
  float* wpart = smem + lay.wpart;
  float* partial = smem + lay.partial;
  float* rall = smem + lay.rall;
  float* klall = smem + lay.klall;
  const int rows = min(kRows, a.B - row0);
  const Slice sh = slice_of(H, C, rank), sl = slice_of(L, C, rank);
  // One mbarrier per exchange, used once (parity 0): its one arrival,
  // here, declares the bytes the other CTAs will push into this one.  Only
  // rank 0 receives row sums.
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + lay.bars);
  const int exchanges = rank == 0 ? kNumExchanges : kExSums;
  if (threadIdx.x == 0) {
    for (int e = 0; e < exchanges; ++e) cuda::mbarrier_init(bars + e, 1);
    cuda::mbarrier_init_fence();
    cuda::mbarrier_arrive_expect_tx(bars + kExH, exchange_bytes(H, sh));
    cuda::mbarrier_arrive_expect_tx(bars + kExZ, exchange_bytes(L, sl));
    cuda::mbarrier_arrive_expect_tx(bars + kExG, exchange_bytes(H, sh));
    if (rank == 0) {
      cuda::mbarrier_arrive_expect_tx(bars + kExSums, uint32_t(2 * (C - 1) * kRows * sizeof(float)));
    }
  }
  // "This CTA runs" (and its mbarriers are initialised): no CTA may store
  // into another's shared memory before that one has started.  Waited for
  // just before the first push, so the barrier's latency hides behind the x
  // load and the encoder.
  auto started = cluster.barrier_arrive();
  // Launched overlapping the previous kernel in the stream: everything
  // above touched shared memory only; from here on, global memory.
  cuda::wait_prior_grids();

  // x tile; rows past the batch are zero (their results are never stored).
  if constexpr (VEC) {
    const int I4 = I / 4;
    for (int idx = threadIdx.x; idx < kRows * I4; idx += kThreads) {
      const int r = idx / I4;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r < rows) v = __ldg(reinterpret_cast<const float4*>(a.x + size_t(row0) * I) + idx);
      reinterpret_cast<float4*>(xs)[idx] = v;
    }
  } else {
    for (int idx = threadIdx.x; idx < kRows * I; idx += kThreads) {
      xs[idx] = idx / I < rows ? __ldg(a.x + size_t(row0) * I + idx) : 0.0f;
    }
  }
  __syncthreads();

  // 1. h = relu(x W_enc^T + b_enc), this CTA's slice of H, pushed to all.
  split_linear<VEC, PREFETCH>(
      xs, I, sh.end - sh.begin, [&](int n) { return a.w_enc + size_t(sh.begin + n) * I; },
      [&](int r, int n, float v) { hs[r * H + sh.begin + n] = relu(v + __ldg(a.b_enc + sh.begin + n)); },
      partial);
  __syncthreads();
  cluster.barrier_wait(std::move(started));
  push_slice(hs, H, sh, C, rank, bars + kExH);
  cuda::mbarrier_wait(bars + kExH, 0);  // (the own slice: the block barrier above)

  // 2. mu and logvar for this CTA's slice of L (mu rows first, then logvar
  //    rows, as one list of neurons), then z (pushed to all) and the KL terms.
  const int nl = sl.end - sl.begin;
  split_linear<VEC, PREFETCH>(
      hs, H, 2 * nl,
      [&](int n) {
        return n < nl ? a.w_mu + size_t(sl.begin + n) * H : a.w_lv + size_t(sl.begin + n - nl) * H;
      },
      [&](int r, int n, float v) {
        if (n < nl) {
          mus[r * L + sl.begin + n] = v + __ldg(a.b_mu + sl.begin + n);
        } else {
          lvs[r * L + sl.begin + n - nl] = v + __ldg(a.b_lv + sl.begin + n - nl);
        }
      },
      partial);
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * nl; idx += kThreads) {
    const int r = idx / nl, l = sl.begin + idx % nl;
    const float mu = mus[r * L + l], lv = lvs[r * L + l];
    const float e = r < rows ? __ldg(a.eps + size_t(row0 + r) * L + l) : 0.0f;
    zs[r * L + l] = mu + expf(0.5f * lv) * e;
    mus[r * L + l] = ((1.0f + lv) - mu * mu) - expf(lv);  // KL term, in the reference's order
  }
  __syncthreads();
  if (threadIdx.x < kRows) {
    float s = 0.0f;
    for (int l = sl.begin; l < sl.end; ++l) s += mus[threadIdx.x * L + l];
    klpart[threadIdx.x] = s;
  }
  push_slice(zs, L, sl, C, rank, bars + kExZ);
  cuda::mbarrier_wait(bars + kExZ, 0);

  // 3. Decoder hidden layer g = relu(z W_dec1^T + b_dec1), this CTA's slice
  //    of H, pushed to all.
  split_linear<VEC, PREFETCH>(
      zs, L, sh.end - sh.begin, [&](int n) { return a.w_d1 + size_t(sh.begin + n) * L; },
      [&](int r, int n, float v) { gs[r * H + sh.begin + n] = relu(v + __ldg(a.b_d1 + sh.begin + n)); },
      partial);
  __syncthreads();
  push_slice(gs, H, sh, C, rank, bars + kExG);
  cuda::mbarrier_wait(bars + kExG, 0);

  // 4. Decoder logits for this CTA's slice of I, straight into the BCE sums.
  //    Each lane sums the terms of its row (lane >> 1) in a fixed order.
  const Slice si = slice_of(I, C, rank);
  float racc = 0.0f;
  warp_linear<VEC, PREFETCH>(
      gs, H, si.end - si.begin, [&](int n) { return a.w_d2 + size_t(si.begin + n) * H; },
      [&](int r, int n, float v) {
        const int i = si.begin + n;
        racc += bce_term(v + __ldg(a.b_d2 + i), xs[r * I + i]);
      });
  {
    const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
    const float tot = racc + __shfl_xor_sync(cuda::kFullMask, racc, 1);
    if ((lane & 1) == 0) wpart[warp * kRows + (lane >> 1)] = tot;
  }
  __syncthreads();
  // This CTA's per-row sums, pushed into rank 0's rall / klall at this
  // rank's row (rank 0's own by the thread that later reads them).
  if (threadIdx.x < kRows) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += wpart[w * kRows + threadIdx.x];
    float* const r_dst = rall + rank * kRows + threadIdx.x;
    float* const kl_dst = klall + rank * kRows + threadIdx.x;
    if (rank == 0) {
      *r_dst = s;
      *kl_dst = klpart[threadIdx.x];
    } else {
      cuda::st_async(r_dst, s, bars + kExSums, 0);
      cuda::st_async(kl_dst, klpart[threadIdx.x], bars + kExSums, 0);
    }
  }
  // Every CTA has waited for all stores into it (rank 0: just below), but
  // none may leave while another could still touch its shared memory:
  // arrive now, wait at the very end (by then all have arrived).
  auto finished = cluster.barrier_arrive();

  // 5. Rank 0 adds the CTAs' partial row sums in rank order.
  if (rank == 0 && int(threadIdx.x) < rows) {
    cuda::mbarrier_wait(bars + kExSums, 0);
    float recon = 0.0f, kl_sum = 0.0f;
    for (int p = 0; p < C; ++p) {
      recon += rall[p * kRows + threadIdx.x];
      kl_sum += klall[p * kRows + threadIdx.x];
    }
    store_losses(a, row0 + int(threadIdx.x), recon, kl_sum);
  }
  cluster.barrier_wait(std::move(finished));
#else
  __trap();  // launched only on compute capability >= 9.0
#endif
}

// ---------------------------------------------------------------------------
// general path
// ---------------------------------------------------------------------------

// One block per sample; ws row: h [H] | z [L] | kl terms [L] | g [H].
template <typename T>
__global__ void __launch_bounds__(kThreads) vae_elbo_general_kernel(const Args<T> a, T* ws) {
  __shared__ T scratch[kWarps];
  const int I = a.I, H = a.H, L = a.L;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int64_t row = blockIdx.x;
  const T* x = a.x + row * I;
  T* h = ws + row * (2 * int64_t(H) + 2 * L);
  T* z = h + H;
  T* terms = z + L;
  T* g = terms + L;
  auto dot = [&](const T* in, const T* w, int K) {
    T s = T(0);
    for (int k = lane; k < K; k += cuda::kWarpSize) s += in[k] * w[k];
    return cuda::group_allreduce(s, cuda::kWarpSize);
  };
  for (int n = warp; n < H; n += kWarps) {
    const T v = relu(dot(x, a.w_enc + int64_t(n) * I, I) + a.b_enc[n]);
    if (lane == 0) h[n] = v;
  }
  __syncthreads();
  for (int l = warp; l < L; l += kWarps) {
    const T mu = dot(h, a.w_mu + int64_t(l) * H, H) + a.b_mu[l];
    const T lv = dot(h, a.w_lv + int64_t(l) * H, H) + a.b_lv[l];
    if (lane == 0) {
      z[l] = mu + exp(T(0.5) * lv) * a.eps[row * L + l];
      terms[l] = ((T(1) + lv) - mu * mu) - exp(lv);
    }
  }
  __syncthreads();
  for (int n = warp; n < H; n += kWarps) {
    const T v = relu(dot(z, a.w_d1 + int64_t(n) * L, L) + a.b_d1[n]);
    if (lane == 0) g[n] = v;
  }
  __syncthreads();
  T part = T(0);  // lane 0 of each warp: its neurons' BCE terms, in order
  for (int i = warp; i < I; i += kWarps) {
    const T v = dot(g, a.w_d2 + int64_t(i) * H, H) + a.b_d2[i];
    if (lane == 0) part += bce_term(v, x[i]);
  }
  const T recon = cuda::block_allreduce(part, scratch);
  if (threadIdx.x == 0) {
    T kl_sum = T(0);
    for (int l = 0; l < L; ++l) kl_sum += terms[l];
    store_losses(a, row, recon, kl_sum);
  }
}

// ---------------------------------------------------------------------------
// tiled path (large batch)
// ---------------------------------------------------------------------------
//
// One CTA per kTileRows = 64 samples runs the whole forward pass on chip:
// encoder (x streamed through shared memory in kChunk-wide column chunks),
// mu / logvar, z and KL, decoder hidden layer, then the decoder logits in
// 256-column passes whose BCE terms go straight into per-row sums.  Every
// product is a 3xTF32 tensor-core product (cuda/tf32x3.cuh) with float32
// accumulation: float32 accuracy at tensor-core speed.
//
// Operands are split into their TF32 big and small parts once, not at every
// use (ncu on the previous version, run V: ~88% of the issued instructions
// were not mma; by our count of the source most were the splits' conversions,
// repeated by each of the 8 warps reading the same A values):
// - A operands (x chunks, h, z, the decoder hidden layer) are stored split
//   in shared memory when they are produced (cuda::SplitRows, two planes)
//   and read with ldmatrix, two instructions per 16x8 fragment;
// - B operands (the weights) are packed split once per call
//   (cuda::pack_b_fragments with split: one 16-byte load per fragment, 512
//   contiguous bytes per warp) and stream from L2 kDepth - 1 k-steps ahead
//   of their use, in registers (each warp owns its output columns, so no
//   other warp reads them: nothing to share through shared memory).
// I and L may be anything (zero padding to whole k-steps on both sides);
// H % 8 == 0 and H <= 256 (8 warps x 32 columns cover the hidden layer).
// 8192 samples make 128 CTAs: one wave on an H100/H200.

constexpr int kTileRows = 64;
constexpr int kChunk = 32;            // x columns staged per encoder chunk
constexpr int kDepth = kChunk / 8;    // B fragments in flight per warp: a chunk's k-steps
constexpr int kMT = kTileRows / 16;
static_assert(kTileRows * kChunk % kThreads == 0, "x chunks split evenly over the threads");

// Shared memory of the tiled kernel, in floats.  Row strides are 4 mod 8
// floats (odd multiples of 16 bytes: conflict-free ldmatrix); each A
// operand has a big and a small plane.
struct TiledLayout {
  int Lp, ldx, ldh, ldz, ldm, xs, hs, zs, ms, klrow, wpart, total;
  __host__ __device__ TiledLayout(int H, int L) {
    Lp = (L + 7) / 8 * 8;
    ldx = kChunk + 4;
    ldh = H + 4;
    ldz = Lp + 4;
    ldm = 2 * Lp + 4;
    xs = 0;
    hs = xs + 2 * kTileRows * ldx;
    zs = hs + 2 * kTileRows * ldh;
    ms = zs + 2 * kTileRows * ldz;
    klrow = ms + kTileRows * ldm;
    wpart = klrow + kTileRows;
    total = wpart + kWarps * kTileRows;
  }
};

// A weight packed split in mma B-fragment order (cuda::pack_b_fragments, one
// pass): the fragments of k-step s, n8-tile T at frag[(s * tiles + T) * 32 + lane],
// for s < ksteps + kDepth - 1 (the last kDepth - 1 k-steps zero).
struct PackedWeight {
  const float4* frag;
  int tiles, ksteps;  // ceil(N / 8), ceil(K / 8)
};

// The five weights of the tiled kernel, packed once per call.
struct TiledWeights {
  PackedWeight enc, mu, lv, d1, d2;
};

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[kMT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
}

// acc[mt][nt] += A[rows mt*16.., 8 s..) * W[8 (tile0 + nt).., 8 s..)^T over
// k-steps s < ksteps, for the 64 rows of the split A (shared, zero in the
// padded columns) and the packed weight W (tiles past W.tiles read as zero).
// With CHUNKED, A holds only the current kChunk columns and
// before_chunk(c) runs (in every thread of the CTA: it may hold barriers)
// before k-step c * kDepth, to stage them; otherwise A holds all columns.
// The B ring runs across chunk boundaries, so the weights' L2 latency is
// hidden there too.  A warp whose tiles are all past W.tiles only takes part
// in before_chunk.
template <int NT, bool CHUNKED, typename ChunkFn>
__device__ __forceinline__ void mma_rows64(float (&acc)[kMT][NT][4], const cuda::SplitRows A,
                                           const PackedWeight W, int tile0, int ksteps,
                                           ChunkFn&& before_chunk) {
  const int lane = threadIdx.x % cuda::kWarpSize;
  const bool active = tile0 < W.tiles;  // warp-uniform
  const float* a_lane = A.big + cuda::ldmatrix_lane_offset(A.ld);
  // The packed weights hold kDepth - 1 zero k-steps past the last, so the
  // ring's look-ahead needs no bounds test; tiles past the weight's are
  // zero, tested once here.
  bool valid[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) valid[nt] = tile0 + nt < W.tiles;
  const float4* b_lane = W.frag + int64_t(tile0) * cuda::kWarpSize + lane;
  const int64_t b_step = int64_t(W.tiles) * cuda::kWarpSize;
  float4 ring[kDepth][NT];
  auto load_b = [&](float4 (&b)[NT], int s) {
    const float4* p = b_lane + s * b_step;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      b[nt] = valid[nt] ? __ldg(p + nt * cuda::kWarpSize) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
#pragma unroll
  for (int d = 0; d < kDepth - 1; ++d) load_b(ring[d], d);
  for (int s0 = 0; s0 < ksteps; s0 += kDepth) {
    if (CHUNKED) before_chunk(s0 / kDepth);
    // This chunk's kDepth k-steps into a fresh accumulator, added to acc in
    // float32 afterwards: the tensor cores' own accumulation over the whole
    // K is far less accurate (the wgmma section's "Accuracy").
    float part[kMT][NT][4];
    zero_acc(part);
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int s = s0 + d;
      if (s >= ksteps) break;  // uniform
      // Refill the slot consumed at step s - 1 with step s + kDepth - 1.
      load_b(ring[(d + kDepth - 1) % kDepth], s + kDepth - 1);
      if (!active) continue;
      uint32_t bb[NT][2], bs[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        bb[nt][0] = __float_as_uint(ring[d][nt].x);
        bb[nt][1] = __float_as_uint(ring[d][nt].y);
        bs[nt][0] = __float_as_uint(ring[d][nt].z);
        bs[nt][1] = __float_as_uint(ring[d][nt].w);
      }
      const int col = CHUNKED ? d * 8 : s * 8;
      uint32_t ab[kMT][4], as[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const float* p = a_lane + mt * 16 * A.ld + col;
        cuda::ldmatrix_x4(ab[mt], p);
        cuda::ldmatrix_x4(as[mt], p + A.plane_floats);
      }
      cuda::mma_3xtf32_tiles(part, ab, as, bb, bs);
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] += part[mt][nt][i];
  }
}

template <int NT>
__device__ __forceinline__ void mma_rows64(float (&acc)[kMT][NT][4], const cuda::SplitRows A,
                                           const PackedWeight W, int tile0, int ksteps) {
  mma_rows64<NT, false>(acc, A, W, tile0, ksteps, [](int) {});
}

// Calls f(row, col, value) for each accumulator element (fragment C layout)
// of the tiles at column n0.
template <int NT, typename F>
__device__ __forceinline__ void for_each_acc(const float (&acc)[kMT][NT][4], int n0, F f) {
  const int lane = threadIdx.x % cuda::kWarpSize, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f(mt * 16 + g + (i >= 2 ? 8 : 0), n0 + nt * 8 + 2 * t + (i & 1), acc[mt][nt][i]);
      }
}


// BCE terms of the decoder logits of one pass (tiles at tile0) into the
// per-row sums: lane (g, t) owns rows g + 8 j (j < 2 kMT), summed in a fixed
// order (passes in order, then columns in fragment order).
template <int NT>
__device__ __forceinline__ void decoder_pass(float (&rsum)[2 * kMT], const Args<float>& a,
                                             const cuda::SplitRows gs, const PackedWeight w, int tile0,
                                             int row0, int rows) {
  float acc[kMT][NT][4];
  zero_acc(acc);
  mma_rows64<NT>(acc, gs, w, tile0, w.ksteps);
  // Row r = 16 mt + g + 8 j (g = lane / 4 < 8) lands in rsum[2 mt + j] = rsum[r / 8].
  // A branch, not a select as in the wgmma kernel: with selects ptxas
  // hoisted all 64 terms' x and bias loads and spilled (176 bytes, sm_80).
  for_each_acc(acc, tile0 * 8, [&](int r, int n, float v) {
    if (n < a.I && r < rows) rsum[r / 8] += bce_term(v + __ldg(a.b_d2 + n), __ldg(a.x + size_t(row0 + r) * a.I + n));
  });
}

__global__ void __launch_bounds__(kThreads, 1) vae_elbo_tiled_kernel(const Args<float> a, const TiledWeights w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(16) float smem[];
  const int I = a.I, H = a.H, L = a.L;
  const TiledLayout lay(H, L);
  const cuda::SplitRows xs{smem + lay.xs, lay.ldx, kTileRows * lay.ldx};
  const cuda::SplitRows hs{smem + lay.hs, lay.ldh, kTileRows * lay.ldh};  // h, later the decoder hidden layer
  const cuda::SplitRows zs{smem + lay.zs, lay.ldz, kTileRows * lay.ldz};
  float* ms = smem + lay.ms;  // mu [.., 0:L) and logvar [.., Lp:Lp+L)
  float* klrow = smem + lay.klrow;
  float* wpart = smem + lay.wpart;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int row0 = blockIdx.x * kTileRows;
  const int rows = min(kTileRows, a.B - row0);
  const int tile0 = warp * 4;  // this warp's 4 n8-tiles (32 columns) of the hidden layer

  // 1. Encoder.  x chunks go through registers one chunk ahead (the global
  //    loads of chunk c + 1 are in flight while the tensor cores work on
  //    chunk c) and are split into shared memory between two barriers.
  {
    float acc[kMT][4][4];
    zero_acc(acc);
    constexpr int kPer = kTileRows * kChunk / kThreads;
    float xr[kPer];
    auto load_x = [&](int kc) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int idx = threadIdx.x + j * kThreads, r = idx / kChunk, c = idx % kChunk;
        xr[j] = (r < rows && kc + c < I) ? __ldg(a.x + size_t(row0 + r) * I + kc + c) : 0.0f;
      }
    };
    load_x(0);
    mma_rows64<4, true>(acc, xs, w.enc, tile0, w.enc.ksteps, [&](int c) {
      __syncthreads();  // the previous chunk is consumed
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int idx = threadIdx.x + j * kThreads;
        xs.store(idx / kChunk, idx % kChunk, xr[j]);
      }
      __syncthreads();
      if ((c + 1) * kChunk < I) load_x((c + 1) * kChunk);
    });
    if (tile0 * 8 < H) {
      for_each_acc(acc, tile0 * 8, [&](int r, int n, float v) {
        if (n < H) hs.store(r, n, relu(v + __ldg(a.b_enc + n)));
      });
    }
  }
  // Zero the padding columns of z (read as A operand up to Lp).
  for (int idx = threadIdx.x; idx < kTileRows * (lay.Lp - L); idx += kThreads) {
    zs.store(idx / (lay.Lp - L), L + idx % (lay.Lp - L), 0.0f);
  }
  __syncthreads();

  // 2. mu and logvar: units of one n8-tile, mu units then logvar units.
  {
    const int nt_l = lay.Lp / 8;
    for (int u = warp; u < 2 * nt_l; u += kWarps) {
      const bool is_lv = u >= nt_l;
      const int t = is_lv ? u - nt_l : u;
      float acc[kMT][1][4];
      zero_acc(acc);
      const PackedWeight wl = is_lv ? w.lv : w.mu;
      mma_rows64<1>(acc, hs, wl, t, wl.ksteps);
      const float* bias = is_lv ? a.b_lv : a.b_mu;
      for_each_acc(acc, t * 8, [&](int r, int n, float v) {
        if (n < L) ms[r * lay.ldm + (is_lv ? lay.Lp : 0) + n] = v + __ldg(bias + n);
      });
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kTileRows * L; idx += kThreads) {
    const int r = idx / L, l = idx % L;
    const float mu = ms[r * lay.ldm + l], lv = ms[r * lay.ldm + lay.Lp + l];
    const float e = r < rows ? __ldg(a.eps + size_t(row0 + r) * L + l) : 0.0f;
    zs.store(r, l, mu + expf(0.5f * lv) * e);
    ms[r * lay.ldm + l] = ((1.0f + lv) - mu * mu) - expf(lv);  // KL term
  }
  __syncthreads();
  if (threadIdx.x < kTileRows) {
    float s = 0.0f;
    for (int l = 0; l < L; ++l) s += ms[threadIdx.x * lay.ldm + l];
    klrow[threadIdx.x] = s;
  }

  // 3. Decoder hidden layer into hs (h is no longer needed: the barrier
  //    above follows the last read of h).
  {
    float acc[kMT][4][4];
    zero_acc(acc);
    mma_rows64<4>(acc, zs, w.d1, tile0, w.d1.ksteps);
    if (tile0 * 8 < H) {
      for_each_acc(acc, tile0 * 8, [&](int r, int n, float v) {
        if (n < H) hs.store(r, n, relu(v + __ldg(a.b_d1 + n)));
      });
    }
  }
  __syncthreads();

  // 4. Decoder logits into BCE row sums: passes of 4 n8-tiles per warp while
  //    more than one tile per warp is left, then one tile per warp, so the
  //    tail (784 = 3 x 256 + 16 columns) does not cost a whole pass of one
  //    busy warp.
  float rsum[2 * kMT];
#pragma unroll
  for (int j = 0; j < 2 * kMT; ++j) rsum[j] = 0.0f;
  int base = 0;
  for (; w.d2.tiles - base > kWarps; base += 4 * kWarps) {
    if (base + warp * 4 < w.d2.tiles) decoder_pass<4>(rsum, a, hs, w.d2, base + warp * 4, row0, rows);
  }
  for (; base < w.d2.tiles; base += kWarps) {
    if (base + warp < w.d2.tiles) decoder_pass<1>(rsum, a, hs, w.d2, base + warp, row0, rows);
  }
  // The four lanes of a row group (same lane / 4) hold disjoint columns.
#pragma unroll
  for (int j = 0; j < 2 * kMT; ++j) {
    float v = rsum[j];
    v += __shfl_xor_sync(cuda::kFullMask, v, 1);
    v += __shfl_xor_sync(cuda::kFullMask, v, 2);
    if (lane % 4 == 0) wpart[warp * kTileRows + (j / 2) * 16 + (j % 2) * 8 + lane / 4] = v;
  }
  __syncthreads();
  if (int(threadIdx.x) < rows) {
    float recon = 0.0f;
    for (int w = 0; w < kWarps; ++w) recon += wpart[w * kTileRows + threadIdx.x];
    store_losses(a, row0 + int(threadIdx.x), recon, klrow[threadIdx.x]);
  }
#else
  __trap();  // launched only on compute capability >= 8.0
#endif
}

// ---------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The cluster size for `kernel` with `smem` bytes per block and `tiles`
// row tiles on the current device: 16 (each CTA then holds half the weight
// slices it holds at 8) when every tile's cluster can have SMs of its own,
// else 8; 0 if neither fits.  A 16-CTA cluster takes most of a GPC, and
// the GPU has only so many that can host one with one CTA per SM (an H200:
// seven, not the eight its 132 SMs suggest); beyond that, two clusters
// share SMs and run at about half speed.  At B = 128 (eight tiles): 24.1 us
// per call in 16-CTA clusters, two of them on shared SMs, against 22.1 us
// in 8-CTA clusters (fifteenth session, run 2: CUDA graph replays, and
// per-CTA clocks that show the two slow clusters).
int cluster_size_for(void (*kernel)(const Args<float>), size_t smem, int64_t tiles) {
  const bool fits8 = cuda::cluster_fits(kernel, 8, kThreads, smem);
  if (cuda::cluster_fits(kernel, 16, kThreads, smem)) {
    // Clusters resident at once with one CTA per SM: asked with the most
    // shared memory a CTA may have, which leaves no room for a second.
    const int own_sms = cuda::max_active_clusters(kernel, 16, kThreads, cuda::max_shared_memory_per_block());
    if (tiles <= own_sms || !fits8) return 16;
  }
  return fits8 ? 8 : 0;
}

// Which cluster kernel runs a call, in clusters of how many CTAs (0: the
// cluster path does not apply), with how much shared memory.
struct ClusterPlan {
  void (*kernel)(const Args<float>) = nullptr;
  int cluster = 0;
  size_t smem = 0;
};

ClusterPlan plan_cluster(int I, int H, int L, bool vec, int64_t tiles) {
  ClusterPlan plan;
  if (cuda::compute_capability_major() < 9) return plan;
  plan.smem = size_t(ClusterLayout(I, H, L).total) * sizeof(float);
  if (plan.smem > kMaxClusterSmem || plan.smem > cuda::max_shared_memory_per_block()) return plan;
  plan.kernel = vec ? vae_elbo_cluster_kernel<true, false> : vae_elbo_cluster_kernel<false, false>;
  plan.cluster = cluster_size_for(plan.kernel, plan.smem, tiles);
  // The software-pipelined kernel when all clusters are resident at once
  // with its one CTA per SM (B <= 240 at 784-256-32 on an H200); beyond
  // that, the two-CTA-per-SM kernel keeps more of them resident.
  if (plan.cluster > 0 && vec &&
      tiles <= cuda::max_active_clusters(vae_elbo_cluster_kernel<true, true>, plan.cluster, kThreads,
                                         plan.smem)) {
    plan.kernel = vae_elbo_cluster_kernel<true, true>;
  }
  return plan;
}

// Launches the cluster path; false when it does not apply.  The plan is
// cached per (device, sizes, alignment, row tiles): working it out asks
// about six cached device facts and occupancies, each a cudaGetDevice, a
// mutex and a map search (1.1-1.9 us per call on the H200 test host,
// sixteenth session's run 1), on a path whose calls are host-bound at B=128.
bool launch_cluster(const Args<float>& a) {
  const bool vec = a.I % 4 == 0 && a.H % 4 == 0 && a.L % 4 == 0 && aligned16(a.x) &&
                   aligned16(a.w_enc) && aligned16(a.w_mu) && aligned16(a.w_lv) &&
                   aligned16(a.w_d1) && aligned16(a.w_d2);
  const int64_t tiles = (int64_t(a.B) + kRows - 1) / kRows;
  const int device = cuda::current_device();
  static cuda::Memo<std::tuple<int, int, int, int, bool, int64_t>, ClusterPlan> plans;
  const ClusterPlan plan = plans.get(std::make_tuple(device, a.I, a.H, a.L, vec, tiles),
                                     [&] { return plan_cluster(a.I, a.H, a.L, vec, tiles); });
  if (plan.cluster == 0) return false;
  cuda::ClusterLaunch launch(tiles * plan.cluster, plan.cluster, kThreads, plan.smem,
                             cuda::current_stream(device));
  launch.overlap_prior_kernel();
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, plan.kernel, a));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  return true;
}

// Launches the tiled path (weights packed first; `like` gives the
// workspace's device); false when it does not apply.
bool launch_tiled(const Args<float>& a, const Tensor& like) {
  if (cuda::compute_capability_major() < 8 || a.H % 8 != 0 || a.H > kWarps * 32) return false;
  // One CTA per SM anyway (64 rows), so up to the device's opt-in maximum:
  // at I = 784, H = 256 that is L <= 72 on an H200 (227 KB).
  const size_t smem = size_t(TiledLayout(a.H, a.L).total) * sizeof(float);
  if (smem > cuda::max_shared_memory_per_block()) return false;
  cuda::allow_dynamic_smem(vae_elbo_tiled_kernel, smem);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  auto steps = [](int k) { return (k + 7) / 8; };
  auto packed_steps = [&](int k) { return steps(k) + kDepth - 1; };  // zero k-steps for the look-ahead
  // (matrix, ld, N, K) of w_enc [H, I], w_mu / w_logvar [L, H], w_dec1 [H, L], w_dec2 [I, H].
  const std::array<std::tuple<const float*, int, int, int>, 5> mats{
      {{a.w_enc, a.I, a.H, a.I}, {a.w_mu, a.H, a.L, a.H}, {a.w_lv, a.H, a.L, a.H},
       {a.w_d1, a.L, a.H, a.L}, {a.w_d2, a.H, a.I, a.H}}};
  int64_t total = 0;
  for (const auto& [m, ld, N, K] : mats) total += cuda::b_fragment_size(N, packed_steps(K), true);
  Tensor packed = empty_like_device(like, {total});
  float* out = mdata<float>(packed);
  cuda::BFragmentsBatch batch{};
  PackedWeight pw[5];
  for (int i = 0; i < 5; ++i) {
    const auto& [m, ld, N, K] = mats[i];
    const int tiles = (N + 7) / 8;
    batch.m[i] = {m, ld, N, K, packed_steps(K), tiles, out, /*split=*/true};  // one pass: all tiles
    pw[i] = {reinterpret_cast<const float4*>(out), tiles, steps(K)};
    out += cuda::b_fragment_size(N, packed_steps(K), true);
  }
  cuda::pack_b_fragments(stream, batch, 5);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  const TiledWeights w{pw[0], pw[1], pw[2], pw[3], pw[4]};
  const int64_t tiles = (int64_t(a.B) + kTileRows - 1) / kTileRows;
  vae_elbo_tiled_kernel<<<unsigned(tiles), kThreads, smem, stream>>>(a, w);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  return true;
}

// ---------------------------------------------------------------------------
// wgmma path (sm_90a: H100 / H200)
// ---------------------------------------------------------------------------
//
// The tiled path's work (one CTA per 64 samples, the whole pass on chip,
// 3xTF32 products) with Hopper's warpgroup products: two warpgroups each
// own half of a layer's output columns, both A (the activations, split into
// big and small planes by the threads) and B (the weights, packed split in
// the operand layout of wgmma.cuh once per call) are read by the tensor
// cores straight from shared memory, and the weights arrive by bulk copies
// (one thread issues them) through a three-stage ring of chunks of four
// k-steps, each stage completing on its own mbarrier (the ring, the
// packer and the chunk loop are cuda/wgmma_stream.cuh's, shared with the
// flow kernel).  Chunk c + 1's products are issued before chunk c's are
// waited for; meanwhile the threads load the x chunk after next (encoder);
// after chunk c the threads meet at one block barrier (its stage and x
// buffer are free again) and refill the stage.
//
// Accuracy: each chunk's products go into a fresh accumulator, added to
// the layer's running sums with ordinary float32 adds.  The tensor cores'
// own accumulation is not float32 round-to-nearest: with the whole K summed
// in the wgmma accumulators the outputs were 10-45x further from a float64
// reference than the float32 reference's (recon, kl; B=2053 and 8192 at
// 784-256-32), with per-chunk sums (32 k) 1.5-3x (tenth session's run 4 in
// bench/results/nvidia-h200-gpu-run.txt).  Two fresh accumulators
// alternate, so the adds of one chunk overlap the next chunk's products
// (cuda::wgs::add_chunks; the first version waited for each chunk before
// issuing the next: 127 us with whole-K sums -> 137 us per-chunk).
//
// Shape: H == 256 (the encoder and the decoder's hidden layer are one m64n128
// product per warpgroup), 1 <= L <= 32 (mu | logvar: n32 per warpgroup, the
// latent padded to 32 columns), any I (K padded with zeros to whole chunks;
// the decoder's logits in passes of 128 columns, then passes of 16).  The
// weights stream from L2 once per CTA.
namespace wg {

using cuda::wgs::chunk_floats;
using cuda::wgs::kBlock;
using cuda::wgs::kKChunk;
using cuda::wgs::kS;
using cuda::wgs::kStages;

constexpr int kThreadsWg = 256;  // two warpgroups
constexpr int kRowsWg = 64;      // samples per CTA: the wgmma M
constexpr int kH = 256;
constexpr int kLp = 32;
constexpr int kPass = 128;      // decoder columns per full pass (64 per warpgroup)
constexpr int kTailPass = 16;   // ... per tail pass (8 per warpgroup)
constexpr int kDecChunks = kH / kKChunk;
// A tail pass's K chunks (4 KB each) travel together in one 32 KB ring
// chunk (add_chunks' kSub), as a full pass's chunks do one by one: eight
// 4 KB copies three at a time left its products waiting on L2 latency.
constexpr int kSubTail = kDecChunks;
static_assert(kSubTail * chunk_floats(kTailPass) == chunk_floats(kPass), "a tail pass fills one ring stage");

// Sizes in floats (kBlock: a 64-row operand's k-step block; chunk_floats:
// a chunk of packed weights, cuda/wgmma_stream.cuh).
constexpr int kXChunk = 2 * kS * kBlock;   // x: 64 rows x 32 columns, two planes
constexpr int kHPlane = kH / 8 * kBlock;   // one plane of h or g (64 x 256)
constexpr int kZPlane = kLp / 8 * kBlock;  // one plane of z (64 x 32)
constexpr int kMsLd = kLp + 1;

// Shared memory, in floats, phase by phase (every phase ends with a block
// barrier, after which its regions are free):
//   encoder   ring of 3 x 64 KB weight chunks at 0, two x chunks at kXs
//   mu|logvar h at 0 (both planes), ring of 3 x 32 KB at kRingM (over the
//             x chunks; two 16 KB K chunks to a stage), then, its products
//             done, logvar handed from warpgroup 1 to 0 at kMs and z at kZ
//             (inside that ring, above decoder 2's first stage)
//   decoder 1 its one weight chunk (L <= 32) at 0, z; g written over h
//   decoder 2 g at 0, ring of 3 x 32 KB at kRingD2
//   all       BCE partial sums, KL row sums, the stages' mbarriers at kMisc
// Each phase's first weight chunks are issued as soon as their stages are
// free: mu|logvar's when the encoder's products end, decoder 1's chunk and
// decoder 2's first when the mu|logvar products end.
constexpr int kXs = kStages * chunk_floats(kH);
constexpr int kRingM = 2 * kHPlane;
constexpr int kSubM = 2;                                // mu|logvar K chunks per ring chunk
constexpr int kStageM = kSubM * chunk_floats(2 * kLp);  // 32 KB
constexpr int kMs = kRingM + chunk_floats(kPass);       // above decoder 2's first stage
constexpr int kZ = kMs + (kRowsWg * kMsLd + 3) / 4 * 4;  // 16-byte aligned
constexpr int kRingD2 = 2 * kHPlane;
constexpr int kMisc = kXs + 2 * kXChunk;
constexpr int kWpart = kMisc, kKlrow = kWpart + 2 * kRowsWg, kBars = kKlrow + kRowsWg;
constexpr size_t kSmemBytes = sizeof(float) * kBars + kStages * sizeof(uint64_t);
static_assert(kZ + 2 * kZPlane <= kMisc && kRingD2 + kStages * chunk_floats(kPass) <= kMisc, "phase regions");
static_assert(kRingM >= 2 * kHPlane && kRingM + kStages * kStageM <= kMisc && kDecChunks % kSubM == 0,
              "mu|logvar's ring between h and the misc region");
static_assert(kRingD2 + chunk_floats(kPass) <= kMs && chunk_floats(kH) <= kHPlane,
              "decoder 1's chunk and decoder 2's first stage clear of ms and z");
static_assert(kBars % 2 == 0, "mbarriers are 8-byte aligned");

// The weights packed by cuda::wgs::pack_core: encoder, mu|logvar, decoder 1,
// decoder 2's full passes, its tail passes.
constexpr int kPacks = 5;
static_assert(kPacks <= cuda::wgs::kMaxPacks, "one packer launch");

struct WgWeights {
  const float *enc, *mulv, *d1, *d2, *d2_tail;
  int enc_chunks, full_passes, tail_passes;
};

__global__ void __launch_bounds__(kThreadsWg, 1) vae_elbo_wgmma_kernel(const Args<float> a, const WgWeights w) {
#if defined(FUSED_OPS_WGMMA)
  using cuda::wgs::add_chunks;
  using cuda::wgs::ChunkStream;
  using cuda::wgs::for_each_pair;
  using cuda::wgs::store_split_pair;
  using cuda::wgs::zero;
  extern __shared__ __align__(128) float smem[];
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + kBars);
  const int tid = int(threadIdx.x), wgi = tid / 128, lane = tid % cuda::kWarpSize;
  const int row0 = int(blockIdx.x) * kRowsWg, rows = min(kRowsWg, a.B - row0);
  const int I = a.I, L = a.L;
  cuda::wgs::init_ring_barriers(bars);
  __syncthreads();
  // Stores relu(acc + bias) of this warpgroup's 128 columns as the next
  // A operand (split, over h's place) and publishes it to the tensor cores.
  auto store_hidden = [&](const float(&acc)[kH / 4], const float* bias) {
    for_each_pair<kH / 2>(acc, [&](int r, int, int c, float v0, float v1) {
      const int n = wgi * (kH / 2) + c;
      store_split_pair(smem, kHPlane, r, n, relu(v0 + __ldg(bias + n)), relu(v1 + __ldg(bias + n + 1)));
    });
    cuda::fence_proxy_async();
    __syncthreads();
  };

  // 1. Encoder: h = relu(x W_enc^T + b_enc).  x chunks (64 rows x 32
  //    columns) are loaded, split and stored by all threads, one chunk ahead
  //    of the products; a quarter warp's eight float4 stores cover eight rows
  //    of one core matrix column (conflict-free).
  float hacc[kH / 4];  // this warpgroup's 128 columns
  // Phase 2's weight stream: its first chunks are issued when the encoder's
  // products end (below).
  const ChunkStream mulv_stream{w.mulv, kStageM, kDecChunks / kSubM, nullptr, 0, 0,
                                smem + kRingM, kStageM, kStages, w.enc_chunks};
  {
    const ChunkStream st{w.enc, chunk_floats(kH), w.enc_chunks, nullptr, 0, 0, smem, chunk_floats(kH), kStages, 0};
    st.prologue(bars);
    float xv[2][4];
    auto load_x = [&](int c) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int f = tid + kThreadsWg * j, r = (f / 64) * 8 + f % 8, col = c * kKChunk + 4 * (f / 8 % 8);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          xv[j][e] = (r < rows && col + e < I) ? __ldg(a.x + int64_t(row0 + r) * I + col + e) : 0.0f;
        }
      }
    };
    auto store_x = [&](int buf) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int f = tid + kThreadsWg * j, r = (f / 64) * 8 + f % 8, kq = f / 8 % 8;
        float* at = smem + kXs + buf * kXChunk + (kq / 2) * kBlock + cuda::core_offset(r, (kq % 2) * 4);
        cuda::SplitTf32 s[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) s[e] = cuda::split_tf32(xv[j][e]);
        *reinterpret_cast<float4*>(at) = make_float4(__uint_as_float(s[0].big), __uint_as_float(s[1].big),
                                                     __uint_as_float(s[2].big), __uint_as_float(s[3].big));
        *reinterpret_cast<float4*>(at + kS * kBlock) =
            make_float4(__uint_as_float(s[0].small), __uint_as_float(s[1].small), __uint_as_float(s[2].small),
                        __uint_as_float(s[3].small));
      }
    };
    // x chunks 0 and 1 first; chunk c + 2 is loaded while chunks c and c + 1
    // are in the tensor cores and stored over chunk c's buffer once every
    // warpgroup is done with it (a block barrier after the stores, as the
    // next products read rows of every thread).
    const int chunks = st.total();
    load_x(0);
    store_x(0);
    if (chunks > 1) {
      load_x(1);
      store_x(1);
    }
    cuda::fence_proxy_async();
    __syncthreads();
    zero(hacc);
    add_chunks<kH / 2>(
        hacc, st, 0, chunks, [&](int c) { return smem + kXs + (c % 2) * kXChunk; }, kS * kBlock, bars,
        [&](int c) {
          if (c + 2 < chunks) load_x(c + 2);
        },
        [&](int c) {
          if (c + 2 < chunks) {
            store_x(c % 2);
            cuda::fence_proxy_async();
            __syncthreads();
          }
        });
    // Every chunk has been consumed (the last release's barrier): h may
    // overwrite the ring, and phase 2's first chunks (their ring above h,
    // over the x chunks) travel while h is stored.
    mulv_stream.prologue(bars);
    store_hidden(hacc, a.b_enc);
  }

  // 2. mu (warpgroup 0) and logvar (warpgroup 1), 32 padded columns each;
  //    then z and the KL terms in warpgroup 0.
  float* const klrow = smem + kKlrow;
  // The decoder's weight streams (phases 3 and 4), whose first chunks are
  // issued at the end of phase 2's products (below).
  const ChunkStream d1_stream{w.d1, chunk_floats(kH), 1, nullptr, 0, 0, smem, chunk_floats(kH), 1,
                              w.enc_chunks + kDecChunks / kSubM};
  const ChunkStream d2_stream{w.d2, chunk_floats(kPass), w.full_passes * kDecChunks,
                              w.d2_tail, chunk_floats(kPass), w.tail_passes,
                              smem + kRingD2, chunk_floats(kPass), kStages,
                              w.enc_chunks + kDecChunks / kSubM + 1};
  {
    const ChunkStream& st = mulv_stream;
    // macc[i]: row rb + 8 ((i / 2) % 2), column lb + 8 (i / 4) + i % 2
    // (for_each_pair's layout).  Warpgroup 0's global loads for the z / KL
    // epilogue (eps, b_mu) are issued before the products, so their latency
    // hides behind them (loaded next to each term, every load stalled the
    // warp: see the decoder passes below).
    const int rb = 16 * (tid / 32 % 4) + lane / 4, lb = 2 * (lane % 4);
    float ep[kLp / 2], bmu[kLp / 4];
    if (wgi == 0) {
#pragma unroll
      for (int i = 0; i < kLp / 2; ++i) {
        const int r = rb + 8 * ((i / 2) % 2), l = lb + 8 * (i / 4) + i % 2;
        ep[i] = (r < rows && l < L) ? __ldg(a.eps + int64_t(row0 + r) * L + l) : 0.0f;
        if ((i / 2) % 2 == 0) bmu[i / 4 * 2 + i % 2] = l < L ? __ldg(a.b_mu + l) : 0.0f;
      }
    }
    float macc[kLp / 2];
    zero(macc);
    add_chunks<kLp, kSubM>(macc, st, 0, kDecChunks, smem, kHPlane, bars);
    // h and this phase's ring are free now (add_chunks' last release is a
    // block barrier after every warpgroup's products), so decoder 1's chunk
    // (over h's big plane) and decoder 2's first (its ring's stage 0, below
    // ms and z) travel during the z / KL epilogue instead of after it.
    // Their mbarriers' previous phases were this phase's ring chunks 1 and
    // 2, consumed; decoder 2's chunks 1 and 2 wait for phase 4 (stage 1
    // holds ms and z, and chunk 2's mbarrier is decoder 1's).
    if (tid == 0) {
      d1_stream.issue(0, bars);
      d2_stream.issue(0, bars);
    }
    float* const ms = smem + kMs;
    if (wgi == 1) {
      for_each_pair<kLp>(macc, [&](int r, int, int l, float v0, float v1) {
        ms[r * kMsLd + l] = l < L ? v0 + __ldg(a.b_lv + l) : 0.0f;
        ms[r * kMsLd + l + 1] = l + 1 < L ? v1 + __ldg(a.b_lv + l + 1) : 0.0f;
      });
    }
    __syncthreads();
    if (wgi == 0) {
      float kl[2] = {0.0f, 0.0f};  // rows g and g + 8 of this warp
#pragma unroll
      for (int i = 0; i < kLp / 2; i += 2) {  // column pairs in for_each_pair's order
        const int h = (i / 2) % 2, r = rb + 8 * h, l = lb + 8 * (i / 4);
        float zz[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          zz[e] = 0.0f;
          if (l + e < L) {
            const float mu = macc[i + e] + bmu[i / 4 * 2 + e], lv = ms[r * kMsLd + l + e];
            zz[e] = mu + expf(0.5f * lv) * ep[i + e];
            kl[h] += ((1.0f + lv) - mu * mu) - expf(lv);  // the reference's order
          }
        }
        store_split_pair(smem + kZ, kZPlane, r, l, zz[0], zz[1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = kl[h];
        v += __shfl_xor_sync(cuda::kFullMask, v, 1);
        v += __shfl_xor_sync(cuda::kFullMask, v, 2);
        if (lane % 4 == 0) klrow[16 * (tid / 32 % 4) + lane / 4 + 8 * h] = v;
      }
    }
    cuda::fence_proxy_async();
    __syncthreads();
  }

  // 3. Decoder hidden layer g = relu(z W_dec1^T + b_dec1) over h's place
  //    (after every warpgroup's products: the chunk sits there too).
  {
    cuda::wgs::chunk_products<kH / 2>(hacc, d1_stream, 0, smem + kZ, kZPlane, bars);
    cuda::wgmma_wait<0>();
    __syncthreads();
    store_hidden(hacc, a.b_d1);
  }

  // 4. Decoder logits into BCE sums, pass by pass: 128 columns (64 per
  //    warpgroup), then 16 (8 per warpgroup).  rsum[h]: rows g + 8 h of this
  //    warp, terms added in a fixed order.
  float rsum[2] = {0.0f, 0.0f};
  {
    const ChunkStream& st = d2_stream;
    st.prologue(bars, 1);  // (chunk 0 issued in phase 2)
    // One decoder pass of NP columns (NP / 2 per warpgroup) from column n0.
    // The epilogue loads its x and b_dec2 values for all of this thread's
    // logits first (0 where masked), then adds the BCE terms in
    // for_each_pair's order: loaded next to each term, every load's L2
    // latency stalled the warp (the branches inside each term's exp / log
    // kept the compiler from hoisting them; ncu, twelfth session's run 2).
    // The terms are branch-free (common/bce.h) and masked by a select, so
    // the compiler interleaves them (128.5 -> 112 us for the kernel).
    int q = 0;
    auto decoder_pass = [&](auto np, int n0) {
      constexpr int NP = decltype(np)::value;
      float dacc[NP / 4];
      zero(dacc);
      constexpr int kSub = NP == kTailPass ? kSubTail : 1;
      add_chunks<NP / 2, kSub>(dacc, st, q, kDecChunks, smem, kHPlane, bars);
      q += kDecChunks / kSub;
      // dacc[i]: row r0 + 8 ((i / 2) % 2), column n0 + 8 (i / 4) + i % 2 (for_each_pair).
      const int r0 = 16 * (tid / 32 % 4) + lane / 4;
      n0 += wgi * (NP / 2) + 2 * (lane % 4);
      float xin[NP / 4], bias[NP / 8];  // bias: one per column (rows r0 and r0 + 8 share it)
#pragma unroll
      for (int i = 0; i < NP / 4; ++i) {
        const int r = r0 + 8 * ((i / 2) % 2), n = n0 + 8 * (i / 4) + i % 2;
        xin[i] = (r < rows && n < I) ? __ldg(a.x + int64_t(row0 + r) * I + n) : 0.0f;
        if ((i / 2) % 2 == 0) bias[i / 4 * 2 + i % 2] = n < I ? __ldg(a.b_d2 + n) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < NP / 4; ++i) {
        const int r = r0 + 8 * ((i / 2) % 2), n = n0 + 8 * (i / 4) + i % 2;
        const float t = bce_term(dacc[i] + bias[i / 4 * 2 + i % 2], xin[i]);
        rsum[(i / 2) % 2] += (r < rows && n < I) ? t : 0.0f;  // a select: the terms interleave
      }
    };
    for (int p = 0; p < w.full_passes; ++p) decoder_pass(std::integral_constant<int, kPass>{}, p * kPass);
    for (int p = 0; p < w.tail_passes; ++p) {
      decoder_pass(std::integral_constant<int, kTailPass>{}, w.full_passes * kPass + p * kTailPass);
    }
  }
  float* const wpart = smem + kWpart;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v = rsum[h];
    v += __shfl_xor_sync(cuda::kFullMask, v, 1);
    v += __shfl_xor_sync(cuda::kFullMask, v, 2);
    if (lane % 4 == 0) wpart[wgi * kRowsWg + 16 * (tid / 32 % 4) + lane / 4 + 8 * h] = v;
  }
  __syncthreads();
  if (tid < rows) store_losses(a, row0 + tid, wpart[tid] + wpart[kRowsWg + tid], klrow[tid]);
  cuda::wgs::inval_ring_barriers(bars);
#else
  __trap();  // launched only where the sm_90a code was built (FUSED_OPS_SM90A)
#endif
}

}  // namespace wg

// Launches the wgmma path; false when it does not apply.
bool launch_wgmma(const Args<float>& a, const Tensor& like) {
#if defined(FUSED_OPS_SM90A)
  if (a.H != wg::kH || a.L > wg::kLp || !cuda::wgs::device_runs_sm90a() ||
      wg::kSmemBytes > cuda::max_shared_memory_per_block()) {
    return false;
  }
  cuda::allow_dynamic_smem(wg::vae_elbo_wgmma_kernel, wg::kSmemBytes);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  const int enc_chunks = (a.I + wg::kKChunk - 1) / wg::kKChunk;
  const int full = a.I / wg::kPass, tail = (a.I - full * wg::kPass + wg::kTailPass - 1) / wg::kTailPass;
  using cuda::wgs::CorePack;
  // (w0, w1, ld, rows, K, np, n_start, passes, kchunks)
  CorePack packs[wg::kPacks] = {
      {a.w_enc, nullptr, a.I, a.H, a.I, wg::kH, 0, 1, enc_chunks, nullptr},
      {a.w_mu, a.w_lv, a.H, a.L, a.H, 2 * wg::kLp, 0, 1, wg::kDecChunks, nullptr},
      {a.w_d1, nullptr, a.L, a.H, a.L, wg::kH, 0, 1, 1, nullptr},
      {a.w_d2, nullptr, a.H, a.I, a.H, wg::kPass, 0, full, wg::kDecChunks, nullptr},
      {a.w_d2, nullptr, a.H, a.I, a.H, wg::kTailPass, full * wg::kPass, tail, wg::kDecChunks, nullptr}};
  int64_t total = 0;
  for (const CorePack& p : packs) total += p.size();
  Tensor packed = empty_like_device(like, {std::max<int64_t>(total, 1)});
  float* out = mdata<float>(packed);
  cuda::wgs::CorePackBatch batch{};
  for (int i = 0; i < wg::kPacks; ++i) {
    packs[i].out = out;
    out += packs[i].size();
    batch.p[i] = packs[i];
  }
  cuda::wgs::pack_core(stream, batch, wg::kPacks);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  const wg::WgWeights w{packs[0].out, packs[1].out, packs[2].out, packs[3].out, packs[4].out,
                        enc_chunks, full, tail};
  const int64_t tiles = (int64_t(a.B) + wg::kRowsWg - 1) / wg::kRowsWg;
  wg::vae_elbo_wgmma_kernel<<<unsigned(tiles), wg::kThreadsWg, wg::kSmemBytes, stream>>>(a, w);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  return true;
#else
  (void)a;
  (void)like;
  return false;
#endif
}

template <typename T>
void launch_general(const Args<T>& a, const Tensor& like) {
  Tensor ws = empty_like_device(like, {int64_t(a.B) * (2 * int64_t(a.H) + 2 * a.L)});
  vae_elbo_general_kernel<T><<<unsigned(a.B), kThreads, 0,
                               cuda::current_stream(cuda::current_device())>>>(
      a, mdata<T>(ws));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}


template <typename T>
void vae_elbo_launch(const VaeElboCall& c) {
  const Args<T> a{cdata<T>(c.x),      cdata<T>(c.eps),      cdata<T>(c.w_enc),    cdata<T>(c.b_enc),
                  cdata<T>(c.w_mu),   cdata<T>(c.b_mu),     cdata<T>(c.w_logvar), cdata<T>(c.b_logvar),
                  cdata<T>(c.w_dec1), cdata<T>(c.b_dec1),   cdata<T>(c.w_dec2),   cdata<T>(c.b_dec2),
                  int(c.B),           int(c.I),             int(c.H),             int(c.L),
                  mdata<T>(c.elbo),   mdata<T>(c.recon),    mdata<T>(c.kl)};
  if constexpr (std::is_same_v<T, float>) {
    if (c.B >= kTiledMinBatch && (launch_wgmma(a, c.x) || launch_tiled(a, c.x))) return;
    if (launch_cluster(a)) return;
  }
  launch_general<T>(a, c.x);
}

VaeElboResult vae_elbo_cuda(const Tensor& x, const Tensor& eps, const Tensor& w_enc,
                            const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu,
                            const Tensor& w_logvar, const Tensor& b_logvar, const Tensor& w_dec1,
                            const Tensor& b_dec1, const Tensor& w_dec2, const Tensor& b_dec2) {
  const cuda::TensorDeviceGuard guard(x);
  VaeElboCall c(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2,
                b_dec2);
  FUSED_OPS_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", device_str(x));
  FUSED_OPS_CHECK(c.B <= INT_MAX && c.I * c.H <= INT_MAX && c.H * c.L <= INT_MAX,
                  "vae_elbo: sizes too large for the CUDA kernels (B <= 2^31 - 1 and weight ",
                  "matrices below 2^31 elements), got B=", c.B, ", I=", c.I, ", H=", c.H,
                  ", L=", c.L);
  if (c.B == 0) return c.result();
  dispatch_float(x.scalar_type(), [&](auto zero) { vae_elbo_launch<decltype(zero)>(c); });
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) { m.impl("vae_elbo", TORCH_BOX(&vae_elbo_cuda)); }

}  // namespace fused_ops
