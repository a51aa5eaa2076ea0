// \brief One term of PyTorch's binary_cross_entropy on p = sigmoid(a), shared by the
// CPU and CUDA kernels of vae_elbo:
//   (x - 1) * max(log(1 - p), -100) - x * max(log(p), -100),
// p = 1 / (1 + exp(-a)) rounded in T (DESIGN.md 2.3).
#pragma once

#include <torch/headeronly/macros/Macros.h>

#include <cmath>

namespace fused_ops {

template <typename T>
C10_HOST_DEVICE inline T clamp_log(T v) {
  return v < T(-100) ? T(-100) : v;  // NaN stays NaN, like std::max(NaN, -100) in PyTorch
}

// float64: the reference's formula verbatim.
template <typename T>
C10_HOST_DEVICE inline T bce_term(T a, T x) {
  const T p = T(1) / (T(1) + std::exp(-a));
  return (x - T(1)) * clamp_log(T(std::log1p(-p))) - x * clamp_log(T(std::log(p)));
}

// float32: the same value from one exp and one log, plus a reciprocal and a
// hardware log2 for a > 4.  On the GPU that is ~70 instructions and no branch
// per term instead of ~100 and three branch regions: the verbatim form's IEEE
// division and second log would be most of the VAE kernels' decoder epilogue.
// With s = log1p(exp(-|a|)),
//   log(p) = -(max(-a, 0) + s),   log(1 - p) = -(max(a, 0) + s)
// exactly, and they differ from the logs of the float32-rounded p by p's
// rounding alone.  That is negligible except in log(1 - p) for a large a:
// 1 - p rounded is off by up to 2^-25 / (1 - p) relative, ~2e-6 at a = 4 and
// ~0.6 at a = 16.5, and the reference is the float32 formula.  So for a > 4,
// log(1 - p) is taken, as the reference takes it, of 1 - p with p = 1 / (1 +
// exp(-a)) rounded; that also reproduces p == 1 exactly once 1 + exp(-a)
// rounds to 1 (a > 24 ln 2 ~ 16.64: log 0 = -inf, clamped to -100).  p == 0
// exactly (exp(-a) overflows, a < -88.72...: log(p) clamped) is reproduced
// by its threshold.  NaN in a gives NaN.
constexpr float kExpOverflow = 88.72283935546875f;  // the least float whose exp is inf
constexpr float kRoundedPAbove = 4.0f;

template <>
C10_HOST_DEVICE inline float bce_term(float a, float x) {
  const float e = std::exp(-std::fabs(a));
  const float u = 1.0f + e;
#if defined(__CUDA_ARCH__)
  // log1p(e) as log(u) plus the part of e that u lost to rounding (exact)
  // over u: logf's code has no branch, log1pf's has one.  p = 1 / u rounded
  // to nearest as the reference's division rounds it: rcp.approx and one
  // Newton step, the fast path of CUDA's IEEE reciprocal (exact for u in
  // [1, 2]) without its branch to the slow path.  __logf: within 3 ulp of
  // log(1 - p) <= -4.
  const float s = logf(u) + __fdividef(e - (u - 1.0f), u);
  const float r = __fdividef(1.0f, u);
  const float log_1mp_rounded = __logf(1.0f - fmaf(r, fmaf(-u, r, 1.0f), r));
#else
  const float s = std::log1p(e);
  const float log_1mp_rounded = std::log(1.0f - 1.0f / u);
#endif
  const float log_1mp = a > kRoundedPAbove ? log_1mp_rounded : -((a > 0.0f ? a : 0.0f) + s);
  const float log_p = -a >= kExpOverflow ? -100.0f : -((a < 0.0f ? -a : 0.0f) + s);
  return (x - 1.0f) * clamp_log(log_1mp) - x * clamp_log(log_p);
}

// Whether a target is a probability, 0 <= x <= 1 (false for NaN): the
// target binary_cross_entropy accepts.
template <typename T>
C10_HOST_DEVICE inline bool is_probability(T x) {
  return x >= T(0) && x <= T(1);
}

// bce_term, NaN for a target that is not a probability.  The CUDA kernels'
// answer to an invalid target: the row's recon and elbo (and its gradients)
// become NaN, without the host synchronisation a raise would cost per call.
// The CPU kernel raises instead, as binary_cross_entropy does
// (cpu/vae_elbo/forward.cpp).
// The term is computed whatever the target and then replaced: a select, not
// a branch around the term's ~70 instructions, which would keep the CUDA
// epilogues from interleaving their unrolled terms.
template <typename T>
C10_HOST_DEVICE inline T bce_term_or_nan(T a, T x) {
  const T t = bce_term(a, x);
  return is_probability(x) ? t : T(NAN);
}

}  // namespace fused_ops
