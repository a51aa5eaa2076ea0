// CPU kernel of fused_ops::importance_sampling.
//
// Samples are cut into fixed-size chunks (independent of the thread count);
// each chunk yields a partial (max, sum-exp, sum-exp^2, weighted sum of x) and
// the partials are merged in chunk order, so the result is bitwise the same for
// any number of threads.  Cross-sample sums accumulate in double.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/logsumexp.h"
#include "cpu/vec_math.h"
#include "importance_sampling.h"

namespace fused_ops {
namespace {

constexpr int64_t kChunk = 256;  // samples per partial; fixed for determinism
using cpu::kLanes;
using cpu::Lanes;

template <typename scalar_t>
void importance_sampling_kernel(const scalar_t* x, const scalar_t* mix_weights,
                                const scalar_t* mix_mus, const scalar_t* mix_stds,
                                const scalar_t* q_mu, const scalar_t* q_std, int64_t N, int64_t D,
                                int64_t K, scalar_t* weighted_mean, scalar_t* ess,
                                scalar_t* log_weights) {
  using acc_t = double;
  using V = Lanes<scalar_t>;
  // Row K of mu / inv_std is the proposal, so one loop handles all K + 1
  // densities.  1/std turns the divide of the reference into a multiply;
  // log_norm = log w_k - sum_d log std_kd (proposal: -sum_d log q_std_d).
  std::vector<scalar_t> mu((K + 1) * D), inv_std((K + 1) * D), log_norm(K + 1);
  for (int64_t k = 0; k <= K; ++k) {
    const scalar_t* m = k < K ? mix_mus + k * D : q_mu;
    const scalar_t* sd = k < K ? mix_stds + k * D : q_std;
    acc_t log_det = 0;
    for (int64_t d = 0; d < D; ++d) {
      mu[k * D + d] = m[d];
      inv_std[k * D + d] = scalar_t(1) / sd[d];
      log_det += std::log(acc_t(sd[d]));
    }
    log_norm[k] = scalar_t((k < K ? std::log(acc_t(mix_weights[k])) : 0.0) - log_det);
  }

  const int64_t num_chunks = (N + kChunk - 1) / kChunk;
  // Per chunk: [max, sum exp(lw - max), sum exp(2 (lw - max)), sum exp(lw - max) x[0..D)].
  const int64_t stride = D + 3;
  std::vector<acc_t> partials(num_chunks * stride);

  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    // kLanes samples side by side: xt[d, :] holds x[., d] of a block of rows,
    // dens[k] their log densities, so the arithmetic runs on whole vectors.
    std::vector<scalar_t> xt(D * kLanes);
    std::vector<V> dens(K + 1);
    alignas(64) scalar_t lane_buf[kLanes];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * kChunk, i1 = std::min(N, i0 + kChunk);
      // Pass 1: unnormalised log weights of the chunk, stored in the output.
      for (int64_t b = i0; b < i1; b += kLanes) {
        const int lanes = int(std::min<int64_t>(kLanes, i1 - b));
        for (int s = 0; s < kLanes; ++s) {
          const scalar_t* row = x + (b + std::min(s, lanes - 1)) * D;  // pad with a valid row
          for (int64_t d = 0; d < D; ++d) xt[d * kLanes + s] = row[d];
        }
        for (int64_t k = 0; k <= K; ++k) {
          const scalar_t* m = mu.data() + k * D;
          const scalar_t* r = inv_std.data() + k * D;
          V acc = {};
          for (int64_t d = 0; d < D; ++d) {
            const V z = (cpu::load_lanes(xt.data() + d * kLanes) - m[d]) * r[d];
            acc += z * z;
          }
          dens[k] = scalar_t(-0.5) * acc + log_norm[k];
        }
        // log p = logsumexp over components: the max first, then one exp each.
        V max = dens[0];
        for (int64_t k = 1; k < K; ++k) max = cpu::nan_max(max, dens[k]);
        V sum = {};
        for (int64_t k = 0; k < K; ++k) sum += cpu::rel_exp(dens[k], max);
        cpu::store_lanes(lane_buf, V((max + cpu::log(sum)) - dens[K]));
        std::memcpy(log_weights + b, lane_buf, lanes * sizeof(scalar_t));
      }
      scalar_t chunk_max = -INFINITY;
      for (int64_t i = i0; i < i1; ++i) chunk_max = nan_max(chunk_max, log_weights[i]);
      // Pass 2 (chunk is cache-hot): weights relative to the chunk maximum.
      acc_t* part = partials.data() + c * stride;
      acc_t* wsum = part + 3;
      acc_t s = 0, t = 0;
      for (int64_t b = i0; b < i1; b += kLanes) {
        const int lanes = int(std::min<int64_t>(kLanes, i1 - b));
        for (int j = 0; j < kLanes; ++j) lane_buf[j] = j < lanes ? log_weights[b + j] : chunk_max;
        cpu::store_lanes(lane_buf, cpu::rel_exp(cpu::load_lanes(lane_buf), V{} + chunk_max));
        for (int j = 0; j < lanes; ++j) {
          const acc_t e = lane_buf[j];
          s += e;
          t += e * e;
          const scalar_t* xi = x + (b + j) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) wsum[d] += e * acc_t(xi[d]);
        }
      }
      part[0] = chunk_max;
      part[1] = s;
      part[2] = t;
    }
  });

  // Merge the chunk partials in order.
  LogSumExp<acc_t> total = LogSumExp<acc_t>::empty();
  for (int64_t c = 0; c < num_chunks; ++c) {
    total = LogSumExp<acc_t>::merge(total, {partials[c * stride], partials[c * stride + 1]});
  }
  std::vector<acc_t> wsum(D, 0.0);
  acc_t sum_sq = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const acc_t* part = partials.data() + c * stride;
    const acc_t scale = rel_exp(part[0], total.max);
    sum_sq += part[2] * scale * scale;
    for (int64_t d = 0; d < D; ++d) wsum[d] += part[3 + d] * scale;
  }
  for (int64_t d = 0; d < D; ++d) weighted_mean[d] = scalar_t(wsum[d] / total.sum);
  // sum_i w_i^2 = sum_sq / total.sum^2 with w_i = exp(lw_i - max) / total.sum.
  *ess = scalar_t(total.sum * total.sum / sum_sq);

  const scalar_t log_norm_const = scalar_t(total.value());
  at::parallel_for(0, N, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) log_weights[i] -= log_norm_const;
  });
}

}  // namespace

ImportanceSamplingResult importance_sampling_cpu(const at::Tensor& samples,
                                                 const at::Tensor& mix_weights,
                                                 const at::Tensor& mix_mus,
                                                 const at::Tensor& mix_stds,
                                                 const at::Tensor& q_mu, const at::Tensor& q_std) {
  const auto [N, D, K] =
      check_importance_sampling_args(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std);
  const auto x = samples.contiguous(), w = mix_weights.contiguous(), mu = mix_mus.contiguous(),
             sd = mix_stds.contiguous(), qm = q_mu.contiguous(), qs = q_std.contiguous();
  auto weighted_mean = at::empty({D}, samples.options());
  auto ess = at::empty({}, samples.options());
  auto log_weights = at::empty({N}, samples.options());
  AT_DISPATCH_FLOATING_TYPES(samples.scalar_type(), "importance_sampling_cpu", [&] {
    importance_sampling_kernel<scalar_t>(
        x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), mu.data_ptr<scalar_t>(),
        sd.data_ptr<scalar_t>(), qm.data_ptr<scalar_t>(), qs.data_ptr<scalar_t>(), N, D, K,
        weighted_mean.data_ptr<scalar_t>(), ess.data_ptr<scalar_t>(),
        log_weights.data_ptr<scalar_t>());
  });
  return {weighted_mean, ess, log_weights};
}

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) { m.impl("importance_sampling", &importance_sampling_cpu); }

}  // namespace fused_ops
