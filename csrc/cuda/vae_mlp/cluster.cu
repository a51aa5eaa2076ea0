// \brief Cluster path of fused_ops::vae_mlp_elbo: the whole forward pass of
// a small float32 batch in ONE launch of thread-block clusters (sm_90: H100 /
// H200), vae_elbo's cluster design (cuda/vae_elbo/cluster.cu) generalised to
// the MLP chain of csrc/vae_mlp.h.
//
// Chosen for float32 on compute capability >= 9.0 when a 16-row tile's
// activations fit shared memory (16 (I + 2 Wmax + ...) floats <= 200 KB,
// Wmax the widest hidden layer or L: 784-512-256-64 needs ~117 KB) and a
// cluster of 8 or 16 such CTAs can be co-scheduled; taken naturally for
// B <= kClusterMaxBatch (below: why), forced at any B.
//
// Design.  Each cluster owns kRows = 16 samples.  The chain runs encoder
// layers 0 .. Le-1, the head (weight [2L, H]), Ld-1 decoder hidden layers,
// then the decoder's output layer.  Every layer is split across the
// cluster's CTAs by neurons (slice_of), its products are
// cuda/vae_elbo/cluster_products.cuh's warp products (CUDA cores, fixed
// order, weights read straight from global memory once per CTA), and each
// CTA pushes its slice of the layer's output into the other CTAs' copies by
// st.async, completing on one mbarrier per exchange (used once, parity 0),
// so a CTA waits only for its own copy -- no cluster barrier per layer.
// The head's CTAs push z (their slice of L) and keep their slice's KL
// terms; the output layer never leaves registers: each lane sums its row's
// likelihood terms (common/likelihood.h; gaussian_nll_term with dec_logvar)
// in double, the warps' sums are added in warp order, and each CTA pushes
// its per-row recon and KL partial sums (doubles) to rank 0, which adds them
// in rank order: deterministic, bitwise reproducible.
//
// Activations ping-pong between two [16, Wmax] buffers (row stride = the
// layer's width).  Layer t's output overwrites layer t-2's in every CTA; a
// CTA can only be pushed layer t's slices after all of layer t-1's slices
// reached the pusher, and each CTA pushes its layer t-1 slice after its last
// read of layer t-2's buffer (block barrier before every push), so no write
// lands on a buffer still being read.  A CTA with no neurons in layer t-1
// reads nothing in it.
//
// Numerics as the cublas path: float32 products (fmaf, fixed order; no
// TF32), bias + activation (common/activations.h, the activation a
// template parameter), z = mu + exp(logvar / 2) eps, the KL terms
// (1 + lv) - mu^2 - exp(lv) and the likelihood terms in float32, their row
// sums in double.  Rows past the batch are computed on zeros and dropped.
//
// Variants (plan_cluster, memoised per device and shape): 16-CTA clusters
// when every tile's cluster gets SMs of its own, else 8; weights as float4
// when I, L and every width are multiples of 4 and the pointers 16-byte
// aligned (else element by element); float4 weights software-pipelined
// (PREFETCH, one CTA per SM) when all clusters are resident at once;
// programmatic dependent launch as vae_elbo's cluster kernel.

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>

#include "common/activations.h"
#include "common/dispatch.h"
#include "common/likelihood.h"
#include "cuda/primitives/dependent_launch.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/vae_elbo/cluster_exchange.cuh"
#include "vae_mlp.h"

namespace fused_ops {
namespace vae_mlp_paths {
namespace {

namespace cg = cooperative_groups;
using vae_elbo_kernels::cluster_size_for;
using vae_elbo_kernels::exchange_bytes;
using vae_elbo_kernels::kNB;
using vae_elbo_kernels::kRows;
using vae_elbo_kernels::kThreads;
using vae_elbo_kernels::kWarps;
using vae_elbo_kernels::Slice;
using vae_elbo_kernels::slice_of;
using vae_elbo_kernels::split_linear;
using vae_elbo_kernels::warp_linear;

constexpr int kMaxCluster = 16;
constexpr size_t kMaxClusterSmem = 200 * 1024;
// Natural choice up to this batch (32 row tiles).  Not measured yet; the
// basis: every tile's cluster reads all the weights once per CTA, so the
// kernel's time grows with the tiles resident at once, while the cublas
// path costs about the same ~12 launches (~120-250 us at 784-512-256-64)
// for any B up to a few thousand.  At B = 512 the 32 tiles run as 8-CTA
// clusters, two CTAs per SM, one wave; beyond that a second wave doubles the
// time.  The path sweep (forced cluster vs cublas over B) sets the real rule.
constexpr int64_t kClusterMaxBatch = 512;
// Layers of the chain before the output layer: Le encoder layers, the head,
// Ld - 1 decoder hidden layers; each but the head's 2L outputs is exchanged
// (the head exchanges z).
constexpr int kMaxChain = kVaeMlpMaxHidden + 1 + kVaeMlpMaxLayers;
constexpr int kMaxExchanges = kMaxChain - 1;  // all but the output layer
constexpr int kSumsBar = kMaxExchanges;       // rank 0's row-sum exchange

// The kernel's view of a call.  Chain layer t: weight w[t] [width[t], in],
// bias b[t]; t < Le the encoder, t == Le the head (width 2L), then the
// decoder (t = Le + Ld: the output layer, width I).  Offsets: the
// shared-memory layout (bytes, host-computed).
struct Args {
  const float *x, *eps, *dec_logvar;
  const float* w[kMaxChain];
  const float* b[kMaxChain];
  int width[kMaxChain];
  int B, I, L, Le, Ld, likelihood;
  float act_param;
  float *elbo, *recon, *kl;
  int off_xs, off_buf0, off_buf1, off_mu, off_lv, off_partial, off_wpart, off_klpart, off_rall,
      off_klall, off_bars, smem;
};

// Widest exchanged activation (hidden widths and L): the ping-pong buffers' width.
int widest(const VaeMlpCall& c) {
  int64_t w = c.L;
  for (int64_t v : c.enc_width) w = std::max(w, v);
  for (int64_t l = 0; l + 1 < c.Ld; ++l) w = std::max(w, c.dec_width[l]);
  return int(w);
}

// Shared-memory layout in bytes, every array 16-byte aligned (float4 rows;
// doubles).  mu / lv hold a CTA's slice of L (at most ceil(L / 8) with
// clusters of 8 or more); partial is split_linear's scratch; wpart / klpart
// a CTA's per-row double sums; rall / klall collect every rank's in rank 0.
void layout(Args& a, int wmax) {
  int at = 0;
  auto take = [&](size_t bytes) {
    const int r = at;
    at += int((bytes + 15) / 16 * 16);
    return r;
  };
  const int lslice = (a.L + 7) / 8;
  a.off_xs = take(sizeof(float) * kRows * a.I);
  a.off_buf0 = take(sizeof(float) * kRows * wmax);
  a.off_buf1 = take(sizeof(float) * kRows * wmax);
  a.off_mu = take(sizeof(float) * kRows * lslice);
  a.off_lv = take(sizeof(float) * kRows * lslice);
  a.off_partial = take(sizeof(float) * kWarps * kNB * kRows);
  a.off_wpart = take(sizeof(double) * kWarps * kRows);
  a.off_klpart = take(sizeof(double) * kRows);
  a.off_rall = take(sizeof(double) * kMaxCluster * kRows);
  a.off_klall = take(sizeof(double) * kMaxCluster * kRows);
  a.off_bars = take(sizeof(uint64_t) * (kMaxExchanges + 1));
  a.smem = at;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A double into rank 0's copy of *dst, completing its 8 bytes on rank 0's *bar.
__device__ __forceinline__ void push_double(double* dst, double v, uint64_t* bar) {
  const unsigned long long u = __double_as_longlong(v);
  cuda::st_async(cuda::cluster_addr(dst, 0),
                 make_float2(__uint_as_float(unsigned(u)), __uint_as_float(unsigned(u >> 32))),
                 cuda::cluster_addr(bar, 0));
}
#endif

template <int64_t ACT, bool VEC, bool PREFETCH>
__global__ void __launch_bounds__(kThreads) vae_mlp_cluster_kernel(const Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  cuda::launch_dependents();
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int row0 = int(blockIdx.x / unsigned(C)) * kRows;
  const int rows = min(kRows, a.B - row0);
  const int I = a.I, L = a.L, Le = a.Le, Ld = a.Ld;
  float* const xs = reinterpret_cast<float*>(smem + a.off_xs);
  float* const buf[2] = {reinterpret_cast<float*>(smem + a.off_buf0),
                         reinterpret_cast<float*>(smem + a.off_buf1)};
  float* const mus = reinterpret_cast<float*>(smem + a.off_mu);
  float* const lvs = reinterpret_cast<float*>(smem + a.off_lv);
  float* const partial = reinterpret_cast<float*>(smem + a.off_partial);
  double* const wpart = reinterpret_cast<double*>(smem + a.off_wpart);
  double* const klpart = reinterpret_cast<double*>(smem + a.off_klpart);
  double* const rall = reinterpret_cast<double*>(smem + a.off_rall);
  double* const klall = reinterpret_cast<double*>(smem + a.off_klall);
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + a.off_bars);
  const int chain = Le + Ld;  // layers before the output layer: Le + 1 + (Ld - 1)

  // Exchange t (chain layer t's output; the head's z) expects the bytes of
  // the other CTAs' slices.  Declared before the cluster barrier below, so
  // no push can precede it.
  if (threadIdx.x == 0) {
    for (int t = 0; t < chain; ++t) {
      cuda::mbarrier_init(bars + t, 1);
    }
    if (rank == 0) cuda::mbarrier_init(bars + kSumsBar, 1);
    cuda::mbarrier_init_fence();
    for (int t = 0; t < chain; ++t) {
      const int N = t == Le ? L : a.width[t];
      cuda::mbarrier_arrive_expect_tx(bars + t, exchange_bytes(N, slice_of(N, C, rank)));
    }
    if (rank == 0) {
      cuda::mbarrier_arrive_expect_tx(bars + kSumsBar, uint32_t(2 * (C - 1) * kRows * sizeof(double)));
    }
  }
  auto started = cluster.barrier_arrive();
  cuda::wait_prior_grids();

  // x tile; rows past the batch are zero (their results are never stored).
  if constexpr (VEC) {
    const int I4 = I / 4;
    for (int idx = threadIdx.x; idx < kRows * I4; idx += kThreads) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (idx / I4 < rows) v = __ldg(reinterpret_cast<const float4*>(a.x + size_t(row0) * I) + idx);
      reinterpret_cast<float4*>(xs)[idx] = v;
    }
  } else {
    for (int idx = threadIdx.x; idx < kRows * I; idx += kThreads) {
      xs[idx] = idx / I < rows ? __ldg(a.x + size_t(row0) * I + idx) : 0.0f;
    }
  }
  __syncthreads();

  // The chain up to the output layer: hidden layers (bias + activation) and
  // the head (z and this CTA's KL terms), each followed by its exchange.
  const float* in = xs;
  int K = I;
  for (int t = 0; t < chain; ++t) {
    float* const out = buf[(t + 1) & 1];
    const float* const w = a.w[t];
    const float* const bias = a.b[t];
    int N;
    Slice s;
    if (t != Le) {
      N = a.width[t];
      s = slice_of(N, C, rank);
      split_linear<VEC, PREFETCH>(
          in, K, s.end - s.begin, [&](int n) { return w + size_t(s.begin + n) * K; },
          [&](int r, int n, float v) {
            out[r * N + s.begin + n] = activate<float>(ACT, a.act_param, v + __ldg(bias + s.begin + n));
          },
          partial);
      __syncthreads();
    } else {
      // mu rows then logvar rows of this CTA's slice of L, as one list of
      // neurons (the head's weight [2L, H]: mu rows 0..L-1, logvar L..2L-1).
      N = L;
      s = slice_of(L, C, rank);
      const int nl = s.end - s.begin;
      split_linear<VEC, PREFETCH>(
          in, K, 2 * nl,
          [&](int n) { return w + size_t(n < nl ? s.begin + n : L + s.begin + n - nl) * K; },
          [&](int r, int n, float v) {
            if (n < nl) {
              mus[r * nl + n] = v + __ldg(bias + s.begin + n);
            } else {
              lvs[r * nl + n - nl] = v + __ldg(bias + L + s.begin + n - nl);
            }
          },
          partial);
      __syncthreads();
      for (int idx = threadIdx.x; idx < kRows * nl; idx += kThreads) {
        const int r = idx / nl, j = idx - r * nl;
        const float m = mus[idx], v = lvs[idx];
        const float e = r < rows ? __ldg(a.eps + size_t(row0 + r) * L + s.begin + j) : 0.0f;
        out[r * L + s.begin + j] = m + expf(0.5f * v) * e;
        mus[idx] = ((1.0f + v) - m * m) - expf(v);  // the KL term, the cublas path's order
      }
      __syncthreads();
      if (threadIdx.x < kRows) {
        double acc = 0;
        for (int j = 0; j < nl; ++j) acc += double(mus[threadIdx.x * nl + j]);
        klpart[threadIdx.x] = acc;
      }
    }
    if (t == 0) cluster.barrier_wait(std::move(started));  // every CTA runs: pushes may start
    vae_elbo_kernels::push_slice(out, N, s, C, rank, bars + t);
    cuda::mbarrier_wait(bars + t, 0);  // (this CTA's own slice: the block barrier above)
    in = out;
    K = N;
  }

  // The output layer: this CTA's slice of I, straight into the likelihood
  // terms.  warp_linear hands (row r, neuron n) to lane (r << 1) | (n & 1),
  // so each lane's terms all belong to row lane >> 1.
  const float* const w_out = a.w[chain];
  const float* const b_out = a.b[chain];
  const float* const s_lv = a.dec_logvar;
  const Slice si = slice_of(I, C, rank);
  double racc = 0;
  warp_linear<VEC, PREFETCH>(
      in, K, si.end - si.begin, [&](int n) { return w_out + size_t(si.begin + n) * K; },
      [&](int r, int n, float v) {
        const int i = si.begin + n;
        const float av = v + __ldg(b_out + i), xv = xs[r * I + i];
        racc += double(s_lv ? gaussian_nll_term(av, xv, __ldg(s_lv + i)) : recon_term(a.likelihood, av, xv));
      });
  {
    const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
    const double tot = racc + __shfl_xor_sync(cuda::kFullMask, racc, 1);
    if ((lane & 1) == 0) wpart[warp * kRows + (lane >> 1)] = tot;
  }
  __syncthreads();
  if (threadIdx.x < kRows) {
    double s = 0;
    for (int w = 0; w < kWarps; ++w) s += wpart[w * kRows + threadIdx.x];
    double* const r_dst = rall + rank * kRows + threadIdx.x;
    double* const kl_dst = klall + rank * kRows + threadIdx.x;
    if (rank == 0) {
      *r_dst = s;
      *kl_dst = klpart[threadIdx.x];
    } else {
      push_double(r_dst, s, bars + kSumsBar);
      push_double(kl_dst, klpart[threadIdx.x], bars + kSumsBar);
    }
  }
  // No CTA may leave while another could still store into it.
  auto finished = cluster.barrier_arrive();
  if (rank == 0 && int(threadIdx.x) < rows) {
    cuda::mbarrier_wait(bars + kSumsBar, 0);
    double recon = 0, kl_sum = 0;
    for (int p = 0; p < C; ++p) {
      recon += rall[p * kRows + threadIdx.x];
      kl_sum += klall[p * kRows + threadIdx.x];
    }
    const int row = row0 + int(threadIdx.x);
    const float rec = float(recon), kl = float(-0.5 * kl_sum);
    a.recon[row] = rec;
    a.kl[row] = kl;
    a.elbo[row] = -(rec + kl);
  }
  cluster.barrier_wait(std::move(finished));
#else
  __trap();  // launched only on compute capability >= 9.0
#endif
}

using Kernel = void (*)(const Args);

// The kernel for a variant: the activation a template parameter
// (with_activation), VEC / PREFETCH as plan_cluster picks.
Kernel kernel_for(int64_t act, bool vec, bool prefetch) {
  Kernel k = nullptr;
  with_activation(act, [&](auto code) {
    constexpr int64_t A = decltype(code)::value;
    k = !vec ? vae_mlp_cluster_kernel<A, false, false>
             : prefetch ? vae_mlp_cluster_kernel<A, true, true> : vae_mlp_cluster_kernel<A, true, false>;
  });
  return k;
}

struct Plan {
  Kernel kernel = nullptr;
  int cluster = 0;  // 0: the path does not apply
  size_t smem = 0;
};

Plan plan_cluster(int64_t act, int smem_bytes, bool vec, int64_t tiles) {
  Plan plan;
  if (cuda::compute_capability_major() < 9) return plan;
  plan.smem = size_t(smem_bytes);
  if (plan.smem > kMaxClusterSmem || plan.smem > cuda::max_shared_memory_per_block()) return plan;
  plan.kernel = kernel_for(act, vec, false);
  plan.cluster = cluster_size_for(plan.kernel, plan.smem, tiles);
  if (plan.cluster > 0 && vec) {
    const Kernel pre = kernel_for(act, true, true);
    if (tiles <= cuda::max_active_clusters(pre, plan.cluster, kThreads, plan.smem)) plan.kernel = pre;
  }
  return plan;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The arguments and plan of a call.  Worked out by the predicate and again
// by the launcher (a few pointer reads and one memo look-up): no state kept
// between them, so a predicate asked only for a refusal message leaves none.
struct Prepared {
  Args args{};
  Plan plan;
};

Prepared prepare(const VaeMlpCall& c) {
  Prepared p;
  Args& a = p.args;
  if (c.x.scalar_type() != ScalarType::Float) return p;
  // int offsets and row indices: far beyond what fits shared memory anyway.
  if (c.B > (int64_t(1) << 30) || c.I > (int64_t(1) << 20)) return p;
  const int64_t chain = c.Le + c.Ld;
  bool vec = c.I % 4 == 0 && c.L % 4 == 0 && aligned16(cdata<float>(c.x));
  for (int64_t t = 0; t <= chain; ++t) {
    const Tensor& w = t < c.Le ? c.enc_w[t] : t == c.Le ? c.w_head : c.dec_w[t - c.Le - 1];
    const Tensor& b = t < c.Le ? c.enc_b[t] : t == c.Le ? c.b_head : c.dec_b[t - c.Le - 1];
    a.w[t] = cdata<float>(w);
    a.b[t] = cdata<float>(b);
    a.width[t] = int(w.size(0));
    vec = vec && w.size(0) % 4 == 0 && aligned16(a.w[t]);
  }
  a.x = cdata<float>(c.x);
  a.eps = cdata<float>(c.eps);
  a.dec_logvar = c.dec_logvar ? cdata<float>(*c.dec_logvar) : nullptr;
  a.B = int(c.B), a.I = int(c.I), a.L = int(c.L), a.Le = int(c.Le), a.Ld = int(c.Ld);
  a.likelihood = int(c.likelihood);
  a.act_param = float(c.act_param);
  a.elbo = mdata<float>(c.elbo), a.recon = mdata<float>(c.recon), a.kl = mdata<float>(c.kl);
  layout(a, widest(c));
  const int64_t tiles = (c.B + kRows - 1) / kRows;
  static cuda::Memo<std::tuple<int, int64_t, int, bool, int64_t>, Plan> plans;
  p.plan = plans.get(std::make_tuple(cuda::current_device(), c.act, a.smem, vec, tiles),
                     [&] { return plan_cluster(c.act, a.smem, vec, tiles); });
  return p;
}

}  // namespace

bool cluster_applies(const VaeMlpCall& c) {
  if (c.B > kClusterMaxBatch && !dispatch::is_forced("vae_mlp_elbo", "cuda", "cluster")) return false;
  return prepare(c).plan.cluster != 0;
}

void launch_cluster(const VaeMlpCall& c) {
  const Prepared p = prepare(c);
  const int64_t tiles = (c.B + kRows - 1) / kRows;
  cuda::ClusterLaunch launch(tiles * p.plan.cluster, p.plan.cluster, kThreads, p.plan.smem,
                             cuda::current_stream(cuda::current_device()));
  launch.overlap_prior_kernel();
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, p.plan.kernel, p.args));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace vae_mlp_paths
}  // namespace fused_ops
