// \brief snis, path "block": one block per problem, everything in one launch.
//
// When: the split path does not apply (problems shorter than two of its
// chunks, or enough problems to fill the GPU with one block each: B >= 4 x
// SMs); correct for every input (a large N runs, slowly, on one block).
//
// Design.  Block b (grid-stride over problems) runs kernels.cuh's passes
// over the whole row: block_stats (one read of the log weights) gives
// logsumexp, ESS and evidence; block_moments writes the normalised log
// weights and, with samples, the mean (one read of the samples, the log
// weights again from L1/L2); with moments=True a second block_moments
// takes the variance about that mean (held in double in a [B, D]
// workspace).  No cross-block partials, so no workspace for the sums and
// one launch however many problems: the batched case (1024 problems x
// N = 4096) is one kernel where a loop of calls would be 1024 launches.

#include "cuda/snis/kernels.cuh"

namespace fused_ops {
namespace snis_paths {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) snis_block_kernel(const Args<T> a) {
  __shared__ SnisStats scratch[kWarps];
  __shared__ MomentScratch sm;
  const double log_n = log(double(a.N));
  for (int64_t b = blockIdx.x; b < a.B; b += gridDim.x) {
    const T* lw = a.lw + b * a.N;
    const T* x = a.x ? a.x + b * a.N * a.D : nullptr;
    const SnisStats s = block_stats(lw, 0, a.N, scratch);
    const double lse = s.log_sum();
    if (threadIdx.x == 0) {
      a.ess[b] = T(s.ess());
      a.logz[b] = T(lse - log_n);
    }
    double* mu = a.mean64 ? a.mean64 + b * a.D : nullptr;
    block_moments(lw, x, a.D, 0, a.N, lse, a.lnw + b * a.N, nullptr, sm, [&](int d, double v) {
      a.mean[b * a.D + d] = T(v);
      if (mu) mu[d] = v;
    });
    if (a.moments) {
      __syncthreads();  // mu written by other threads of the block
      block_moments(lw, x, a.D, 0, a.N, lse, static_cast<T*>(nullptr), mu, sm,
                    [&](int d, double v) { a.var[b * a.D + d] = T(v); });
    }
    __syncthreads();  // scratch reused by the next problem
  }
}

template <typename T>
void launch_block_typed(const SnisCall& c) {
  Args<T> a = make_args<T>(c);
  Tensor ws;
  if (c.moments && c.D > 0) {
    ws = float64_workspace(c.lw, c.B * c.D, "snis");
    a.mean64 = mdata<double>(ws);
  }
  const int sms = cuda::multiprocessor_count(cuda::current_device());
  const int64_t grid = std::min<int64_t>(c.B, int64_t(sms) * 64);
  snis_block_kernel<T><<<unsigned(grid), kThreads, 0, cuda::current_stream(cuda::current_device())>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void launch_block(const SnisCall& c) {
  dispatch_float(c.lw.scalar_type(), [&](auto zero) { launch_block_typed<decltype(zero)>(c); });
}

}  // namespace snis_paths
}  // namespace fused_ops
