// \brief What the two CUDA paths of fused_ops::vae_elbo_backward share: the
// call type of the dispatch table (backward_dispatch.cu), the launchers'
// declarations, and the elementwise stages of the chain, written once as
// functors that the persistent kernel runs as tile epilogues and the cuBLAS
// path runs through cuda::apply_epilogue between its products.
//
// Numerics follow PyTorch's kernels: p = 1 / (1 + exp(-a)); BCE backward
// (p - x) / max((1 - p) p, 1e-12); sigmoid backward * (1 - p) * p; BCE's
// target gradient -log(p / (1 - p)).  Bias gradients (column sums) are added
// in a fixed order in double, with no atomics, in both paths: results are
// bitwise reproducible.
#pragma once

#include <cstdint>

#include "common/bce.h"
#include "common/likelihood.h"
#include "cuda/primitives/runtime.cuh"
#include "vae_elbo_backward.h"

namespace fused_ops {
namespace vae_elbo_backward_kernels {

// Largest amount of work (multiply-adds, B H (6 I + 8 L)) for the persistent
// path: B = 1024 at 784-256-32 is 1.3e9.
constexpr double kPersistentMaxMacs = 1.5e9;

// One call as the dispatch table sees it (B >= 1: an empty batch returns
// before the table).
struct BackwardLaunch {
  const VaeElboBackwardCall& c;
  bool f32;  // float32, else float64
  // vae_elbo_train_backward: vae_elbo_train's activations (VaeSavedLayout,
  // contiguous), read instead of recomputed; nullptr for vae_elbo_backward.
  const Tensor* saved = nullptr;
};

// backward_persistent.cu
bool persistent_applies(const BackwardLaunch& l);
void launch_persistent(const BackwardLaunch& l);
// backward_cublas.cu: any call
void launch_cublas(const BackwardLaunch& l);

__device__ __forceinline__ float dexp(float v) { return expf(v); }
__device__ __forceinline__ double dexp(double v) { return exp(v); }
__device__ __forceinline__ float dlog(float v) { return logf(v); }
__device__ __forceinline__ double dlog(double v) { return log(v); }

// Upstream gradient of recon (which = 0) or kl (which = 1) for row b:
// grad_recon/kl - grad_elbo, a missing one counting as zero.
template <typename T>
__device__ __forceinline__ T upstream(const T* g_elbo, const T* g_other, int64_t b) {
  if (g_elbo && g_other) return -g_elbo[b] + g_other[b];
  if (g_elbo) return -g_elbo[b];
  if (g_other) return g_other[b];
  return T(0);
}

// Element (b, i) of the logits before their bias (b_dec2 added here; null:
// v is the logit itself, as vae_elbo_train saves it) -> the gradient at the
// logits (BCE backward with PyTorch's clamp, then sigmoid backward) into ga3
// and BCE's target gradient -logit(p) * d_recon into gx (zero where d_recon
// is zero; gx null: not wanted); for another likelihood, common/likelihood.h's
// recon_backward.  Both paths: a tile epilogue, and cuda::apply_epilogue
// after cuBLAS.
template <typename T>
struct BceBackward {
  const T *b_dec2, *x, *g_elbo, *g_recon;
  T *ga3, *gx;
  int64_t I;
  int64_t likelihood;
  __device__ void operator()(int64_t b, int64_t i, T v) const {
    const T dr = upstream(g_elbo, g_recon, b);
    const T a = b_dec2 ? v + b_dec2[i] : v;
    if (likelihood != kBernoulli) {
      T gxv;
      recon_backward(likelihood, a, x[b * I + i], dr, ga3[b * I + i], gxv);
      if (gx) gx[b * I + i] = dr != T(0) ? gxv : T(0);
      return;
    }
    const T p = T(1) / (T(1) + dexp(-a));
    const T q = T(1) - p;
    const T qp = q * p;
    const T den = qp < T(1e-12) ? T(1e-12) : qp;
    const T xv = x[b * I + i];
    const T gp = dr * (p - xv) / den;
    // NaN for a target that is not a probability, as the forward's
    // bce_term_or_nan (common/bce.h).
    const bool valid = is_probability(xv);
    ga3[b * I + i] = valid ? gp * q * p : T(NAN);
    if (gx) gx[b * I + i] = valid ? (dr != T(0) ? -dlog(p / q) * dr : T(0)) : T(NAN);
  }
};

// Element (b, l) of the gradient at z, with mu/logvar (ml [B, 2L]) and eps
// -> gml [B, 2L] = [gmu, glv] and geps [B, L].  Both paths: a tile epilogue,
// and cuda::apply_epilogue after cuBLAS.
template <typename T>
struct LatentBackward {
  const T *ml, *eps, *g_elbo, *g_kl;
  T *gml, *geps;
  int64_t L;
  __device__ void operator()(int64_t b, int64_t l, T gz) const {
    const T dk = upstream(g_elbo, g_kl, b);
    const T mu = ml[b * 2 * L + l], lv = ml[b * 2 * L + L + l];
    const T s = dexp(T(0.5) * lv);
    gml[b * 2 * L + l] = gz + dk * mu;
    gml[b * 2 * L + L + l] = T(0.5) * (gz * eps[b * L + l] * s) + (T(-0.5) * dk) * (T(1) - dexp(lv));
    geps[b * L + l] = gz * s;
  }
};

template <typename T>
struct AddBias {
  T* c;
  int64_t ldc;
  const T* bias;
  __device__ void operator()(int64_t m, int64_t n, T v) const { c[m * ldc + n] = v + bias[n]; }
};

template <typename T>
struct AddBiasRelu {
  T* c;
  int64_t ldc;
  const T* bias;
  __device__ void operator()(int64_t m, int64_t n, T v) const {
    const T u = v + bias[n];
    c[m * ldc + n] = u < T(0) ? T(0) : u;
  }
};

// ReLU backward on the ReLU's output `act` (same layout as c): zero where
// act <= 0, the gradient elsewhere, NaN activations included, as PyTorch's
// threshold_backward passes it.
template <typename T>
struct ReluMask {
  T* c;
  int64_t ldc;
  const T* act;
  __device__ void operator()(int64_t m, int64_t n, T v) const {
    c[m * ldc + n] = act[m * ldc + n] <= T(0) ? T(0) : v;
  }
};

// z = mu + exp(logvar / 2) * eps from ml [B, 2L] (mu, logvar with biases).
template <typename T>
struct Reparameterize {
  const T *ml, *eps;
  T* z;
  int64_t L;
  __device__ void operator()(int64_t b, int64_t l, T) const {
    z[b * L + l] = ml[b * 2 * L + l] + dexp(T(0.5) * ml[b * 2 * L + L + l]) * eps[b * L + l];
  }
};

}  // namespace vae_elbo_backward_kernels
}  // namespace fused_ops
