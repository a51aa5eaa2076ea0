// \brief The reconstruction terms of fused_ops::vae_elbo's likelihoods and
// their gradients, shared by the CPU and CUDA kernels.  Per element, with a
// the decoder's logit (its last Linear's output) and x the target:
//
//   0 kBernoulli          BCE of p = sigmoid(a), PyTorch's clamp (common/bce.h):
//                         F.binary_cross_entropy(torch.sigmoid(a), x); NaN for a
//                         target outside [0, 1] (bce_term_or_nan: CUDA's answer,
//                         the CPU kernel raises before)
//   1 kBernoulliLogits    F.binary_cross_entropy_with_logits(a, x)
//                         = (1 - x) a - log_sigmoid(a), no clamp
//   2 kGaussianSigmoid    F.mse_loss(torch.sigmoid(a), x): (p - x)^2
//   3 kGaussian           F.mse_loss(a, x): (a - x)^2
//
// each summed over the features with reduction "sum" (a Gaussian of fixed
// variance 1/2 without its constants: the MSE users write; another fixed
// sigma only scales the term, which the caller's weighting does).
//
// Gradients are PyTorch's backward formulas for those expressions, times the
// upstream gradient d of the row's recon:
//   0: ga = d (p - x) / max((1 - p) p, 1e-12) * (1 - p) p,  gx = -log(p / (1 - p)) d
//   1: ga = (sigmoid(a) - x) d,                            gx = -a d
//   2: g = 2 (p - x) d, ga = g (1 - p) p,                  gx = -g
//   3: g = 2 (a - x) d, ga = g,                            gx = -g
// A row whose d is exactly zero gets gx = 0 (no 0 * inf at saturated p or
// infinite a), as the Bernoulli kernels always did.
#pragma once

#include <torch/headeronly/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "common/activations.h"  // sigmoid_of
#include "common/bce.h"

namespace fused_ops {

enum VaeLikelihood : int64_t {
  kBernoulli = 0,
  kBernoulliLogits = 1,
  kGaussianSigmoid = 2,
  kGaussian = 3,
};

constexpr int64_t kNumVaeLikelihoods = 4;

// One element's reconstruction term.
template <typename T>
C10_HOST_DEVICE inline T recon_term(int64_t likelihood, T a, T x) {
  switch (likelihood) {
    case kBernoulliLogits: {
      // PyTorch's log_sigmoid: min(a, 0) - log1p(exp(-|a|)).
      const T log_sig = (a < T(0) ? a : T(0)) - std::log1p(std::exp(-std::fabs(a)));
      return (T(1) - x) * a - log_sig;
    }
    case kGaussianSigmoid: {
      const T d = sigmoid_of(a) - x;
      return d * d;
    }
    case kGaussian: {
      const T d = a - x;
      return d * d;
    }
    default:
      return bce_term_or_nan(a, x);
  }
}

// One element's gradients: ga at the logit, gx at the target (see above).
template <typename T>
C10_HOST_DEVICE inline void recon_backward(int64_t likelihood, T a, T x, T d, T& ga, T& gx) {
  switch (likelihood) {
    case kBernoulliLogits:
      ga = (sigmoid_of(a) - x) * d;
      gx = d != T(0) ? -a * d : T(0);
      return;
    case kGaussianSigmoid: {
      const T p = sigmoid_of(a);
      const T g = T(2) * (p - x) * d;
      ga = g * (T(1) - p) * p;
      gx = -g;
      return;
    }
    case kGaussian: {
      const T g = T(2) * (a - x) * d;
      ga = g;
      gx = -g;
      return;
    }
    default: {
      const T p = sigmoid_of(a);
      const T q = T(1) - p;
      const T qp = q * p;
      const T den = qp < T(1e-12) ? T(1e-12) : qp;
      const bool valid = is_probability(x);  // as bce_term_or_nan
      ga = valid ? d * (p - x) / den * q * p : T(NAN);
      gx = valid ? (d != T(0) ? -std::log(p / q) * d : T(0)) : T(NAN);
    }
  }
}

}  // namespace fused_ops
