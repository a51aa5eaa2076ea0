// \brief CPU kernel of fused_ops::importance_sampling (the only CPU path).
//
// Samples are cut into fixed-size chunks (independent of the thread count);
// each chunk yields a partial (max, sum-exp, sum-exp^2, weighted sum of x) and
// the partials are merged in chunk order, so the result is bitwise the same for
// any number of threads.  Within a chunk, sums run in SIMD-lane partial sums
// (each over at most chunk / lanes samples); lanes and chunks are added in double.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "common/logsumexp.h"
#include "cpu/vec_math.h"
#include "importance_sampling.h"

namespace fused_ops {
namespace {

constexpr int64_t kMaxChunk = 256;  // samples per partial (see `chunk` below)

template <typename T>
struct ChunkArgs {
  const T* x;
  int64_t N, D, K, chunk;
  const T* mu;        // [K + 1, D], row K: the proposal
  const T* inv_std;   // [K + 1, D]: 1/std, or std itself when `divide` (see below)
  const T* log_norm;  // [K + 1]
  T* log_weights;     // [N], unnormalised here
  double* partials;   // [num_chunks, D + 3]
};

// Chunks [c0, c1): each chunk's unnormalised log weights and its partial
// [max, sum exp(lw - max), sum exp(2 (lw - max)), sum exp(lw - max) x[0..D)].
// Samples sit in SIMD lanes of B bytes: xt[d, i] = x[i0 + i, d], dens[k, i] is
// log density k of sample i0 + i, and every loop runs over whole vectors of
// independent samples, so the exp/log polynomials of neighbouring vectors
// overlap in the pipeline.  Force-inlined into the ISA-specific entry points.
// DIVIDE: z = (x - mu) / std, the reference's division, for calls where some
// 1/std overflows (a subnormal std): z = (x - mu) * inf would make a sample at
// the mean 0 * inf = NaN where the reference's 0 / std is 0.
template <typename T, int B, bool DIVIDE>
FUSED_OPS_INLINE void chunk_range(const ChunkArgs<T>& a, int64_t c0, int64_t c1) {
  using V = cpu::Lanes<T, B>;
  using acc_t = double;
  constexpr int L = cpu::kLanes<T, B>;
  const int64_t D = a.D, K = a.K, chunk = a.chunk;
  // xt rows are padded by one cache line so that they do not all map to the
  // same L1 sets (chunk * sizeof(T) is a power of two for most D).
  const int64_t ld = chunk + 64 / int64_t(sizeof(T));
  std::vector<T> xt(D * ld), dens((K + 1) * chunk), w(chunk);
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t i0 = c * chunk, n = std::min(a.N, i0 + chunk) - i0;
    const int64_t n_padded = (n + L - 1) / L * L;
    // Transpose the chunk into xt: L x L blocks in registers, the last
    // D % L columns element by element.  Padding lanes repeat the last row.
    const T* rows = a.x + i0 * D;
    const int64_t d_blocked = D / L * L;
    for (int64_t i = 0; i < n_padded; i += L) {
      for (int64_t d = 0; d < d_blocked; d += L) {
        V block[L];
        for (int r = 0; r < L; ++r) block[r] = cpu::load_lanes<V>(rows + std::min(i + r, n - 1) * D + d);
        cpu::transpose_lanes(block);
        for (int j = 0; j < L; ++j) cpu::store_lanes<V>(xt.data() + (d + j) * ld + i, block[j]);
      }
    }
    for (int64_t d = d_blocked; d < D; ++d) {
      T* out = xt.data() + d * ld;
      for (int64_t i = 0; i < n_padded; ++i) out[i] = rows[std::min(i, n - 1) * D + d];
    }
    // Log densities: sum_d ((x - mu) / std)^2 in four interleaved partial sums
    // (one running float32 sum loses accuracy as D grows: at D = 128 it is ~3x
    // further from float64 than the reference's pairwise torch.sum).
    for (int64_t k = 0; k <= K; ++k) {
      const T* m = a.mu + k * D;
      const T* r = a.inv_std + k * D;
      for (int64_t i = 0; i < n_padded; i += L) {
        auto sq = [&](int64_t d) {
          const V diff = cpu::load_lanes<V>(xt.data() + d * ld + i) - m[d];
          const V z = DIVIDE ? diff / r[d] : diff * r[d];
          return z * z;
        };
        V a0 = {}, a1 = {}, a2 = {}, a3 = {};
        int64_t d = 0;
        for (; d + 4 <= D; d += 4) {
          a0 += sq(d);
          a1 += sq(d + 1);
          a2 += sq(d + 2);
          a3 += sq(d + 3);
        }
        if (d < D) a0 += sq(d++);
        if (d < D) a1 += sq(d++);
        if (d < D) a2 += sq(d++);
        cpu::store_lanes<V>(dens.data() + k * chunk + i,
                            T(-0.5) * ((a0 + a1) + (a2 + a3)) + a.log_norm[k]);
      }
    }
    // lw = logsumexp_k(dens[k]) - dens[K]: the max first, then one exp per
    // component.  Stored unnormalised in the output.
    V vmax = V{} - std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < n_padded; i += L) {
      auto at = [&](int64_t k) { return cpu::load_lanes<V>(dens.data() + k * chunk + i); };
      V max = at(0);
      for (int64_t k = 1; k < K; ++k) max = cpu::nan_max(max, at(k));
      V sum = {};
      for (int64_t k = 0; k < K; ++k) sum += cpu::rel_exp(at(k), max);
      const V lw = (max + cpu::log(sum)) - at(K);
      cpu::store_lanes<V>(w.data() + i, lw);
      vmax = cpu::nan_max(vmax, lw);  // padding lanes repeat a real sample
    }
    std::memcpy(a.log_weights + i0, w.data(), n * sizeof(T));
    T chunk_max = vmax[0];
    for (int j = 1; j < L; ++j) chunk_max = nan_max(chunk_max, vmax[j]);
    // Weights relative to the chunk maximum, and the chunk's sums (x is cache-hot).
    for (int64_t i = 0; i < n_padded; i += L) {
      cpu::store_lanes<V>(w.data() + i, cpu::rel_exp(cpu::load_lanes<V>(w.data() + i), V{} + chunk_max));
    }
    // Chunk sums from the transposed rows: vector partial sums over lanes
    // (each adds at most chunk / L terms) finished in double, about as
    // accurate as torch.sum's pairwise order and far cheaper than a double
    // read-modify-write of wsum per sample.
    for (int64_t i = n; i < n_padded; ++i) w[i] = 0;  // padding lanes weigh nothing
    auto lane_sum = [&](const V& v) {
      acc_t total = 0;
      for (int j = 0; j < L; ++j) total += acc_t(v[j]);
      return total;
    };
    acc_t* part = a.partials + c * (D + 3);
    V s = {}, t = {};
    for (int64_t i = 0; i < n_padded; i += L) {
      const V e = cpu::load_lanes<V>(w.data() + i);
      s += e;
      t += e * e;
    }
    for (int64_t d = 0; d < D; ++d) {
      const T* xd = xt.data() + d * ld;
      V acc = {};
      for (int64_t i = 0; i < n_padded; i += L) {
        acc += cpu::load_lanes<V>(w.data() + i) * cpu::load_lanes<V>(xd + i);
      }
      part[3 + d] = lane_sum(acc);
    }
    part[1] = lane_sum(s);
    part[2] = lane_sum(t);
    part[0] = chunk_max;
  }
}

// The ISA-specific entry points: baseline 16-byte vectors, and 32-byte AVX2 +
// FMA vectors on CPUs that have them (cpu::cpu_has_avx2()).
template <typename T, bool DIVIDE>
void chunk_range_baseline(const ChunkArgs<T>& a, int64_t c0, int64_t c1) {
  chunk_range<T, 16, DIVIDE>(a, c0, c1);
}

#if FUSED_OPS_HAVE_AVX2_CLONE
template <typename T, bool DIVIDE>
FUSED_OPS_TARGET_AVX2 void chunk_range_avx2(const ChunkArgs<T>& a, int64_t c0, int64_t c1) {
  chunk_range<T, 32, DIVIDE>(a, c0, c1);
}
#endif

template <typename scalar_t>
void importance_sampling_kernel(const scalar_t* x, const scalar_t* mix_weights,
                                const scalar_t* mix_mus, const scalar_t* mix_stds,
                                const scalar_t* q_mu, const scalar_t* q_std, int64_t N, int64_t D,
                                int64_t K, scalar_t* weighted_mean, scalar_t* ess,
                                scalar_t* log_weights) {
  using acc_t = double;
  // Row K of mu / inv_std is the proposal, so one loop handles all K + 1
  // densities.  1/std turns the divide of the reference into a multiply;
  // log_norm = log w_k - sum_d log std_kd (proposal: -sum_d log q_std_d).
  std::vector<scalar_t> mu((K + 1) * D), inv_std((K + 1) * D), log_norm(K + 1);
  bool divide = false;  // some 1/std overflows: divide by std instead (chunk_range)
  for (int64_t k = 0; k <= K; ++k) {
    const scalar_t* m = k < K ? mix_mus + k * D : q_mu;
    const scalar_t* sd = k < K ? mix_stds + k * D : q_std;
    acc_t log_det = 0;
    for (int64_t d = 0; d < D; ++d) {
      mu[k * D + d] = m[d];
      inv_std[k * D + d] = scalar_t(1) / sd[d];
      divide |= std::isinf(inv_std[k * D + d]) && sd[d] != scalar_t(0);
      log_det += std::log(acc_t(sd[d]));
    }
    log_norm[k] = scalar_t((k < K ? std::log(acc_t(mix_weights[k])) : 0.0) - log_det);
  }
  if (divide) {
    for (int64_t k = 0; k <= K; ++k) {
      const scalar_t* sd = k < K ? mix_stds + k * D : q_std;
      std::copy(sd, sd + D, inv_std.begin() + k * D);
    }
  }

  // Chunks: a multiple of every vector width, a transposed copy that stays in
  // L1 (<= ~16 KB), fixed for given D (never by thread count) so results are
  // reproducible.
  const int64_t chunk = std::clamp<int64_t>(int64_t(4096) / std::max<int64_t>(D, 1) / 16 * 16, 16, kMaxChunk);
  const int64_t num_chunks = (N + chunk - 1) / chunk;
  const int64_t stride = D + 3;
  std::vector<acc_t> partials(num_chunks * stride);
  const ChunkArgs<scalar_t> args{x, N, D, K, chunk, mu.data(), inv_std.data(), log_norm.data(),
                                 log_weights, partials.data()};
  auto* range = divide ? &chunk_range_baseline<scalar_t, true> : &chunk_range_baseline<scalar_t, false>;
#if FUSED_OPS_HAVE_AVX2_CLONE
  if (cpu::cpu_has_avx2()) range = divide ? &chunk_range_avx2<scalar_t, true> : &chunk_range_avx2<scalar_t, false>;
#endif
  torch::stable::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) { range(args, c0, c1); });

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
  // A NaN or +inf log weight, or all of them -inf, leaves no normaliser: every
  // output is NaN, as the reference's mean and ESS are (its exp(lw - logsumexp)
  // is NaN at the +inf or all -inf weights).
  const bool defined = std::isfinite(total.max);
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  for (int64_t d = 0; d < D; ++d) weighted_mean[d] = scalar_t(defined ? wsum[d] / total.sum : nan);
  // sum_i w_i^2 = sum_sq / total.sum^2 with w_i = exp(lw_i - max) / total.sum.
  *ess = scalar_t(defined ? total.sum * total.sum / sum_sq : nan);

  // log w_i = (lw_i - max) - log(sum): the maximum comes off first, so huge
  // log weights keep their differences (max + log(sum) would round log(sum)
  // away once |max| is beyond 2^24 log(sum) in float32).
  const scalar_t max = scalar_t(total.max);
  const scalar_t log_sum = scalar_t(defined ? std::log(total.sum) : nan);
  torch::stable::parallel_for(0, N, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) log_weights[i] = (log_weights[i] - max) - log_sum;
  });
}

}  // namespace

ImportanceSamplingResult importance_sampling_cpu(const Tensor& samples, const Tensor& mix_weights,
                                                 const Tensor& mix_mus, const Tensor& mix_stds,
                                                 const Tensor& q_mu, const Tensor& q_std) {
  ImportanceSamplingCall c(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std);
  dispatch_float(samples.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    importance_sampling_kernel<scalar_t>(
        cdata<scalar_t>(c.x), cdata<scalar_t>(c.mix_weights),
        cdata<scalar_t>(c.mix_mus), cdata<scalar_t>(c.mix_stds),
        cdata<scalar_t>(c.q_mu), cdata<scalar_t>(c.q_std), c.N, c.D, c.K,
        mdata<scalar_t>(c.weighted_mean), mdata<scalar_t>(c.ess),
        mdata<scalar_t>(c.log_weights));
  });
  return c.result();
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("importance_sampling", TORCH_BOX(&importance_sampling_cpu));
}

}  // namespace fused_ops
