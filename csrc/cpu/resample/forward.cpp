// \brief CPU kernel of fused_ops::resample (the only CPU path).
//
// Problems run in parallel (torch's thread pool); each problem is three
// sequential passes over its log weights, none of which stores the CDF
// (a few stratified/systematic problems of N >= 2^16 instead spread their
// chunks over the threads, with the same sums: resample_one_chunked):
//   1. the maximum, and whether every log weight is finite or -inf;
//   2. chunk sums s_c = sum_{i in chunk c} exp(lw_i - max) in float64, in
//      chunks of kChunk weights, and their running prefix P_c;
//   3. the merge: C_i = P_c + (running sum within chunk c), the same
//      additions in the same order as pass 2, so the CDF ends exactly at the
//      total P used to scale the positions; each ascending target p_k * P is
//      given the first i with C_i > p_k * P, in one forward sweep over i and k.
// The rounding of C_i is bounded by (N / kChunk + kChunk) float64 ulps of the
// total (two short sums instead of one of N terms).  A position at or past the
// end (rounding, or p_k = 1) gets the last index of positive weight.
// Everything runs in a fixed order: results do not depend on the thread count.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "resample.h"

namespace fused_ops {
namespace {

constexpr int64_t kChunk = 1024;

// Ascending positions p_k of one problem, one at a time.
struct Positions {
  const double* u;
  int64_t M;
  ResampleMethod method;
  double L = 0.0;  // multinomial: the running order-statistics scan

  double at(int64_t k) {
    switch (method) {
      case ResampleMethod::kMultinomial:
        L += order_statistic_term(k, u[k], M);
        return order_statistic_position(L);
      case ResampleMethod::kStratified: return strided_position(k, u[k], M);
      default: return strided_position(k, u[0], M);
    }
  }
};

// One problem; false when its log weights hold NaN or +inf, or are all -inf
// (then `out` is left unwritten and the caller raises).
template <typename T>
bool resample_one(const T* lw, int64_t N, Positions pos, int64_t* out, std::vector<double>& prefix) {
  T max = -std::numeric_limits<T>::infinity();
  bool finite = true;
  for (int64_t i = 0; i < N; ++i) {
    const T v = lw[i];
    finite &= !(std::isnan(v) || v == std::numeric_limits<T>::infinity());
    max = v > max ? v : max;
  }
  if (!finite || max == -std::numeric_limits<T>::infinity()) return false;
  const double m = double(max);

  const int64_t chunks = (N + kChunk - 1) / kChunk;
  prefix.assign(chunks + 1, 0.0);
  int64_t last_positive = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i1 = std::min(N, (c + 1) * kChunk);
    double s = 0.0;
    for (int64_t i = c * kChunk; i < i1; ++i) {
      const double e = std::exp(double(lw[i]) - m);
      s += e;
      if (e > 0.0) last_positive = i;
    }
    prefix[c + 1] = prefix[c] + s;
  }
  const double total = prefix[chunks];

  const int64_t M = pos.M;
  int64_t k = 0;
  double t = M > 0 ? pos.at(0) * total : 0.0;
  for (int64_t c = 0; c < chunks && k < M; ++c) {
    const int64_t i1 = std::min(N, (c + 1) * kChunk);
    const double base = prefix[c];
    double s = 0.0;
    for (int64_t i = c * kChunk; i < i1 && k < M; ++i) {
      s += std::exp(double(lw[i]) - m);
      const double C = base + s;
      while (t < C) {  // e_i > 0 here: C grew past t
        out[k] = i;
        if (++k == M) break;
        t = pos.at(k) * total;
      }
    }
  }
  for (; k < M; ++k) out[k] = last_positive;
  return true;
}

// One stratified or systematic problem with its chunks spread over the
// thread pool: the same additions as resample_one, so the same indices.
// Chunk c owns the targets in [P_c, P_{c+1}) (the last chunk: [P_c, inf)),
// which resample_one assigns inside chunk c too (its CDF ends exactly at
// P_{c+1}); positions are random-access, so each chunk finds its k range by
// two binary searches over k.
template <typename T>
bool resample_one_chunked(const T* lw, int64_t N, const double* u, int64_t M, ResampleMethod method,
                          int64_t* out) {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  std::vector<T> chunk_max(chunks);
  std::vector<char> chunk_finite(chunks);
  torch::stable::parallel_for(0, chunks, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      T max = -std::numeric_limits<T>::infinity();
      bool finite = true;
      for (int64_t i = c * kChunk; i < std::min(N, (c + 1) * kChunk); ++i) {
        const T v = lw[i];
        finite &= !(std::isnan(v) || v == std::numeric_limits<T>::infinity());
        max = v > max ? v : max;
      }
      chunk_max[c] = max;
      chunk_finite[c] = finite;
    }
  });
  T max = -std::numeric_limits<T>::infinity();
  for (int64_t c = 0; c < chunks; ++c) {
    if (!chunk_finite[c]) return false;
    max = chunk_max[c] > max ? chunk_max[c] : max;
  }
  if (max == -std::numeric_limits<T>::infinity()) return false;
  const double m = double(max);
  std::vector<double> prefix(chunks + 1, 0.0);
  std::vector<int64_t> chunk_last(chunks, -1);
  torch::stable::parallel_for(0, chunks, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double s = 0.0;
      for (int64_t i = c * kChunk; i < std::min(N, (c + 1) * kChunk); ++i) {
        const double e = std::exp(double(lw[i]) - m);
        s += e;
        if (e > 0.0) chunk_last[c] = i;
      }
      prefix[c + 1] = s;  // the chunk's sum; the prefix is summed below, in order
    }
  });
  int64_t last_positive = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    prefix[c + 1] += prefix[c];
    last_positive = std::max(last_positive, chunk_last[c]);
  }
  const double total = prefix[chunks];
  auto target = [&](int64_t k) {
    return strided_position(k, method == ResampleMethod::kStratified ? u[k] : u[0], M) * total;
  };
  auto first_at_or_above = [&](double x) {  // first k with target(k) >= x
    int64_t lo = 0, hi = M;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (target(mid) >= x) hi = mid; else lo = mid + 1;
    }
    return lo;
  };
  torch::stable::parallel_for(0, chunks, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t k = c == 0 ? 0 : first_at_or_above(prefix[c]);
      const int64_t k1 = c + 1 == chunks ? M : first_at_or_above(prefix[c + 1]);
      if (k >= k1) continue;
      const double base = prefix[c];
      double s = 0.0, t = target(k);
      for (int64_t i = c * kChunk; i < std::min(N, (c + 1) * kChunk) && k < k1; ++i) {
        s += std::exp(double(lw[i]) - m);
        const double C = base + s;
        while (t < C) {
          out[k] = i;
          if (++k == k1) break;
          t = target(k);
        }
      }
      for (; k < k1; ++k) out[k] = last_positive;  // the last chunk only: targets at or past the total
    }
  });
  return true;
}

// Whether one problem is worth spreading over the threads.
bool chunked(const ResampleCall& c) {
  return c.method != ResampleMethod::kMultinomial && c.N >= (int64_t(1) << 16) &&
         c.B < int64_t(torch::stable::get_num_threads());
}

}  // namespace

Tensor resample_cpu(const Tensor& log_weights, const Tensor& uniforms, int64_t num_samples,
                    std::string method) {
  ResampleCall c(log_weights, uniforms, num_samples, method);
  FUSED_OPS_CHECK(log_weights.is_cpu(), "log_weights must be a CPU tensor, got ", device_str(log_weights));
  const int64_t B = c.B, N = c.N, M = c.M, U = c.U;
  if (B == 0) return c.indices;
  const double* u = cdata<double>(c.uniforms);
  int64_t* out = mdata<int64_t>(c.indices);
  std::atomic<int64_t> first_bad{B};
  dispatch_float(c.log_weights.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* lw = cdata<T>(c.log_weights);
    if (chunked(c)) {
      for (int64_t b = 0; b < B && first_bad.load() == B; ++b) {
        if (!resample_one_chunked(lw + b * N, N, u + b * U, M, c.method, out + b * M)) first_bad = b;
      }
      return;
    }
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (N + M + 1));
    torch::stable::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
      std::vector<double> prefix;
      for (int64_t b = b0; b < b1; ++b) {
        if (!resample_one(lw + b * N, N, Positions{u + b * U, M, c.method}, out + b * M, prefix)) {
          int64_t seen = first_bad.load();
          while (b < seen && !first_bad.compare_exchange_weak(seen, b)) {
          }
        }
      }
    });
  });
  const int64_t bad = first_bad.load();
  FUSED_OPS_CHECK(bad == B, "log_weights of problem ", bad, " (flat batch index) ",
                  "hold NaN or +inf, or are all -inf (every weight zero): resampling needs finite log ",
                  "weights, -inf for a zero weight, and at least one finite one per problem");
  return c.indices;
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("resample", TORCH_BOX(&resample_cpu));
}

}  // namespace fused_ops
