// \brief resample, path "multiblock", multinomial: the sorted positions p_k
// of every problem, computed by many blocks and written as float64 bits into
// the indices' buffer, which the merge then overwrites index by index.
//
// p_k = -expm1(L_k), L_k = sum_{j <= k} log1p(-u_j) / (M - j)
// (csrc/resample.h): a prefix sum over all M uniforms, here a three-pass scan
// over chunks of kTile positions, grids of (chunks, problems) blocks of 256
// threads, on the current stream:
//   1. sums: each chunk's sum of the terms (float64);
//   2. carries (one block per problem): each chunk's exclusive prefix L_c of
//      the chunk sums (a tiled block scan in chunk order), and its bound
//      b_c = -expm1(L_c), made non-decreasing by an exact max-scan, b_C = 1;
//   3. positions: the chunk's terms scanned in the block (kItems consecutive
//      per thread, as "block" scans them) on top of L_c, p = -expm1(L), made
//      non-decreasing by an exact max-scan from b_c and clamped to b_{c+1}.
// The merge's ownership ranges are binary searches over k, so the positions
// must be sorted exactly: a tree-order sum can step back by a rounding at a
// thread or chunk boundary, and the max-scan and the clamp remove that step
// (each moves a position by at most that rounding).  Workspace: 3 float64
// per chunk and problem.  Deterministic (fixed orders, no atomics).

#include "cuda/resample/paths.cuh"

namespace fused_ops {
namespace resample_paths {
namespace {

struct PosArgs {
  const double* u;  // [B, M]
  int64_t* out;     // [B, M]: the positions, as float64 bits
  double *sums, *carries, *bounds;  // [B, C], [B, C], [B, C + 1]
  int64_t M, C;
};

__global__ void __launch_bounds__(kThreads) position_sums_kernel(const PosArgs a) {
  __shared__ double scratch[kWarps];
  const int64_t b = blockIdx.y, c = blockIdx.x, first = c * kTile + int64_t(threadIdx.x) * kItems;
  const double* u = a.u + b * a.M;
  double s = 0.0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t k = first + j;
    s += k < a.M ? order_statistic_term(k, u[k], a.M) : 0.0;
  }
  s = cuda::block_allreduce(s, scratch);
  if (threadIdx.x == 0) a.sums[b * a.C + c] = s;
}

__global__ void __launch_bounds__(kThreads) position_carries_kernel(const PosArgs a) {
  __shared__ double scratch[kWarps];
  const int64_t b = blockIdx.x, C = a.C;
  const double* sums = a.sums + b * C;
  double* carries = a.carries + b * C;
  double* bounds = a.bounds + b * (C + 1);
  double carry = 0.0, running = -INFINITY;
  for (int64_t base = 0; base < C; base += kTile) {
    const int64_t first = base + int64_t(threadIdx.x) * kItems;
    double local[kItems];
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t c = first + j;
      local[j] = s;  // exclusive within the thread
      s += c < C ? sums[c] : 0.0;
    }
    const cuda::ScanResult<double> scan = cuda::block_exclusive_scan(s, scratch);
    double bound[kItems];
    double run = running;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      local[j] = carry + (scan.exclusive + local[j]);
      const double p = order_statistic_position(local[j]);
      run = p > run ? p : run;
      bound[j] = run;
    }
    const cuda::ScanResult<double> up = cuda::block_exclusive_scan(run, scratch, MaxOp{}, double(-INFINITY));
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t c = first + j;
      if (c < C) {
        carries[c] = local[j];
        bounds[c] = up.exclusive > bound[j] ? up.exclusive : bound[j];
      }
    }
    carry += scan.total;
    running = up.total;
  }
  if (threadIdx.x == 0) bounds[C] = 1.0;
}

__global__ void __launch_bounds__(kThreads) positions_kernel(const PosArgs a) {
  __shared__ double scratch[kWarps];
  const int64_t b = blockIdx.y, c = blockIdx.x, first = c * kTile + int64_t(threadIdx.x) * kItems;
  const double* u = a.u + b * a.M;
  double local[kItems];
  double s = 0.0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t k = first + j;
    s += k < a.M ? order_statistic_term(k, u[k], a.M) : 0.0;
    local[j] = s;
  }
  const cuda::ScanResult<double> scan = cuda::block_exclusive_scan(s, scratch);
  const double carry = a.carries[b * a.C + c];
  const double lo = a.bounds[b * (a.C + 1) + c], hi = a.bounds[b * (a.C + 1) + c + 1];
  double run = lo;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const double p = order_statistic_position(carry + (scan.exclusive + local[j]));
    run = p > run ? p : run;
    local[j] = run;
  }
  const cuda::ScanResult<double> up = cuda::block_exclusive_scan(run, scratch, MaxOp{}, double(-INFINITY));
  int64_t* out = a.out + b * a.M;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t k = first + j;
    if (k < a.M) {
      const double p = up.exclusive > local[j] ? up.exclusive : local[j];
      out[k] = __double_as_longlong(p < hi ? p : hi);
    }
  }
}

}  // namespace

void write_multinomial_positions(const ResampleCall& c, cudaStream_t stream) {
  const int64_t B = c.B, M = c.M, C = (M + kTile - 1) / kTile;
  const Tensor ws = empty_like_device(c.uniforms, {B * (3 * C + 1)});
  double* base = mdata<double>(ws);
  const PosArgs a{cdata<double>(c.uniforms), mdata<int64_t>(c.indices), base, base + B * C, base + 2 * B * C, M, C};
  const dim3 grid{unsigned(C), unsigned(B)};
  position_sums_kernel<<<grid, kThreads, 0, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  position_carries_kernel<<<unsigned(B), kThreads, 0, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  positions_kernel<<<grid, kThreads, 0, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace resample_paths
}  // namespace fused_ops
