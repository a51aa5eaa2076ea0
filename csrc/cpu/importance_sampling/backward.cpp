// \brief CPU kernel of fused_ops::importance_sampling_backward (the only CPU
// path); the reference for the math of the CUDA backward.
//
// With w_i = exp(log_weights_i) (the saved, normalised forward output) and
// lw_i = log_p_i - log_q_i the unnormalised log weights, the upstream
// gradients (gM [D], gE [], gL [N]; absent ones are zero) give
//
//   g_i = dL/dlw_i = gL_i - w_i * sum_j gL_j + w_i * (x_i - mean) . gM
//                    + gE * 2 w_i (S - w_i) / S^2,   S = sum_j w_j^2 = 1 / ess
//
// and, with responsibilities r_ik = softmax_k(log w_k + log N_k(x_i)) (recomputed
// here, never stored), z_ikd = (x_id - mu_kd) / std_kd, zq_id = (x_id - q_mu_d) / q_std_d:
//
//   grad_x_id      = g_i * zq_id / q_std_d - sum_k g_i r_ik z_ikd / std_kd + w_i gM_d
//   grad_mix_mus   = sum_i g_i r_ik z_ikd / std_kd
//   grad_mix_stds  = sum_i g_i r_ik (z_ikd^2 - 1) / std_kd
//   grad_mix_wts_k = sum_i g_i r_ik / mix_weights_k
//   grad_q_mu      = -sum_i g_i zq_id / q_std_d
//   grad_q_std     = -sum_i g_i (zq_id^2 - 1) / q_std_d
//
// Two passes over the samples, both cut into fixed chunks (a function of N
// only, never of the thread count) whose partials are merged in chunk order,
// so results are bitwise the same for any number of threads: first the chunk
// sums of gL, w and w^2, then the per-sample work and the chunk sums of the parameter
// gradients.  Per-sample arithmetic and all sums run in double.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/logsumexp.h"
#include "cpu/vec_math.h"
#include "importance_sampling.h"

namespace fused_ops {
namespace {

template <typename T>
struct BackwardArgs {
  const T* grad_mean;  // [D] or nullptr (zero)
  const T* grad_ess;   // []  or nullptr
  const T* grad_lw;    // [N] or nullptr
  const T* x;          // [N, D]
  const T* mix_weights;
  const T* mean;       // [D] forward output
  const T* log_weights;  // [N] forward output (normalised)
  int64_t N, D, K;
  T* grad_x;  // [N, D]
};

// What pass 2 reads: the forward's parameters in double (rows 0..K-1 of mu /
// inv_std are the mixture components, row K the proposal), the upstream
// gradients and the scalars of pass 1.
struct Pass2Consts {
  const double *mu, *inv_std, *log_norm, *gM, *mean;
  double c, inv_sum_w, S, ess_coef;
  int64_t chunk;
};

// Layout of one chunk's partials: S1 [(K+1)*D] = sum g r z, S2 [(K+1)*D] =
// sum g r (z^2 - 1) (row K: the proposal, with r = 1), S0 [K] = sum g r.
inline int64_t partial_stride(int64_t K, int64_t D) { return 2 * (K + 1) * D + K; }

// sum_{d < n} term(d) as four interleaved partial sums (d mod 4), added
// pairwise at the end: a fixed order, and four independent chains that the
// compiler turns into one vector accumulator where one long chain of
// dependent adds would bound the loop by the add latency.
template <typename F>
FUSED_OPS_INLINE double sum4(int64_t n, F term) {
  double s[4] = {0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 4 <= n; d += 4) {
    for (int j = 0; j < 4; ++j) s[j] += term(d + j);
  }
  for (; d < n; ++d) s[d % 4] += term(d);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Pass 2 over chunks [c0, c1): every sample's grad_x and the chunk partials.
// FUSED_OPS_INLINE: compiled once per instruction set (the AVX2 clone below
// vectorises the loops over D four doubles wide).
template <typename T>
FUSED_OPS_INLINE void backward_chunks(const BackwardArgs<T>& a, const Pass2Consts& q,
                                      double* partials, int64_t c0, int64_t c1) {
  using acc_t = double;
  const int64_t N = a.N, D = a.D, K = a.K, KD1 = (K + 1) * D, stride = partial_stride(K, D);
  const acc_t *mu = q.mu, *inv_std = q.inv_std, *log_norm = q.log_norm, *gM = q.gM, *mean = q.mean;
  std::vector<acc_t> z(KD1), coef(K + 1), gxd(D);
  for (int64_t ch = c0; ch < c1; ++ch) {
    acc_t* S1 = partials + ch * stride;
    acc_t* S2 = S1 + KD1;
    acc_t* S0 = S2 + KD1;
    std::fill(S1, S1 + stride, 0.0);
    const int64_t i1 = std::min(N, (ch + 1) * q.chunk);
    for (int64_t i = ch * q.chunk; i < i1; ++i) {
      const T* xi = a.x + i * D;
      // z for every component and the proposal; log densities of the components.
      acc_t m = -INFINITY;
      for (int64_t k = 0; k <= K; ++k) {
        const acc_t *mk = mu + k * D, *sk = inv_std + k * D;
        acc_t* zk = z.data() + k * D;
        const acc_t sq = sum4(D, [&](int64_t d) {
          const acc_t v = (acc_t(xi[d]) - mk[d]) * sk[d];
          zk[d] = v;
          return v * v;
        });
        if (k < K) {
          coef[k] = acc_t(-0.5) * sq + log_norm[k];
          m = nan_max(m, coef[k]);
        }
      }
      const acc_t w = std::exp(acc_t(a.log_weights[i]));
      const acc_t dot =
          a.grad_mean ? sum4(D, [&](int64_t d) { return (acc_t(xi[d]) - mean[d]) * gM[d]; }) : 0.0;
      acc_t g = (a.grad_lw ? acc_t(a.grad_lw[i]) : 0.0) - w * q.c + w * dot;
      if (a.grad_ess) {
        const acc_t wn = w * q.inv_sum_w;
        g += q.ess_coef * wn * (q.S - wn);
      }
      // coef[k] = g * r_ik (k < K), coef[K] = g, with the responsibilities
      // r_ik = exp(coef_k - m) / sum_j exp(coef_j - m): K - 1 exps (the
      // maximum's is 1) and no log, where exp(coef_k - logsumexp) costs
      // 2K + 1 transcendentals.  A sample whose densities are all -inf keeps
      // logsumexp's answer, exp(-inf - -inf) = NaN, as the reference's
      // backward of logsumexp gives.
      acc_t sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        coef[k] = rel_exp(coef[k], m);
        sum += coef[k];
      }
      const acc_t scale = m == -INFINITY ? acc_t(NAN) : g / sum;
      for (int64_t k = 0; k < K; ++k) coef[k] *= scale;
      coef[K] = g;
      for (int64_t k = 0; k < K; ++k) S0[k] += coef[k];
      for (int64_t k = 0; k <= K; ++k) {
        const acc_t ck = coef[k];
        const acc_t* zk = z.data() + k * D;
        acc_t* s1 = S1 + k * D;
        acc_t* s2 = S2 + k * D;
        for (int64_t d = 0; d < D; ++d) {
          s1[d] += ck * zk[d];
          s2[d] += ck * (zk[d] * zk[d] - 1);
        }
      }
      // grad_x row, one component at a time so the loops over D vectorise
      // (each element still subtracts the components in order k = 0..K-1).
      for (int64_t d = 0; d < D; ++d) gxd[d] = g * z[K * D + d] * inv_std[K * D + d] + w * gM[d];
      for (int64_t k = 0; k < K; ++k) {
        const acc_t ck = coef[k];
        const acc_t *zk = z.data() + k * D, *sk = inv_std + k * D;
        for (int64_t d = 0; d < D; ++d) gxd[d] -= ck * zk[d] * sk[d];
      }
      T* gx = a.grad_x + i * D;
      for (int64_t d = 0; d < D; ++d) gx[d] = T(gxd[d]);
    }
  }
}

template <typename T>
void backward_chunks_baseline(const BackwardArgs<T>& a, const Pass2Consts& q, double* partials,
                              int64_t c0, int64_t c1) {
  backward_chunks<T>(a, q, partials, c0, c1);
}
#if FUSED_OPS_HAVE_AVX2_CLONE
template <typename T>
FUSED_OPS_TARGET_AVX2 void backward_chunks_avx2(const BackwardArgs<T>& a, const Pass2Consts& q,
                                                double* partials, int64_t c0, int64_t c1) {
  backward_chunks<T>(a, q, partials, c0, c1);
}
#endif

template <typename T>
void importance_sampling_backward_kernel(const BackwardArgs<T>& a, const T* mix_mus,
                                         const T* mix_stds, const T* q_mu, const T* q_std,
                                         T* grad_mix_weights, T* grad_mix_mus, T* grad_mix_stds,
                                         T* grad_q_mu, T* grad_q_std) {
  using acc_t = double;
  const int64_t N = a.N, D = a.D, K = a.K;
  const int64_t KD1 = (K + 1) * D;
  // Rows 0..K-1 of mu / inv_std are the mixture components, row K the proposal.
  std::vector<acc_t> mu(KD1), inv_std(KD1), log_norm(K + 1);
  for (int64_t k = 0; k <= K; ++k) {
    const T* m = k < K ? mix_mus + k * D : q_mu;
    const T* sd = k < K ? mix_stds + k * D : q_std;
    acc_t log_det = 0;
    for (int64_t d = 0; d < D; ++d) {
      mu[k * D + d] = m[d];
      inv_std[k * D + d] = acc_t(1) / acc_t(sd[d]);
      log_det += std::log(acc_t(sd[d]));
    }
    log_norm[k] = (k < K ? std::log(acc_t(a.mix_weights[k])) : 0.0) - log_det;
  }
  std::vector<acc_t> gM(D, 0.0), mean(D);
  for (int64_t d = 0; d < D; ++d) {
    mean[d] = a.mean[d];
    if (a.grad_mean) gM[d] = a.grad_mean[d];
  }
  const acc_t gE = a.grad_ess ? acc_t(*a.grad_ess) : 0.0;

  // Fixed chunks: at least 256 samples, at most 64 chunks (bounds the partials).
  const int64_t chunk = std::max<int64_t>(256, (N + 63) / 64);
  const int64_t num_chunks = (N + chunk - 1) / chunk;

  // Pass 1: c = sum_i gL_i and, for the ESS gradient, sum_i w_i and sum_i w_i^2.
  acc_t c = 0, sum_w = 0, sum_w2 = 0;
  if (a.grad_lw || a.grad_ess) {
    std::vector<acc_t> sums(3 * num_chunks);
    torch::stable::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t ch = c0; ch < c1; ++ch) {
        const int64_t i1 = std::min(N, (ch + 1) * chunk);
        acc_t s = 0, sw = 0, sw2 = 0;
        for (int64_t i = ch * chunk; i < i1; ++i) {
          if (a.grad_lw) s += a.grad_lw[i];
          if (a.grad_ess) {
            const acc_t w = std::exp(acc_t(a.log_weights[i]));
            sw += w;
            sw2 += w * w;
          }
        }
        sums[3 * ch] = s;
        sums[3 * ch + 1] = sw;
        sums[3 * ch + 2] = sw2;
      }
    });
    for (int64_t ch = 0; ch < num_chunks; ++ch) {
      c += sums[3 * ch];
      sum_w += sums[3 * ch + 1];
      sum_w2 += sums[3 * ch + 2];
    }
  }
  // d ess / d lw_i = 2 w_i (S - w_i) / S^2 with S = sum_j w_j^2 = 1 / ess.
  // Near a dominant sample S - w_i cancels, so S and w_i must be consistent:
  // both come from log_weights here, renormalised in double (sum_i w_i is 1
  // only up to the float rounding of log_weights), never from the separately
  // rounded forward output ess.
  const acc_t inv_sum_w = a.grad_ess ? acc_t(1) / sum_w : 0.0;
  const acc_t S = sum_w2 * inv_sum_w * inv_sum_w;
  const acc_t ess_coef = a.grad_ess ? gE * 2 / (S * S) : 0.0;

  // Pass 2: per-sample work and chunk partials (backward_chunks).
  const int64_t stride = partial_stride(K, D);
  std::vector<acc_t> partials(num_chunks * stride);
  const Pass2Consts consts{mu.data(), inv_std.data(), log_norm.data(), gM.data(), mean.data(),
                           c, inv_sum_w, S, ess_coef, chunk};
  auto chunks = &backward_chunks_baseline<T>;
#if FUSED_OPS_HAVE_AVX2_CLONE
  if (cpu::cpu_has_avx2()) chunks = &backward_chunks_avx2<T>;
#endif
  torch::stable::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    chunks(a, consts, partials.data(), c0, c1);
  });

  // Merge the chunk partials in chunk order.
  std::vector<acc_t> total(stride, 0.0);
  for (int64_t ch = 0; ch < num_chunks; ++ch) {
    const acc_t* part = partials.data() + ch * stride;
    for (int64_t j = 0; j < stride; ++j) total[j] += part[j];
  }
  const acc_t* S1 = total.data();
  const acc_t* S2 = S1 + KD1;
  const acc_t* S0 = S2 + KD1;
  for (int64_t k = 0; k < K; ++k) {
    grad_mix_weights[k] = T(S0[k] / acc_t(a.mix_weights[k]));
    for (int64_t d = 0; d < D; ++d) {
      grad_mix_mus[k * D + d] = T(S1[k * D + d] * inv_std[k * D + d]);
      grad_mix_stds[k * D + d] = T(S2[k * D + d] * inv_std[k * D + d]);
    }
  }
  for (int64_t d = 0; d < D; ++d) {
    grad_q_mu[d] = T(-S1[K * D + d] * inv_std[K * D + d]);
    grad_q_std[d] = T(-S2[K * D + d] * inv_std[K * D + d]);
  }
}

}  // namespace

ImportanceSamplingGrads importance_sampling_backward_cpu(
    const std::optional<Tensor>& grad_weighted_mean, const std::optional<Tensor>& grad_ess,
    const std::optional<Tensor>& grad_log_weights, const Tensor& samples,
    const Tensor& mix_weights, const Tensor& mix_mus, const Tensor& mix_stds, const Tensor& q_mu,
    const Tensor& q_std, const Tensor& weighted_mean, const Tensor& log_weights) {
  ImportanceSamplingBackwardCall c(grad_weighted_mean, grad_ess, grad_log_weights, samples,
                                   mix_weights, mix_mus, mix_stds, q_mu, q_std, weighted_mean,
                                   log_weights);
  dispatch_float(samples.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const BackwardArgs<T> args{cdata_or_null<T>(c.grad_mean),
                               cdata_or_null<T>(c.grad_ess),
                               cdata_or_null<T>(c.grad_lw),
                               cdata<T>(c.x),
                               cdata<T>(c.mix_weights),
                               cdata<T>(c.weighted_mean),
                               cdata<T>(c.log_weights),
                               c.N,
                               c.D,
                               c.K,
                               mdata<T>(c.grad_x)};
    importance_sampling_backward_kernel<T>(
        args, cdata<T>(c.mix_mus), cdata<T>(c.mix_stds),
        cdata<T>(c.q_mu), cdata<T>(c.q_std),
        mdata<T>(c.grad_mix_weights), mdata<T>(c.grad_mix_mus),
        mdata<T>(c.grad_mix_stds), mdata<T>(c.grad_q_mu),
        mdata<T>(c.grad_q_std));
  });
  return c.result();
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("importance_sampling_backward", TORCH_BOX(&importance_sampling_backward_cpu));
}

}  // namespace fused_ops
