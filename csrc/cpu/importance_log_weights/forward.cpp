// \brief CPU kernel of fused_ops::importance_log_weights (the only CPU path).
//
// lw[b, i] = logsumexp_{j < K} lc_j - logsumexp_{j >= K} lc_j with the
// component log densities lc_j = log_norm_j - 0.5 sum_d ((x_d - mu_jd) / std_jd)^2
// (params.h).  Parallel over the B * N rows in fixed blocks of rows; every
// row is computed alone, in double (the squared distances in four
// interleaved partial sums, each log-sum-exp online: one exp per
// component), and rounded once, so results are bitwise the same for any
// thread count.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <cmath>

#include "cpu/importance_log_weights/params.h"

namespace fused_ops {
namespace {

using importance_log_weights_cpu::Params;
using importance_log_weights_cpu::sum4;

template <typename T>
void forward_kernel(const ImportanceLogWeightsCall& c) {
  const Params p(c, T{});
  const int64_t N = c.N, D = c.D, K = c.K, J = p.J;
  const T* x = cdata<T>(c.x);
  T* lw = mdata<T>(c.log_weights);
  torch::stable::parallel_for(0, c.B * N, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t b = row / N;
      const T* xi = x + row * D;
      LogSumExp<double> lp = LogSumExp<double>::empty(), lq = LogSumExp<double>::empty();
      for (int64_t j = 0; j < J; ++j) {
        const double *m = p.mu_of(b, j), *r = p.r_of(b, j);
        const double sq = sum4(D, [&](int64_t d) {
          const double z = p.z(double(xi[d]), m, r, d);
          return z * z;
        });
        const double lc = p.log_norm[b * J + j] - 0.5 * sq;
        if (j < K) {
          lp.push(lc);
        } else {
          lq.push(lc);
        }
      }
      lw[row] = T(lp.value() - lq.value());
    }
  });
}

Tensor importance_log_weights_cpu_op(const Tensor& samples, const Tensor& mix_weights, const Tensor& mix_mus,
                                     const Tensor& mix_stds, const Tensor& q_weights, const Tensor& q_mus,
                                     const Tensor& q_stds) {
  ImportanceLogWeightsCall c(samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds);
  if (c.B == 0) return c.log_weights;
  dispatch_float(c.x.scalar_type(), [&](auto zero) { forward_kernel<decltype(zero)>(c); });
  return c.log_weights;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("importance_log_weights", TORCH_BOX(&importance_log_weights_cpu_op));
}

}  // namespace fused_ops
