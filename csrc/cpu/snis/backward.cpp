// \brief CPU kernel of fused_ops::snis_backward (the only CPU path).
//
// With w = exp(log_norm_weights) (renormalised: w_j = exp(lnw_j) / W,
// W = sum_j exp(lnw_j), which is 1 up to the forward's rounding) and
// Q = sum_j w_j^2 = 1 / ess, the gradient to the unnormalised log weights is
//   g_j = gL_j - w_j sum_i gL_i + gE 2 w_j (Q - w_j) / Q^2 + gZ w_j
//         + w_j sum_d [ gM_d (x_jd - mean_d) + gV_d ((x_jd - mean_d)^2 - var_d) ]
// and to the samples  gx_jd = w_j (gM_d + 2 gV_d (x_jd - mean_d)).
// Q is recomputed from the log weights in double rather than taken from the
// rounded ess: near a dominant sample Q - w_j cancels.
//
// Two passes over the same fixed chunks as the forward (forward.cpp): the
// per-problem sums (sum gL, W, Q) as chunk partials merged in chunk order,
// then the per-element gradients; bitwise the same for any thread count.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "snis.h"

namespace fused_ops {
namespace {

constexpr int64_t kChunk = 4096;

template <typename T>
void snis_backward_kernel(const SnisBackwardCall& c) {
  const int64_t B = c.B, N = c.N, D = c.D, C = (N + kChunk - 1) / kChunk, items = B * C;
  const T* lnw = cdata<T>(c.lnw);
  const T* gL = cdata_or_null<T>(c.g_lw);
  const T* gE = cdata_or_null<T>(c.g_ess);
  const T* gZ = cdata_or_null<T>(c.g_logz);
  const T* gM = cdata_or_null<T>(c.g_mean);
  const T* gV = cdata_or_null<T>(c.g_var);
  const T* x = c.has_samples ? cdata<T>(c.x) : nullptr;
  const T* mean = c.has_samples ? cdata<T>(c.mean) : nullptr;
  const T* var = c.variance.defined() ? cdata<T>(c.variance) : nullptr;
  T* glw = mdata<T>(c.grad_log_weights);
  T* gx = c.has_samples ? mdata<T>(c.grad_samples) : nullptr;

  std::vector<double> part(items * 3);
  torch::stable::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t b = it / C, n0 = (it % C) * kChunk, n1 = std::min(N, n0 + kChunk);
      double sg = 0, w = 0, q = 0;
      for (int64_t n = n0; n < n1; ++n) {
        const double e = std::exp(double(lnw[b * N + n]));
        if (gL) sg += double(gL[b * N + n]);
        w += e;
        q += e * e;
      }
      part[it * 3] = sg, part[it * 3 + 1] = w, part[it * 3 + 2] = q;
    }
  });
  std::vector<double> sum_g(B), total_w(B), q(B);
  for (int64_t b = 0; b < B; ++b) {
    double sg = 0, w = 0, qq = 0;
    for (int64_t k = 0; k < C; ++k) {
      const double* p = part.data() + (b * C + k) * 3;
      sg += p[0], w += p[1], qq += p[2];
    }
    sum_g[b] = sg, total_w[b] = w, q[b] = qq / (w * w);
  }

  torch::stable::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t b = it / C, n0 = (it % C) * kChunk, n1 = std::min(N, n0 + kChunk);
      const double Q = q[b], ge = gE ? double(gE[b]) : 0.0, gz = gZ ? double(gZ[b]) : 0.0;
      const T* mu = mean ? mean + b * D : nullptr;
      for (int64_t n = n0; n < n1; ++n) {
        const int64_t j = b * N + n;
        const double w = std::exp(double(lnw[j])) / total_w[b];
        double g = (gL ? double(gL[j]) : 0.0) - w * sum_g[b] + w * gz;
        if (gE) g += ge * 2.0 * w * (Q - w) / (Q * Q);
        if (x) {
          const T* xj = x + j * D;
          T* gxj = gx + j * D;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            const double z = double(xj[d]) - double(mu[d]);
            const double gm = gM ? double(gM[b * D + d]) : 0.0, gv = gV ? double(gV[b * D + d]) : 0.0;
            dot += gm * z;
            if (gV) dot += gv * (z * z - double(var[b * D + d]));
            gxj[d] = T(w * (gm + 2.0 * gv * z));
          }
          g += w * dot;
        }
        glw[j] = T(g);
      }
    }
  });
}

}  // namespace

SnisGrads snis_backward_cpu(const std::optional<Tensor>& grad_log_norm_weights,
                            const std::optional<Tensor>& grad_ess, const std::optional<Tensor>& grad_log_evidence,
                            const std::optional<Tensor>& grad_mean, const std::optional<Tensor>& grad_variance,
                            const Tensor& log_norm_weights, const std::optional<Tensor>& samples,
                            const Tensor& mean, const Tensor& variance) {
  SnisBackwardCall c(grad_log_norm_weights, grad_ess, grad_log_evidence, grad_mean, grad_variance,
                     log_norm_weights, samples, mean, variance);
  if (c.B == 0) return c.result();
  dispatch_float(c.lnw.scalar_type(), [&](auto zero) { snis_backward_kernel<decltype(zero)>(c); });
  return c.result();
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("snis_backward", TORCH_BOX(&snis_backward_cpu));
}

}  // namespace fused_ops
