// \brief Row sums of the VAE's reconstruction terms on the CPU, in SIMD
// lanes (float32) or scalar (float64), shared by vae_elbo's and
// vae_mlp_elbo's CPU kernels.  Each is FUSED_OPS_INLINE and templated on the
// lane width VB (bytes): a caller compiled for AVX2 (cpu/vec_math.h) gets
// 8-lane code, a baseline caller 4 lanes.
//
// BCE follows PyTorch exactly: p = 1 / (1 + exp(-a)), then
//   (x - 1) * max(log1p(-p), -100) - x * max(log(p), -100)
// per element; the other likelihoods are common/likelihood.h's recon_term
// lane-wise.  Row sums: two lane accumulators, finished in double.  exp/log
// are cpu/vec_math.h's polynomials (<= 2 ulp); logits beyond +-87 (where
// exp leaves the polynomial's range), infinities and NaN take the scalar
// term.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/bce.h"
#include "common/likelihood.h"
#include "cpu/vec_math.h"

namespace fused_ops {
namespace cpu {

// Whether a target is a probability: 0 <= v <= 1, false for NaN (the
// comparisons binary_cross_entropy's target check makes).  Non-short-circuit
// & so that the loops stay branch-free.
template <typename T>
FUSED_OPS_INLINE bool is_probability(T v) {
  return (v >= T(0)) & (v <= T(1));
}

// Sum over one row of BCE(sigmoid(a[i]), x[i]); `ok` is cleared when a
// target x[i] is not a probability (is_probability), checked in the same loop.
template <typename T, int VB>
FUSED_OPS_INLINE double bce_row(const T* a, const T* x, int64_t I, bool& ok) {
  if constexpr (!std::is_same_v<T, float>) {
    double s = 0;
    bool row_ok = true;
    for (int64_t i = 0; i < I; ++i) {
      s += bce_term(a[i], x[i]);
      row_ok &= is_probability(x[i]);
    }
    ok &= row_ok;
    return s;
  } else {
    using V = cpu::Lanes<float, VB>;
    using M = decltype(V{} < V{});  // lane masks: -1 true, 0 false
    constexpr int NL = cpu::kLanes<float, VB>;
    V acc0 = {}, acc1 = {};
    M valid = M{} - 1;  // all lanes true
    bool tail_ok = true;
    double tail = 0;
    auto body = [&](const V& av, const V& xv, V& acc) {
      valid &= (xv >= 0.0f) & (xv <= 1.0f);
      const V e = cpu::exp(V{} - av);
      const V p = 1.0f / (1.0f + e);
      V lp = cpu::log(p);
      lp = lp < -100.0f ? -100.0f : lp;
      // log1p(-p) from w = 1 - p rounded: for p >= 0.5, w is exact; for
      // p < 0.5 the rounding error c = (1 - w) - p is exact (Sterbenz) and
      // log(1 - p) = log(w + c) = log(w) + c / w, with 1 / w ~ 2 - w (relative
      // error p^2 <= 1/4 on a correction below 2^-25): full accuracy even
      // when p is tiny, without a second division.
      const V w = 1.0f - p;
      const V c = (1.0f - w) - p;
      V l1 = cpu::log(w) + c * (2.0f - w);
      l1 = l1 < -100.0f ? -100.0f : l1;
      acc += (xv - 1.0f) * l1 - xv * lp;
    };
    // The vector exp/log cover |a| <= 87 (p normal); rows with a logit
    // beyond take libm for the elements beyond (rare: saturated logits).
    V lo = V{} + 87.0f, hi = V{} - 87.0f;
    int64_t i = 0;
    for (; i + NL <= I; i += NL) {
      const V av = cpu::load_lanes<V>(a + i);
      lo = av < lo ? av : lo;
      hi = av > hi ? av : hi;
    }
    bool in_range = true;
    for (int j = 0; j < NL; ++j) in_range &= lo[j] >= -87.0f && hi[j] <= 87.0f;
    i = 0;
    if (in_range) {
      for (; i + 2 * NL <= I; i += 2 * NL) {
        body(cpu::load_lanes<V>(a + i), cpu::load_lanes<V>(x + i), acc0);
        body(cpu::load_lanes<V>(a + i + NL), cpu::load_lanes<V>(x + i + NL), acc1);
      }
    } else {
      for (; i + NL <= I; i += NL) {
        const V av = cpu::load_lanes<V>(a + i);
        bool big = false;
        for (int j = 0; j < NL; ++j) big |= !(av[j] >= -87.0f && av[j] <= 87.0f);
        if (big) {
          for (int j = 0; j < NL; ++j) {
            tail += bce_term(a[i + j], x[i + j]);
            tail_ok &= is_probability(x[i + j]);
          }
        } else {
          body(av, cpu::load_lanes<V>(x + i), acc0);
        }
      }
    }
    for (; i < I; ++i) {
      tail += bce_term(a[i], x[i]);
      tail_ok &= is_probability(x[i]);
    }
    const V acc = acc0 + acc1;
    double s = tail;
    for (int j = 0; j < NL; ++j) s += double(acc[j]);
    for (int j = 0; j < NL; ++j) tail_ok &= valid[j] != 0;
    ok &= tail_ok;
    return s;
  }
}

// One vector of a likelihood's reconstruction terms other than kBernoulli
// (common/likelihood.h's recon_term, lane-wise; |a| <= 87 so that the
// vector exp stays in range).  Logits: log1p(e) of e = exp(-|a|) in (0, 1]
// as log(u) + c / u with u = 1 + e rounded and c = e - (u - 1) its exact
// rounding error (Fast2Sum, 1 >= e): full accuracy when e is tiny.
template <typename V>
FUSED_OPS_INLINE V recon_lanes(int64_t likelihood, const V& av, const V& xv) {
  if (likelihood == kBernoulliLogits) {
    const V na = av < 0.0f ? av : -av;  // -|a|
    const V e = cpu::exp(na);
    const V u = 1.0f + e;
    const V c = e - (u - 1.0f);
    const V log1p_e = cpu::log(u) + c / u;
    const V min_a0 = av < 0.0f ? av : V{};
    return (1.0f - xv) * av - (min_a0 - log1p_e);
  }
  if (likelihood == kGaussianSigmoid) {
    const V d = 1.0f / (1.0f + cpu::exp(V{} - av)) - xv;
    return d * d;
  }
  const V d = av - xv;  // kGaussian
  return d * d;
}

// Sum over one row of the reconstruction term of a likelihood other than
// kBernoulli.  float32: SIMD lanes (recon_lanes), two lane accumulators
// finished in double as bce_row's; a vector holding a logit beyond +-87, an
// infinity or a NaN takes the scalar term for its elements.  float64:
// scalar, in double.
template <typename T, int VB>
FUSED_OPS_INLINE double recon_row(int64_t likelihood, const T* a, const T* x, int64_t I) {
  double s = 0;
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    using V = cpu::Lanes<float, VB>;
    constexpr int NL = cpu::kLanes<float, VB>;
    V acc[2] = {V{}, V{}};
    for (; i + NL <= I; i += NL) {
      const V av = cpu::load_lanes<V>(a + i);
      bool in_range = true;
      for (int j = 0; j < NL; ++j) in_range &= av[j] >= -87.0f && av[j] <= 87.0f;
      if (in_range) {
        acc[(i / NL) & 1] += recon_lanes(likelihood, av, cpu::load_lanes<V>(x + i));
      } else {
        for (int j = 0; j < NL; ++j) s += double(recon_term(likelihood, a[i + j], x[i + j]));
      }
    }
    const V sum = acc[0] + acc[1];
    for (int j = 0; j < NL; ++j) s += double(sum[j]);
  }
  for (; i < I; ++i) s += double(recon_term(likelihood, a[i], x[i]));
  return s;
}

}  // namespace cpu
}  // namespace fused_ops
