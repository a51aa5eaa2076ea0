// \brief Cluster path of fused_ops::vae_elbo: the whole forward pass of
// float32 batches below kTiledMinBatch in ONE launch of thread-block
// clusters (sm_90: H100 / H200).
//
// Chosen for float32 on compute capability >= 9.0 when a 16-row tile's
// activations fit in shared memory (kRows * (I + 2H + 3L) floats plus
// scratch <= kMaxClusterSmem; 784-256-32 needs ~94 KB), for batches the
// tensor-core paths do not take (B < kTiledMinBatch, or their conditions
// fail).  The default size (B=128, 784-256-32) and every float32 test size
// below 2048 rows run here.
//
// Design.  Each cluster owns kRows = 16 samples; every layer is split across
// the cluster's CTAs by neurons (cluster_products.cuh: warp products on the
// CUDA cores, weights read straight from global memory, each once per CTA),
// and each CTA pushes its slice of the activations the next layer needs in
// full (h, z, the decoder hidden layer) into the other CTAs' shared memory:
// asynchronous distributed-shared-memory stores (st.async), each completing
// its bytes on an mbarrier of the destination, which waits for its own copy
// only -- no cluster barrier per layer.  x stays in shared memory for the
// BCE; the decoder logits never leave registers.  Each CTA's per-row BCE
// and KL partial sums are pushed to rank 0, which adds them in rank order.
//
// Variants, chosen per call by plan_cluster (memoised per device, sizes,
// alignment and row tiles; docs/vae_elbo.md has the measurements):
// - cluster size: 16 CTAs when every tile's cluster can have SMs of its own
//   (B <= 112 on an H200), else 8 (cluster_size_for says why);
// - weights as float4 when I, H, L are multiples of 4 and the pointers are
//   16-byte aligned, element by element otherwise;
// - float4 weights software-pipelined (PREFETCH, one CTA per SM) when all
//   clusters are resident at once, else the two-CTA-per-SM kernel;
// - programmatic dependent launch (cuda/primitives/dependent_launch.cuh): a call's
//   kernel may start on the SMs the previous one leaves idle and waits for
//   it before its first global-memory access.

#include <cooperative_groups.h>

#include <tuple>
#include <utility>

#include "common/bce.h"
#include "cuda/primitives/dependent_launch.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/vae_elbo/cluster_exchange.cuh"
#include "cuda/vae_elbo/paths.cuh"

namespace fused_ops {
namespace vae_elbo_kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kMaxCluster = 16;  // CTAs per cluster: 16 where the GPU allows it, else 8
constexpr size_t kMaxClusterSmem = 200 * 1024;

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
        racc += bce_term_or_nan(v + __ldg(a.b_d2 + i), xs[r * I + i]);
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

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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

}  // namespace

// The plan is cached per (device, sizes, alignment, row tiles): working it
// out asks about six device facts and occupancies, each a cudaGetDevice, a
// mutex and a map search, on a path whose calls are host-bound at B=128.
// Looked up once per call: the predicate keeps it in the Launch.
bool cluster_applies(const Launch& l) {
  if (!l.f32) return false;
  if (!l.planned) {
    const Args<float>& a = l.a;
    const bool vec = a.I % 4 == 0 && a.H % 4 == 0 && a.L % 4 == 0 && aligned16(a.x) &&
                     aligned16(a.w_enc) && aligned16(a.w_mu) && aligned16(a.w_lv) &&
                     aligned16(a.w_d1) && aligned16(a.w_d2);
    const int64_t tiles = (int64_t(a.B) + kRows - 1) / kRows;
    l.device = cuda::current_device();
    static cuda::Memo<std::tuple<int, int, int, int, bool, int64_t>, ClusterPlan> plans;
    l.plan = plans.get(std::make_tuple(l.device, a.I, a.H, a.L, vec, tiles),
                       [&] { return plan_cluster(a.I, a.H, a.L, vec, tiles); });
    l.planned = true;
  }
  return l.plan.cluster != 0;
}

void launch_cluster(const Launch& l) {
  const Args<float>& a = l.a;
  const int64_t tiles = (int64_t(a.B) + kRows - 1) / kRows;
  cuda::ClusterLaunch launch(tiles * l.plan.cluster, l.plan.cluster, kThreads, l.plan.smem,
                             cuda::current_stream(l.device));
  launch.overlap_prior_kernel();
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, l.plan.kernel, a));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace vae_elbo_kernels
}  // namespace fused_ops
