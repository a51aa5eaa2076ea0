// \brief The partial results of fused_ops::snis, shared by the CPU and CUDA
// kernels and merged in a fixed order by both.
//
// A partial over a set of log weights v_i is (max, sum, sum_sq) with
// sum = sum_i exp(v_i - max) and sum_sq = sum_i exp(2 (v_i - max)), held in
// double whatever the input dtype (float32 inputs are accumulated in double).
// A -inf log weight is a zero weight: it adds nothing, also when every
// weight of the partial is -inf (max = -inf, sum = 0).  A NaN or +inf log
// weight makes the sums NaN (exp(+inf - +inf)), and so every output of its
// problem but the evidence of an all -inf problem (log 0 = -inf).
#pragma once

#include <torch/headeronly/macros/Macros.h>

#include <cmath>

#include "common/logsumexp.h"

namespace fused_ops {

// exp(v - max), with -inf (a zero weight) exactly 0 even when max is -inf too.
C10_HOST_DEVICE inline double snis_weight(double v, double max) {
  return v == -INFINITY ? 0.0 : std::exp(v - max);
}

struct SnisStats {
  double max, sum, sum_sq;

  C10_HOST_DEVICE static SnisStats empty() { return {-INFINITY, 0.0, 0.0}; }

  C10_HOST_DEVICE static SnisStats merge(const SnisStats& a, const SnisStats& b) {
    const double m = nan_max(a.max, b.max);
    const double sa = snis_weight(a.max, m), sb = snis_weight(b.max, m);
    return {m, a.sum * sa + b.sum * sb, a.sum_sq * (sa * sa) + b.sum_sq * (sb * sb)};
  }

  // log sum_i exp(v_i): -inf when every weight is zero.
  C10_HOST_DEVICE double log_sum() const { return max + std::log(sum); }
  // ESS = (sum_i w_i)^2 / sum_i w_i^2, invariant to the common scale exp(max).
  C10_HOST_DEVICE double ess() const { return sum * sum / sum_sq; }
};

}  // namespace fused_ops
