// \brief snis, path "split": problems cut into chunks spread over the whole
// GPU, chunk partials merged in a fixed order.
//
// When: N >= 2 x kMinChunk (8192) and B < 4 x SMs: too few problems to fill
// the GPU with one block each (one large problem above all: N = 2^20, 2^26).
//
// Design.  C = ceil(N / chunk) chunks per problem, chunk >= 4096 weights
// sized for ~8 blocks per SM over all B * C blocks (split_chunk).  Launches,
// in stream order, each a 1-D grid of B * C blocks (or B for the merges):
//   stats     block_stats of each chunk -> stats[b * C + c];
//   weights   (blocks in reverse order: the stats pass's last chunks are
//             still in L2) every block merges its problem's C partials in the same fixed
//             order (so all agree bitwise on logsumexp), chunk 0 writes ESS,
//             evidence and lse[b]; block_moments writes the chunk's
//             normalised log weights and, with samples, its sum_i w_i x_i
//             -> sums[b * C + c, D];
//   merge     per (b, d): the C chunk sums in chunk order -> mean (and its
//             double copy mean64[b, D]);
//   with moments=True, "variance" (block_moments about mean64) and merge.
// Memory traffic: the log weights are read twice (stats, weights; the
// second read hits L2 when they fit its 50 MB) and the normalised ones
// written once; samples are read once per moment.  Workspace: B * C * (3 +
// D) + B * (D + 1) doubles.

#include "cuda/snis/kernels.cuh"

namespace fused_ops {
namespace snis_paths {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) snis_split_stats(const Args<T> a) {
  __shared__ SnisStats scratch[kWarps];
  const int64_t b = blockIdx.x / a.C, c = blockIdx.x % a.C;
  const int64_t n0 = c * a.chunk, n1 = n0 + a.chunk < a.N ? n0 + a.chunk : a.N;
  const SnisStats s = block_stats(a.lw + b * a.N, n0, n1, scratch);
  if (threadIdx.x == 0) a.stats[blockIdx.x] = s;
}

// moments == false: the weights pass (lnw, ESS, evidence, sum w x);
// moments == true: the variance pass (sum w (x - mean)^2).
template <typename T, bool kVariance>
__global__ void __launch_bounds__(kThreads) snis_split_weights(const Args<T> a) {
  __shared__ SnisStats scratch[kWarps];
  __shared__ MomentScratch sm;
  // Blocks in the reverse order of the stats pass: the chunks read last
  // there are the first read here, while they are still in L2.
  const int64_t part = int64_t(gridDim.x) - 1 - blockIdx.x;
  const int64_t b = part / a.C, c = part % a.C;
  const int64_t n0 = c * a.chunk, n1 = n0 + a.chunk < a.N ? n0 + a.chunk : a.N;
  double lse;
  if (kVariance) {
    lse = a.lse[b];
  } else {
    const SnisStats s = merge_chunks(a.stats + b * a.C, a.C, scratch);
    lse = s.log_sum();
    if (c == 0 && threadIdx.x == 0) {
      a.ess[b] = T(s.ess());
      a.logz[b] = T(lse - log(double(a.N)));
      a.lse[b] = lse;
    }
  }
  const T* lw = a.lw + b * a.N;
  const T* x = a.x ? a.x + b * a.N * a.D : nullptr;
  double* sums = a.sums + part * int64_t(a.D);
  block_moments(lw, x, a.D, n0, n1, lse, kVariance ? static_cast<T*>(nullptr) : a.lnw + b * a.N,
                kVariance ? a.mean64 + b * a.D : nullptr, sm, [&](int d, double v) { sums[d] = v; });
}

// Per (b, d): the C chunk sums in chunk order.
template <typename T>
__global__ void __launch_bounds__(kThreads) snis_split_merge(const Args<T> a, T* out, double* out64) {
  const int64_t b = blockIdx.x;
  for (int d = threadIdx.x; d < a.D; d += kThreads) {
    double total = 0;
    for (int64_t c = 0; c < a.C; ++c) total += a.sums[(b * a.C + c) * a.D + d];
    out[b * a.D + d] = T(total);
    if (out64) out64[b * a.D + d] = total;
  }
}

template <typename T>
void launch_split_typed(const SnisCall& c) {
  Args<T> a = make_args<T>(c);
  const int device = cuda::current_device();
  a.chunk = split_chunk(c.B, c.N, cuda::multiprocessor_count(device));
  a.C = (c.N + a.chunk - 1) / a.chunk;
  const int64_t parts = c.B * a.C, D = c.has_samples ? c.D : 0;
  // stats (3 doubles each), sums [parts, D], mean64 [B, D], lse [B]
  Tensor ws = float64_workspace(c.lw, parts * (3 + D) + c.B * (D + 1), "snis");
  double* w = mdata<double>(ws);
  a.stats = reinterpret_cast<SnisStats*>(w);
  a.sums = w + parts * 3;
  a.mean64 = a.sums + parts * D;
  a.lse = a.mean64 + c.B * D;
  const cudaStream_t stream = cuda::current_stream(device);
  snis_split_stats<T><<<unsigned(parts), kThreads, 0, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  snis_split_weights<T, false><<<unsigned(parts), kThreads, 0, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  if (!c.has_samples || D == 0) return;
  snis_split_merge<T><<<unsigned(c.B), kThreads, 0, stream>>>(a, a.mean, a.moments ? a.mean64 : nullptr);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  if (!c.moments) return;
  snis_split_weights<T, true><<<unsigned(parts), kThreads, 0, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  snis_split_merge<T><<<unsigned(c.B), kThreads, 0, stream>>>(a, a.var, nullptr);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool split_applies(const SnisCall& c) {
  const int sms = cuda::multiprocessor_count(cuda::current_device());
  return c.N >= 2 * kMinChunk && c.B < int64_t(4) * sms;
}

void launch_split(const SnisCall& c) {
  dispatch_float(c.lw.scalar_type(), [&](auto zero) { launch_split_typed<decltype(zero)>(c); });
}

}  // namespace snis_paths
}  // namespace fused_ops
