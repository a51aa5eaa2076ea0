// One term of PyTorch's binary_cross_entropy on p = sigmoid(a), shared by the
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

// float32: the same value from one exp and one log1p.  The verbatim form
// costs exp, an IEEE division, log1p and log (on the GPU ~100 instructions
// and three branch regions per term, the largest part of the VAE kernels'
// decoder epilogue).  With s = log1p(exp(-|a|)),
//   log(p) = -(max(-a, 0) + s),   log(1 - p) = -(max(a, 0) + s)
// exactly.  Float32 p's saturation is reproduced: p == 1 exactly when
// 1 + exp(-a) rounds to 1 (a > 24 ln 2 ~ 16.64: log(1 - p) = -inf, clamped
// to -100), p == 0 exactly when exp(-a) overflows (a < -88.72...: log(p)
// clamped).  Elsewhere this gives the logs of the exact p, as a float64
// reference does; the verbatim float32 form's log(1 - p) of a p rounded next
// to 1 can be up to ~0.6 off (a ~ 16.5).  NaN in a gives NaN.
constexpr float kExpOverflow = 88.72283935546875f;  // the least float whose exp is inf

template <>
C10_HOST_DEVICE inline float bce_term(float a, float x) {
  const float e = std::exp(-std::fabs(a));
  const float u = 1.0f + e;
#if defined(__CUDA_ARCH__)
  // log1p(e) as log(u) plus the part of e that u lost to rounding (exact)
  // over u: the GPU's logf has no branch, its log1pf has one.
  const float s = logf(u) + __fdividef(e - (u - 1.0f), u);
#else
  const float s = std::log1p(e);
#endif
  const float log_1mp = (a > 0.0f && u == 1.0f) ? -100.0f : -((a > 0.0f ? a : 0.0f) + s);
  const float log_p = -a >= kExpOverflow ? -100.0f : -((a < 0.0f ? -a : 0.0f) + s);
  return (x - 1.0f) * clamp_log(log_1mp) - x * clamp_log(log_p);
}

}  // namespace fused_ops
