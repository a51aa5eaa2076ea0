// \brief What the six CUDA paths of fused_ops::vae_elbo share: the kernels'
// argument struct, the one call type of the dispatch table (dispatch.cu),
// the launchers' and predicates' declarations, and the device helpers every
// kernel uses (ReLU, a row's three outputs).
//
// Each path lives in its own file (wgmma.cu, tiled.cu, cublas.cu,
// cluster.cu, general.cu) with its kernels in an anonymous namespace; the launchers and
// predicates that dispatch.cu calls live in fused_ops::vae_elbo_kernels.
// A predicate is the complete condition under which its launcher is
// correct; a launcher runs only after its predicate held (PathTable checks
// it, for a forced path too), so it does not test it again.
//
// Every reduction in every path has a fixed order (butterfly shuffles, warps
// in order, CTAs in rank order) and no atomics: results are bitwise
// reproducible.  Numerics follow PyTorch: p = 1 / (1 + exp(-a)) with accurate
// expf (the build uses no fast math) and the BCE term of common/bce.h, with
// PyTorch's clamp of each log at -100.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/primitives/reductions.cuh"
#include "cuda/primitives/runtime.cuh"
#include "vae_elbo.h"

namespace fused_ops {
namespace vae_elbo_kernels {

constexpr int kThreads = 256;  // threads per CTA of the cluster, tiled and general kernels
constexpr int kWarps = kThreads / cuda::kWarpSize;
// Rows from which the tensor-core paths (wgmma, tiled) are taken: below it
// the one-launch cluster kernel is faster and the tensor-core tiles of 64
// rows would leave most SMs idle.
constexpr int64_t kTiledMinBatch = 2048;

// The kernels' view of a call: raw pointers of the contiguous inputs and
// outputs (VaeElboCall) and the sizes x [B, I], w_enc [H, I], w_mu [L, H].
template <typename T>
struct Args {
  const T *x, *eps, *w_enc, *b_enc, *w_mu, *b_mu, *w_lv, *b_lv, *w_d1, *b_d1, *w_d2, *b_d2;
  int B, I, H, L;
  T *elbo, *recon, *kl;
};

template <typename T>
inline Args<T> make_args(const VaeElboCall& c) {
  return Args<T>{cdata<T>(c.x),      cdata<T>(c.eps),      cdata<T>(c.w_enc),    cdata<T>(c.b_enc),
                 cdata<T>(c.w_mu),   cdata<T>(c.b_mu),     cdata<T>(c.w_logvar), cdata<T>(c.b_logvar),
                 cdata<T>(c.w_dec1), cdata<T>(c.b_dec1),   cdata<T>(c.w_dec2),   cdata<T>(c.b_dec2),
                 int(c.B),           int(c.I),             int(c.H),             int(c.L),
                 mdata<T>(c.elbo),   mdata<T>(c.recon),    mdata<T>(c.kl)};
}

// Which cluster kernel runs a call, in clusters of how many CTAs (0: the
// cluster path does not apply), with how much shared memory (cluster.cu).
struct ClusterPlan {
  void (*kernel)(const Args<float>) = nullptr;
  int cluster = 0;
  size_t smem = 0;
};

// One call as the dispatch table sees it.  float32 calls carry their kernel
// arguments (built once); float64 calls only reach the general path.  The
// cluster plan is worked out by the cluster predicate and kept here for its
// launcher, so a call looks it up once.
struct Launch {
  const VaeElboCall& c;
  bool f32;
  Args<float> a;  // float32 calls only
  mutable bool planned = false;
  mutable ClusterPlan plan;
  mutable int device = 0;  // the current device, with the plan
  // bfloat16 calls (f32 false): their arguments; they reach the table only
  // when tiled_bf16 takes them (dispatch.cu), the others run the float32
  // table on float32 copies.
  bool bf16 = false;
  Args<__nv_bfloat16> ab{};
  // vae_elbo_train: its call (its `saved` output allocated); null for vae_elbo.
  const VaeElboTrainCall* train = nullptr;
};

// wgmma.cu (sm_90a build only; false otherwise).  With l.train set (the
// train table) the kernel also stores the activations.
bool wgmma_applies(const Launch& l);
void launch_wgmma(const Launch& l);
// tiled.cu
bool tiled_applies(const Launch& l);
void launch_tiled(const Launch& l);
bool tiled_bf16_applies(const Launch& l);
void launch_tiled_bf16(const Launch& l);
// cublas.cu (also vae_elbo_train's: with l.train, into its saved buffer)
bool cublas_applies(const Launch& l);
void launch_cublas(const Launch& l);
// cluster.cu
bool cluster_applies(const Launch& l);
void launch_cluster(const Launch& l);
// general.cu: any call
void launch_general(const Launch& l);

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

}  // namespace vae_elbo_kernels
}  // namespace fused_ops
