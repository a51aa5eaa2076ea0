// \brief Streaming log-sum-exp arithmetic shared by the CPU and CUDA kernels.
//
// A partial result is (max, sum) with sum = sum_i exp(v_i - max).  Partials
// merge associatively, which lets every kernel reduce in a fixed order and
// rescale running accumulators when the maximum grows (online softmax), so
// no pass over the data has to know the global maximum in advance.
#pragma once

#include <torch/headeronly/macros/Macros.h>

#include <cmath>

namespace fused_ops {

// max() that propagates NaN, as torch.logsumexp does.
template <typename T>
C10_HOST_DEVICE inline T nan_max(T a, T b) {
  return (a > b || a != a) ? a : b;
}

// exp(v - max), the weight of v relative to the running maximum.  v == max
// gives exactly 1, which also covers v == max == -inf (an all -inf partial) and
// v == max == +inf, where exp(v - max) would be exp(nan).
template <typename T>
C10_HOST_DEVICE inline T rel_exp(T v, T max) {
  return v == max ? T(1) : std::exp(v - max);
}

template <typename T>
struct LogSumExp {
  T max;
  T sum;

  C10_HOST_DEVICE static LogSumExp empty() { return {-INFINITY, T(0)}; }

  // One exp per value: only the side that is not the new maximum is rescaled.
  // Written with selects, not branches, so the GPU runs it without divergence.
  C10_HOST_DEVICE void push(T v) {
    const bool up = v > max;
    const T e = rel_exp(up ? max : v, up ? v : max);  // NaN in v or max gives NaN
    sum = up ? sum * e + T(1) : sum + e;
    max = up ? v : max;
  }

  C10_HOST_DEVICE static LogSumExp merge(const LogSumExp& a, const LogSumExp& b) {
    const T m = nan_max(a.max, b.max);
    return {m, a.sum * rel_exp(a.max, m) + b.sum * rel_exp(b.max, m)};
  }

  C10_HOST_DEVICE T value() const { return max + std::log(sum); }
};

}  // namespace fused_ops
