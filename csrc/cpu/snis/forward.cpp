// \brief CPU kernel of fused_ops::snis (the only CPU path).
//
// Work is cut into items of (problem b, chunk c): kChunk consecutive weights
// of one problem, so a batch of small problems runs in parallel over
// problems and one large problem in parallel over its chunks.  Chunk size
// is fixed (never the thread count), and every per-problem reduction merges
// the chunk partials in chunk order: results are bitwise the same for any
// number of threads.  All sums are in double, for float32 inputs too.
//
// Passes (each parallel over items, then a merge per problem):
//   1. log weights: per chunk the maximum, then sum exp(lw - max) and
//      sum exp(2 (lw - max)) (SnisStats); merged: logsumexp, ESS, evidence.
//   2. normalised log weights written (lw - logsumexp, in double, rounded
//      once); with samples, per chunk sum_i w_i x_i [D]; merged: the mean.
//   3. moments=True: per chunk sum_i w_i (x_i - mean)^2 [D] about the
//      merged mean (no E[x^2] - mean^2 cancellation); merged: the variance.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/snis_partials.h"
#include "snis.h"

namespace fused_ops {
namespace {

constexpr int64_t kChunk = 4096;  // weights per partial

template <typename T>
void snis_kernel(const SnisCall& c) {
  const int64_t B = c.B, N = c.N, D = c.D, C = (N + kChunk - 1) / kChunk, items = B * C;
  const T* lw = cdata<T>(c.lw);
  const T* x = c.has_samples ? cdata<T>(c.x) : nullptr;
  T* lnw = mdata<T>(c.log_norm_weights);

  // Pass 1: chunk statistics, merged per problem in chunk order.
  std::vector<SnisStats> part(items);
  torch::stable::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t b = it / C, n0 = (it % C) * kChunk, n1 = std::min(N, n0 + kChunk);
      const T* v = lw + b * N;
      double m = -INFINITY;
      for (int64_t n = n0; n < n1; ++n) m = nan_max(m, double(v[n]));
      double s = 0, s2 = 0;
      for (int64_t n = n0; n < n1; ++n) {
        const double e = snis_weight(double(v[n]), m);
        s += e;
        s2 += e * e;
      }
      part[it] = {m, s, s2};
    }
  });
  std::vector<double> lse(B);
  T* ess = mdata<T>(c.ess);
  T* logz = mdata<T>(c.log_evidence);
  const double log_n = std::log(double(N));
  torch::stable::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      SnisStats t = SnisStats::empty();
      for (int64_t k = 0; k < C; ++k) t = SnisStats::merge(t, part[b * C + k]);
      lse[b] = t.log_sum();
      ess[b] = T(t.ess());
      logz[b] = T(lse[b] - log_n);
    }
  });

  // Pass 2 (and 3): normalised log weights; weighted sums of the samples per chunk.
  std::vector<double> wsum(c.has_samples ? items * D : 0), mean(c.has_samples ? B * D : 0);
  auto merge_d = [&](auto&& finish) {  // per problem and d: sum over chunks in chunk order
    torch::stable::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t k = 0; k < C; ++k) acc += wsum[(b * C + k) * D + d];
          finish(b, d, acc);
        }
      }
    });
  };
  torch::stable::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<double> acc(D);
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t b = it / C, n0 = (it % C) * kChunk, n1 = std::min(N, n0 + kChunk);
      const double l = lse[b];
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t n = n0; n < n1; ++n) {
        const double ln = double(lw[b * N + n]) - l;
        lnw[b * N + n] = T(ln);
        if (!x) continue;
        const double w = std::exp(ln);
        const T* xi = x + (b * N + n) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * double(xi[d]);
      }
      if (x) std::copy(acc.begin(), acc.end(), wsum.begin() + it * D);
    }
  });
  if (!c.has_samples) return;
  T* mean_out = mdata<T>(c.mean);
  merge_d([&](int64_t b, int64_t d, double v) {
    mean[b * D + d] = v;
    mean_out[b * D + d] = T(v);
  });
  if (!c.moments) return;
  torch::stable::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<double> acc(D);
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t b = it / C, n0 = (it % C) * kChunk, n1 = std::min(N, n0 + kChunk);
      const double l = lse[b];
      const double* mu = mean.data() + b * D;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t n = n0; n < n1; ++n) {
        const double w = std::exp(double(lw[b * N + n]) - l);
        const T* xi = x + (b * N + n) * D;
        for (int64_t d = 0; d < D; ++d) {
          const double z = double(xi[d]) - mu[d];
          acc[d] += w * z * z;
        }
      }
      std::copy(acc.begin(), acc.end(), wsum.begin() + it * D);
    }
  });
  T* var_out = mdata<T>(c.variance);
  merge_d([&](int64_t b, int64_t d, double v) { var_out[b * D + d] = T(v); });
}

}  // namespace

SnisResult snis_cpu(const Tensor& log_weights, const std::optional<Tensor>& samples, bool moments) {
  SnisCall c(log_weights, samples, moments);
  if (c.B == 0) return c.result();
  dispatch_float(c.lw.scalar_type(), [&](auto zero) { snis_kernel<decltype(zero)>(c); });
  return c.result();
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("snis", TORCH_BOX(&snis_cpu));
}

}  // namespace fused_ops
