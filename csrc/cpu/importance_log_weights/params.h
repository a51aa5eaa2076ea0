// \brief What the CPU forward and backward of fused_ops::importance_log_weights
// share: the per-problem parameters prepared in double, and the row loop
// that gives one sample's per-component log densities.
//
// Components j = 0 .. J-1 of problem b, J = K + Kq: j < K the target's
// mixture, j >= K the proposal's.  Prepared once per call, [B, J, D] each:
// mu, and r = 1/std (or std itself when some 1/std overflows: a subnormal
// float64 std, where (x - mu) * inf would be NaN at the mean; the kernels
// then divide, as the reference does); log_norm [B, J] = log w_j - sum_d
// log std_jd, summed in double in d order.
#pragma once

#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <vector>

#include "common/logsumexp.h"
#include "importance_log_weights.h"

namespace fused_ops {
namespace importance_log_weights_cpu {

struct Params {
  int64_t B, N, D, K, J;
  bool divide = false;  // r holds std: divide instead of multiplying
  std::vector<double> mu, r, log_norm;

  // T: the inputs' element type (the second argument is only its tag).
  template <typename T>
  Params(const ImportanceLogWeightsInputs& c, T)
      : B(c.B), N(c.N), D(c.D), K(c.K), J(c.K + c.Kq), mu(B * J * D), r(B * J * D), log_norm(B * J) {
    const T *mw = cdata<T>(c.mix_weights), *mm = cdata<T>(c.mix_mus), *ms = cdata<T>(c.mix_stds);
    const T *qw = cdata<T>(c.q_weights), *qm = cdata<T>(c.q_mus), *qs = cdata<T>(c.q_stds);
    // visit(b, j, m, s, w): every component's parameters in their input dtype.
    auto each = [&](auto&& visit) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = 0; j < J; ++j) {
          const bool target = j < K;
          const int64_t row = target ? b * K + j : b * c.Kq + (j - K);
          visit(b, j, (target ? mm : qm) + row * D, (target ? ms : qs) + row * D, target ? mw[row] : qw[row]);
        }
      }
    };
    each([&](int64_t b, int64_t j, const T* m, const T* s, T w) {
      double log_det = 0;
      double* mu_j = mu.data() + (b * J + j) * D;
      double* r_j = r.data() + (b * J + j) * D;
      for (int64_t d = 0; d < D; ++d) {
        const double sd = double(s[d]);
        mu_j[d] = double(m[d]);
        r_j[d] = 1.0 / sd;
        divide |= std::isinf(r_j[d]) && sd != 0.0;
        log_det += std::log(sd);
      }
      log_norm[b * J + j] = std::log(double(w)) - log_det;
    });
    if (divide) {
      each([&](int64_t b, int64_t j, const T*, const T* s, T) {
        for (int64_t d = 0; d < D; ++d) r[(b * J + j) * D + d] = double(s[d]);
      });
    }
  }

  const double* mu_of(int64_t b, int64_t j) const { return mu.data() + (b * J + j) * D; }
  const double* r_of(int64_t b, int64_t j) const { return r.data() + (b * J + j) * D; }
  // v / std_jd for the prepared row r of component j.
  double over_std(double v, const double* r, int64_t d) const { return divide ? v / r[d] : v * r[d]; }
  double z(double x, const double* m, const double* r, int64_t d) const { return over_std(x - m[d], r, d); }
};

// sum_{d < n} term(d) in four interleaved partial sums added pairwise: a
// fixed order, and four independent chains for the vectoriser.
template <typename F>
__attribute__((always_inline)) inline double sum4(int64_t n, F term) {
  double s[4] = {0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 4 <= n; d += 4) {
    for (int k = 0; k < 4; ++k) s[k] += term(d + k);
  }
  for (; d < n; ++d) s[d % 4] += term(d);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace importance_log_weights_cpu
}  // namespace fused_ops
