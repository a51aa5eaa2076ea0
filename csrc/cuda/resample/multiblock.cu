// \brief resample, path "multiblock": a few big problems, each spread over
// many thread blocks: resampling at large N, every method.
//
// When: N >= 2^16 and at most 64 problems (fewer problems than would fill
// the GPU one block each).
//
// Design: three launches on the current stream, chunks of kTile = 2048
// weights, grids of (chunks, problems) blocks of 256 threads.  Multinomial
// positions come from a scan over all M uniforms, which has no random
// access: positions.cu first writes them, sorted, into the indices' buffer
// (three more launches), a fourth launch finds each chunk's k range by
// binary search in them, and the merge reads position k and overwrites it
// with index k in the same thread.
//   1. partials: per chunk its maximum, sum_i exp(lw_i - chunk max) (float64),
//      last index of positive weight, and whether it holds NaN/+inf;
//   2. prefix (one block per problem): the global max, each chunk's sum
//      rescaled to it, their exclusive prefix P_c (a tiled block scan in
//      chunk order, made monotone by an exact max-scan) and the total; the
//      last positive index at or before each chunk (an integer max-scan);
//   3. merge: chunk c owns the targets t_k = p_k * total in [P_c, P_{c+1})
//      (the last chunk: [P_c, inf)).  Positions are random-access here, so
//      the owned k range is found by two binary searches over k; the chunk's
//      CDF P_c + local scan is built in shared memory (paths.cuh cdf_tile)
//      and each owned target is resolved by a binary search in it; a target
//      past the chunk's local end (the rescaled and the recomputed sums
//      differ by rounding) takes the chunk's last index of positive weight.
// Ownership by the P_c alone gives every k to exactly one chunk; a chunk of
// zero weight owns none.  Two reads of the log weights, one of the
// uniforms; workspace O(problems x chunks) float64.  Deterministic: no
// float atomics; the one atomic (the last positive index, an integer max)
// is order-independent.

#include <algorithm>

#include "cuda/resample/paths.cuh"

namespace fused_ops {
namespace resample_paths {
namespace {

constexpr int64_t kMinN = int64_t(1) << 16;
constexpr int64_t kMaxProblems = 64;

struct Workspace {
  double *part_max, *part_sum, *prefix, *gmax;
  int64_t *part_last, *part_bad, *status;
};

Workspace carve(double* base, int64_t B, int64_t C) {
  Workspace w;
  w.part_max = base;
  w.part_sum = w.part_max + B * C;
  w.part_last = reinterpret_cast<int64_t*>(w.part_sum + B * C);
  w.part_bad = w.part_last + B * C;
  w.prefix = reinterpret_cast<double*>(w.part_bad + B * C);
  w.gmax = w.prefix + B * (C + 1);
  w.status = reinterpret_cast<int64_t*>(w.gmax + B);
  return w;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) partials_kernel(const Args<T> a, Workspace w, int64_t C) {
  __shared__ T scratch_t[kWarps];
  __shared__ double scratch[kWarps];
  __shared__ int scratch_i[kWarps];
  __shared__ long long scratch_l[kWarps];
  const int64_t b = blockIdx.y, c = blockIdx.x, base = c * kTile;
  const T* lw = a.lw + b * a.N;
  const int64_t end = std::min<int64_t>(a.N, base + kTile);
  T m = T(-INFINITY);
  int bad = 0;
  for (int64_t i = base + threadIdx.x; i < end; i += kThreads) {
    const T v = lw[i];
    bad |= is_bad(v);
    m = v > m ? v : m;
  }
  m = cuda::block_allreduce(m, scratch_t, MaxOp{});
  bad = cuda::block_allreduce(bad, scratch_i, MaxOp{});
  double s = 0.0;
  long long last = -1;
  if (m != T(-INFINITY)) {
    for (int64_t i = base + threadIdx.x; i < end; i += kThreads) {
      const double e = exp(double(lw[i]) - double(m));
      s += e;
      if (e > 0.0) last = i;
    }
  }
  s = cuda::block_allreduce(s, scratch);
  last = cuda::block_allreduce(last, scratch_l, MaxOp{});
  if (threadIdx.x == 0) {
    w.part_max[b * C + c] = double(m);
    w.part_sum[b * C + c] = s;
    w.part_last[b * C + c] = last;
    w.part_bad[b * C + c] = bad;
  }
}

__global__ void __launch_bounds__(kThreads) prefix_kernel(Workspace w, int64_t C) {
  __shared__ double scratch[kWarps];
  __shared__ long long scratch_l[kWarps];
  const int64_t b = blockIdx.x;
  const double* pm = w.part_max + b * C;
  const double* ps = w.part_sum + b * C;
  double m = -INFINITY;
  long long bad = 0;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) {
    m = pm[c] > m ? pm[c] : m;
    bad |= w.part_bad[b * C + c];
  }
  m = cuda::block_allreduce(m, scratch, MaxOp{});
  bad = cuda::block_allreduce(bad, scratch_l, MaxOp{});
  double* prefix = w.prefix + b * (C + 1);
  double carry = 0.0, running_max = 0.0;
  long long running_last = -1;
  for (int64_t base = 0; base < C; base += kTile) {
    const int64_t first = base + int64_t(threadIdx.x) * kItems;
    double local[kItems];
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t c = first + j;
      local[j] = s;  // exclusive within the thread
      s += (c < C && pm[c] != -INFINITY) ? ps[c] * exp(pm[c] - m) : 0.0;
    }
    const cuda::ScanResult<double> scan = cuda::block_exclusive_scan(s, scratch);
    // Made monotone by an exact max-scan (a sum scan in tree order can step
    // back by one rounding at a thread boundary), so the owned ranges
    // [P_c, P_{c+1}) never overlap; and the last positive index at or before
    // each chunk, the fallback of a target past its chunk's local end.
    double value[kItems];
    double run = running_max;
    long long run_last = running_last, chunk_last[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t c = first + j;
      value[j] = carry + (scan.exclusive + local[j]);
      run = value[j] > run ? value[j] : run;
      value[j] = run;
      chunk_last[j] = c < C ? static_cast<long long>(w.part_last[b * C + c]) : -1;
      run_last = chunk_last[j] > run_last ? chunk_last[j] : run_last;
      chunk_last[j] = run_last;
    }
    const cuda::ScanResult<double> up = cuda::block_exclusive_scan(run, scratch, MaxOp{}, double(-INFINITY));
    const cuda::ScanResult<long long> up_last = cuda::block_exclusive_scan(run_last, scratch_l, MaxOp{}, -1ll);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t c = first + j;
      if (c < C) {
        prefix[c] = up.exclusive > value[j] ? up.exclusive : value[j];
        w.part_last[b * C + c] = up_last.exclusive > chunk_last[j] ? up_last.exclusive : chunk_last[j];
      }
    }
    carry += scan.total;
    running_max = up.total;
    running_last = up_last.total;
  }
  carry = carry > running_max ? carry : running_max;
  if (threadIdx.x == 0) {
    prefix[C] = carry;
    w.gmax[b] = m;
    w.status[b] = (bad || m == -INFINITY) ? 1 : 0;
  }
}

// Position k of a problem: computed (stratified, systematic) or read back
// from the indices' buffer, where positions.cu wrote it (multinomial).
__device__ __forceinline__ double position_at(const double* u, const int64_t* out, ResampleMethod method, int64_t k,
                                              int64_t M) {
  return method == ResampleMethod::kMultinomial ? __longlong_as_double(out[k]) : strided_at(u, method, k, M);
}

// First k in [0, M] with p_k * total >= x (M when none).
__device__ int64_t first_position_at_or_above(const double* u, const int64_t* out, ResampleMethod method, int64_t M,
                                              double total, double x) {
  int64_t lo = 0, hi = M;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (position_at(u, out, method, mid, M) * total >= x) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// Multinomial: the first k of every chunk's range, k_first[b, c] (and M at
// c = C), before the merge overwrites the positions; one thread per chunk.
__global__ void __launch_bounds__(kThreads) ranges_kernel(const int64_t* out, Workspace w, int64_t* k_first,
                                                          int64_t M, int64_t C) {
  const int64_t b = blockIdx.y, c = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (c > C || w.status[b]) return;
  const double* prefix = w.prefix + b * (C + 1);
  k_first[b * (C + 1) + c] = c == C ? M : first_position_at_or_above(nullptr, out + b * M,
                                                                     ResampleMethod::kMultinomial, M, prefix[C],
                                                                     prefix[c]);
}

// k_first: the multinomial ranges (ranges_kernel), nullptr otherwise.
template <typename T>
__global__ void __launch_bounds__(kThreads) merge_kernel(const Args<T> a, Workspace w, const int64_t* k_first,
                                                         int64_t C) {
  __shared__ double cdf[kTile];
  __shared__ double scratch[kWarps];
  __shared__ int64_t last_positive, k_range[2];
  const int64_t b = blockIdx.y, c = blockIdx.x, M = a.M;
  int64_t* out = a.out + b * M;
  if (w.status[b]) {  // no positive weight, or NaN/+inf: -1 everywhere, spread over the chunks
    for (int64_t k = c * M / C + threadIdx.x; k < (c + 1) * M / C; k += kThreads) out[k] = kInvalid;
    return;
  }
  const double* prefix = w.prefix + b * (C + 1);
  const double total = prefix[C], lo = prefix[c];
  const double* u = a.u + b * a.U;
  if (threadIdx.x == 0) {
    if (k_first != nullptr) {
      k_range[0] = k_first[b * (C + 1) + c];
      k_range[1] = k_first[b * (C + 1) + c + 1];
    } else {
      k_range[0] = first_position_at_or_above(u, out, a.method, M, total, lo);
      k_range[1] = c + 1 == C ? M : first_position_at_or_above(u, out, a.method, M, total, prefix[c + 1]);
    }
    last_positive = w.part_last[b * C + c];
  }
  __syncthreads();
  const int64_t k0 = k_range[0], k1 = k_range[1];
  if (k0 >= k1) return;  // block-uniform
  const int64_t base = c * kTile, n = std::min<int64_t>(kTile, a.N - base);
  cdf_tile(a.lw + b * a.N, a.N, base, w.gmax[b], lo, cdf, scratch, &last_positive);
  const int64_t fallback = w.part_last[b * C + c];
  for (int64_t k = k0 + threadIdx.x; k < k1; k += kThreads) {
    const int64_t r = upper_bound(cdf, 0, n, position_at(u, out, a.method, k, M) * total);
    out[k] = r < n ? base + r : fallback;
  }
}

template <typename T>
void launch(const ResampleCall& c) {
  const int device = cuda::current_device();
  const cudaStream_t stream = cuda::current_stream(device);
  const int64_t B = c.B, C = (c.N + kTile - 1) / kTile;
  // Workspace in float64 units: 4 per chunk, the prefix (C + 1), gmax and status.
  const Tensor ws = empty_like_device(c.uniforms, {B * (5 * C + 3)});
  const Workspace w = carve(mdata<double>(ws), B, C);
  const Args<T> args = make_args<T>(c);
  const dim3 grid{unsigned(C), unsigned(B)};
  partials_kernel<T><<<grid, kThreads, 0, stream>>>(args, w, C);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  prefix_kernel<<<unsigned(B), kThreads, 0, stream>>>(w, C);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  Tensor ranges;  // multinomial: k_first [B, C + 1]
  const int64_t* k_first = nullptr;
  if (c.method == ResampleMethod::kMultinomial) {
    write_multinomial_positions(c, stream);
    ranges = empty_like_device(c.indices, {B * (C + 1)});
    const dim3 range_grid{unsigned((C + 1 + kThreads - 1) / kThreads), unsigned(B)};
    ranges_kernel<<<range_grid, kThreads, 0, stream>>>(args.out, w, mdata<int64_t>(ranges), c.M, C);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
    k_first = cdata<int64_t>(ranges);
  }
  merge_kernel<T><<<grid, kThreads, 0, stream>>>(args, w, k_first, C);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool multiblock_applies(const ResampleCall& c) {
  return c.N >= kMinN && c.B <= kMaxProblems && (c.N + kTile - 1) / kTile <= INT32_MAX &&
         (c.M + kTile - 1) / kTile <= INT32_MAX;
}

void launch_multiblock(const ResampleCall& c) {
  if (c.B == 0 || c.M == 0) return;
  dispatch_float(c.log_weights.scalar_type(), [&](auto zero) { launch<decltype(zero)>(c); });
}

}  // namespace resample_paths
}  // namespace fused_ops
