// \brief CPU kernel of fused_ops::importance_log_weights (the only CPU path).
//
// lw[b, i] = logsumexp_{j < K} lc_j - logsumexp_{j >= K} lc_j with the
// component log densities lc_j = log_norm_j - 0.5 sum_d ((x_d - mu_jd) / std_jd)^2
// (params.h).  Parallel over the B * N rows in fixed blocks of rows; every
// row is computed alone, in double (the squared distances in four
// interleaved partial sums, each log-sum-exp online: one exp per
// component), and rounded once, so results are bitwise the same for any
// thread count (not across the baseline and AVX2 + FMA clones, whose
// contractions differ).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <vector>

#include "cpu/importance_log_weights/params.h"
#include "cpu/vec_math.h"

namespace fused_ops {
namespace {

using importance_log_weights_cpu::Params;
using importance_log_weights_cpu::sum4;

// Rows [r0, r1): each row converted to double once, then per component a
// loop over d in four interleaved partial sums (vectorised across d).
// DIVIDE: Params::r holds std (a subnormal std somewhere: see params.h).
// Force-inlined into the ISA-specific entry points below.
template <typename T, bool DIVIDE>
FUSED_OPS_INLINE void rows_range(const ImportanceLogWeightsCall& c, const Params& p, int64_t r0, int64_t r1) {
  const int64_t N = c.N, D = c.D, K = c.K, J = p.J;
  const T* x = cdata<T>(c.x);
  T* lw = mdata<T>(c.log_weights);
  std::vector<double> xd(D);
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t b = row / N;
    const T* xi = x + row * D;
    for (int64_t d = 0; d < D; ++d) xd[d] = double(xi[d]);
    LogSumExp<double> lp = LogSumExp<double>::empty(), lq = LogSumExp<double>::empty();
    for (int64_t j = 0; j < J; ++j) {
      const double *m = p.mu_of(b, j), *r = p.r_of(b, j);
      const double sq = sum4(D, [&](int64_t d) {
        const double z = DIVIDE ? (xd[d] - m[d]) / r[d] : (xd[d] - m[d]) * r[d];
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
}

template <typename T, bool DIVIDE>
void rows_baseline(const ImportanceLogWeightsCall& c, const Params& p, int64_t r0, int64_t r1) {
  rows_range<T, DIVIDE>(c, p, r0, r1);
}

#if FUSED_OPS_HAVE_AVX2_CLONE
template <typename T, bool DIVIDE>
FUSED_OPS_TARGET_AVX2 void rows_avx2(const ImportanceLogWeightsCall& c, const Params& p, int64_t r0, int64_t r1) {
  rows_range<T, DIVIDE>(c, p, r0, r1);
}
#endif

template <typename T>
void forward_kernel(const ImportanceLogWeightsCall& c) {
  const Params p(c, T{});
  auto* rows = p.divide ? &rows_baseline<T, true> : &rows_baseline<T, false>;
#if FUSED_OPS_HAVE_AVX2_CLONE
  if (cpu::cpu_has_avx2()) rows = p.divide ? &rows_avx2<T, true> : &rows_avx2<T, false>;
#endif
  torch::stable::parallel_for(0, c.B * c.N, 256, [&](int64_t r0, int64_t r1) { rows(c, p, r0, r1); });
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
