// \brief resample, path "block": one thread block per problem (grid-stride
// over problems), any N and M, every method.
//
// When: any call (the table's last path); chosen for batches of problems and
// for multinomial resampling at every size.
//
// Design.  256 threads, three sweeps over the problem's log weights:
//   1. max and validity (NaN/+inf anywhere, or all -inf: every index -1);
//   2. the CDF tile by tile (paths.cuh cdf_tile, float64 in shared memory),
//      for its total and the last index of positive weight;
//   3. a merge of two tiled, sorted streams: CDF tiles (recomputed as in 2,
//      bitwise the same values) and position tiles of kTile targets p_k * total
//      (multinomial: a block scan of the order-statistics terms with a
//      running carry; stratified/systematic: direct).  Each target below the
//      CDF tile's last value is resolved by a binary search in the shared
//      CDF tile; then whichever tile is used up advances.  Work per problem:
//      O(N + M log kTile), shared memory 2 x kTile doubles (32 KB).
// Writes are coalesced (a tile's resolved targets are consecutive k).

#include <algorithm>

#include "cuda/resample/paths.cuh"

namespace fused_ops {
namespace resample_paths {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) resample_block_kernel(const Args<T> a) {
  __shared__ double cdf[kTile];
  __shared__ double pos[kTile];
  __shared__ double scratch[kWarps];
  __shared__ T scratch_t[kWarps];
  __shared__ int scratch_i[kWarps];
  __shared__ int64_t last_positive;
  const int64_t N = a.N, M = a.M;

  for (int64_t b = blockIdx.x; b < a.B; b += gridDim.x) {
    const T* lw = a.lw + b * N;
    const double* u = a.u + b * a.U;
    int64_t* out = a.out + b * M;

    T m = T(-INFINITY);
    int bad = 0;
    for (int64_t i = threadIdx.x; i < N; i += kThreads) {
      const T v = lw[i];
      bad |= is_bad(v);
      m = v > m ? v : m;
    }
    m = cuda::block_allreduce(m, scratch_t, MaxOp{});
    bad = cuda::block_allreduce(bad, scratch_i, MaxOp{});
    if (bad || m == T(-INFINITY)) {
      for (int64_t k = threadIdx.x; k < M; k += kThreads) out[k] = kInvalid;
      continue;
    }
    const double gmax = double(m);
    if (threadIdx.x == 0) last_positive = 0;
    __syncthreads();
    double total = 0.0;
    for (int64_t base = 0; base < N; base += kTile) {
      total = cdf_tile(lw, N, base, gmax, total, cdf, scratch, &last_positive);
    }
    const int64_t fallback = last_positive;

    // Position tile k_base: pos[j] = p_{k_base + j} * total; returns its size.
    double L = 0.0;  // multinomial scan carry
    auto load_positions = [&](int64_t k_base) {
      const int64_t n = M - k_base < kTile ? M - k_base : kTile;
      if (a.method == ResampleMethod::kMultinomial) {
        const int64_t first = k_base + int64_t(threadIdx.x) * kItems;
        double local[kItems];
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const int64_t k = first + j;
          s += k < M ? order_statistic_term(k, u[k], M) : 0.0;
          local[j] = s;
        }
        const cuda::ScanResult<double> scan = cuda::block_exclusive_scan(s, scratch);
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const int64_t t = int64_t(threadIdx.x) * kItems + j;
          if (t < n) pos[t] = order_statistic_position(L + (scan.exclusive + local[j])) * total;
        }
        L += scan.total;
      } else {
        for (int64_t t = threadIdx.x; t < n; t += kThreads) pos[t] = strided_at(u, a.method, k_base + t, M) * total;
      }
      __syncthreads();
      return n;
    };

    if (M == 0) continue;
    int64_t i_base = 0, k_base = 0, first = 0;
    double carry = cdf_tile(lw, N, 0, gmax, 0.0, cdf, scratch, &last_positive);
    int64_t n_c = N < kTile ? N : kTile;
    int64_t n_p = load_positions(0);
    while (true) {
      const bool last_tile = i_base + kTile >= N;
      const double hi = cdf[n_c - 1];
      const int64_t count = last_tile ? n_p : lower_bound(pos, first, n_p, hi);
      for (int64_t j = first + threadIdx.x; j < count; j += kThreads) {
        const int64_t r = upper_bound(cdf, 0, n_c, pos[j]);
        out[k_base + j] = r < n_c ? i_base + r : fallback;
      }
      __syncthreads();
      first = count;
      if (first == n_p) {
        k_base += kTile;
        if (k_base >= M) break;
        n_p = load_positions(k_base);
        first = 0;
      } else {
        i_base += kTile;
        carry = cdf_tile(lw, N, i_base, gmax, carry, cdf, scratch, &last_positive);
        n_c = N - i_base < kTile ? N - i_base : kTile;
      }
    }
    __syncthreads();  // shared memory is reused by the next problem
  }
}

template <typename T>
void launch(const ResampleCall& c) {
  const int device = cuda::current_device();
  const int64_t blocks = std::min<int64_t>(c.B, int64_t(cuda::multiprocessor_count(device)) * 8);
  resample_block_kernel<T><<<unsigned(blocks), kThreads, 0, cuda::current_stream(device)>>>(make_args<T>(c));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void launch_block(const ResampleCall& c) {
  if (c.B == 0 || c.M == 0) return;
  dispatch_float(c.log_weights.scalar_type(), [&](auto zero) { launch<decltype(zero)>(c); });
}

}  // namespace resample_paths
}  // namespace fused_ops
