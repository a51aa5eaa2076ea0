// \brief CPU kernel of fused_ops::importance_log_weights_backward (the only
// CPU path); the reference for the math of the CUDA backward.
//
// With g_i = dL/dlw_i (the upstream gradient), z_ijd = (x_id - mu_jd) / std_jd,
// the responsibilities r_ij = softmax over the target's components (j < K)
// and over the proposal's (j >= K) of lc_ij = log w_j - sum_d log std_jd -
// 0.5 sum_d z_ijd^2, and the coefficients a_ij = g_i r_ij (target) and
// a_ij = -g_i r_ij (proposal: lw = log p - log q):
//
//   grad_x_id   = -sum_j a_ij z_ijd / std_jd
//   grad_mu_jd  =  sum_i a_ij z_ijd / std_jd
//   grad_std_jd =  sum_i a_ij (z_ijd^2 - 1) / std_jd
//   grad_w_j    =  sum_i a_ij / w_j
//
// A row whose target (or proposal) densities are all -inf gets NaN
// responsibilities, as the reference's logsumexp backward gives.  Items are
// (problem, chunk of rows); chunks are fixed by N (never the thread count)
// and each problem's chunk partials (S1 = sum a z, S2 = sum a (z^2 - 1),
// S0 = sum a, in double) are merged in chunk order: bitwise the same for any
// number of threads.  All arithmetic in double.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/importance_log_weights/params.h"

namespace fused_ops {
namespace {

using importance_log_weights_cpu::Params;
using importance_log_weights_cpu::sum4;

// The softmax of lc[j0, j1) times `g`, into a[j0, j1): K - 1 exps, no log.
inline void scaled_softmax(const double* lc, double* a, int64_t j0, int64_t j1, double g) {
  double m = -INFINITY;
  for (int64_t j = j0; j < j1; ++j) m = nan_max(m, lc[j]);
  double sum = 0;
  for (int64_t j = j0; j < j1; ++j) {
    a[j] = rel_exp(lc[j], m);
    sum += a[j];
  }
  const double scale = m == -INFINITY ? double(NAN) : g / sum;
  for (int64_t j = j0; j < j1; ++j) a[j] *= scale;
}

template <typename T>
void backward_kernel(const ImportanceLogWeightsBackwardCall& c) {
  const Params p(c, T{});
  const int64_t B = c.B, N = c.N, D = c.D, K = c.K, J = p.J, JD = J * D;
  const int64_t chunk = std::max<int64_t>(256, (N + 63) / 64), C = (N + chunk - 1) / chunk;
  const int64_t stride = 2 * JD + J;  // S1 [J, D], S2 [J, D], S0 [J]
  const T* x = cdata<T>(c.x);
  const T* gl = cdata<T>(c.grad_lw);
  T* gx = mdata<T>(c.grad_x);
  std::vector<double> partials(B * C * stride);
  torch::stable::parallel_for(0, B * C, 1, [&](int64_t it0, int64_t it1) {
    std::vector<double> z(JD), lc(J), a(J), gxd(D);
    for (int64_t it = it0; it < it1; ++it) {
      const int64_t b = it / C, i0 = (it % C) * chunk, i1 = std::min(N, i0 + chunk);
      double* S1 = partials.data() + it * stride;
      double* S2 = S1 + JD;
      double* S0 = S2 + JD;
      std::fill(S1, S1 + stride, 0.0);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t row = b * N + i;
        const T* xi = x + row * D;
        for (int64_t j = 0; j < J; ++j) {
          const double *m = p.mu_of(b, j), *r = p.r_of(b, j);
          double* zj = z.data() + j * D;
          const double sq = sum4(D, [&](int64_t d) {
            const double v = p.z(double(xi[d]), m, r, d);
            zj[d] = v;
            return v * v;
          });
          lc[j] = p.log_norm[b * J + j] - 0.5 * sq;
        }
        const double g = double(gl[row]);
        scaled_softmax(lc.data(), a.data(), 0, K, g);
        scaled_softmax(lc.data(), a.data(), K, J, -g);
        std::fill(gxd.begin(), gxd.end(), 0.0);
        for (int64_t j = 0; j < J; ++j) {
          const double aj = a[j];
          const double* zj = z.data() + j * D;
          const double* r = p.r_of(b, j);
          double* s1 = S1 + j * D;
          double* s2 = S2 + j * D;
          S0[j] += aj;
          for (int64_t d = 0; d < D; ++d) {
            s1[d] += aj * zj[d];
            s2[d] += aj * (zj[d] * zj[d] - 1);
            gxd[d] -= p.over_std(aj * zj[d], r, d);
          }
        }
        T* gxi = gx + row * D;
        for (int64_t d = 0; d < D; ++d) gxi[d] = T(gxd[d]);
      }
    }
  });
  // Per problem: chunk partials in chunk order, then scaled into the gradients.
  const T *mw = cdata<T>(c.mix_weights), *qw = cdata<T>(c.q_weights);
  T *g_mw = mdata<T>(c.grad_mix_weights), *g_mm = mdata<T>(c.grad_mix_mus), *g_ms = mdata<T>(c.grad_mix_stds);
  T *g_qw = mdata<T>(c.grad_q_weights), *g_qm = mdata<T>(c.grad_q_mus), *g_qs = mdata<T>(c.grad_q_stds);
  torch::stable::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<double> total(stride);
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(total.begin(), total.end(), 0.0);
      for (int64_t k = 0; k < C; ++k) {
        const double* part = partials.data() + (b * C + k) * stride;
        for (int64_t e = 0; e < stride; ++e) total[e] += part[e];
      }
      for (int64_t j = 0; j < J; ++j) {
        const bool target = j < K;
        const int64_t row = target ? b * K + j : b * c.Kq + (j - K);
        const double* r = p.r_of(b, j);
        T* gm = (target ? g_mm : g_qm) + row * D;
        T* gs = (target ? g_ms : g_qs) + row * D;
        for (int64_t d = 0; d < D; ++d) {
          gm[d] = T(p.over_std(total[j * D + d], r, d));
          gs[d] = T(p.over_std(total[JD + j * D + d], r, d));
        }
        (target ? g_mw : g_qw)[row] = T(total[2 * JD + j] / double((target ? mw : qw)[row]));
      }
    }
  });
}

ImportanceLogWeightsGrads importance_log_weights_backward_cpu(const std::optional<Tensor>& grad_log_weights,
    const Tensor& samples,
                                                              const Tensor& mix_weights, const Tensor& mix_mus,
                                                              const Tensor& mix_stds, const Tensor& q_weights,
                                                              const Tensor& q_mus, const Tensor& q_stds) {
  ImportanceLogWeightsBackwardCall c(grad_log_weights, samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus,
                                     q_stds);
  if (c.B == 0) return c.result();
  if (!c.has_grad) {
    c.zero_all();
    return c.result();
  }
  dispatch_float(c.x.scalar_type(), [&](auto zero) { backward_kernel<decltype(zero)>(c); });
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("importance_log_weights_backward", TORCH_BOX(&importance_log_weights_backward_cpu));
}

}  // namespace fused_ops
