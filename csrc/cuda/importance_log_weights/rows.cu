// \brief importance_log_weights, CUDA forward paths "staged" and "global":
// one thread per sample row.
//
// What: lw[b, i] = logsumexp_{j < K} lc_ij - logsumexp_{j >= K} lc_ij, the
// component log densities lc_ij of paths.cuh, for all B problems.
// When: "staged" while one problem's prepared parameters fit 48 KB of shared
// memory (J D means in the inputs' dtype, J D reciprocal stds and J
// log-normalisers in double, J flags: J D <= ~4000 in float32, ~3000 in
// float64); "global" for every input.  The two are one kernel: "global"
// reads the parameters from global memory instead of staging them.
// Design.  Two launches on the current stream: `prepare` (common.cuh: 1/std
// and the log-normalisers of every component, one warp each), then a 1-D
// grid of B * ceil(N / 256) blocks of 256 threads; block index = b * nb + t,
// so every block belongs to one problem and B is not limited by gridDim.y.
// "staged": a block copies its problem's parameters to shared memory first;
// "global": it reads them where they are (the same addresses for every
// thread of a warp: broadcasts from L1).  Each thread walks the J components of its row,
// the row re-read from L1 per component (rows are D consecutive elements,
// so a warp's first pass reads a contiguous 32 D-element span), keeping an
// online log-sum-exp for the target and one for the proposal.  Numerics:
// all in double (z = (x - mu) * (1/std in double), squares, sums,
// log-sum-exps), lw rounded once, as on the CPU; no reductions across
// threads: bitwise reproducible.

#include "cuda/importance_log_weights/paths.cuh"

namespace fused_ops {
namespace importance_log_weights_paths {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) rows_kernel(const Params<T> p, const T* x, T* lw, int64_t blocks_per_problem,
                                                        bool staged) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t b = blockIdx.x / blocks_per_problem;
  const int64_t i = (blockIdx.x % blocks_per_problem) * kThreads + threadIdx.x;
  const Staged<T> s = stage(p, b, staged, smem);
  if (i >= p.N) return;
  const int64_t row = b * p.N + i;
  LogSumExp<double> lp, lq;
  row_log_sums(p, s, x + row * p.D, lp, lq);
  lw[row] = T(lp.value() - lq.value());
}

template <typename T>
void launch_rows_typed(const ImportanceLogWeightsCall& c, bool staged) {
  const int device = cuda::current_device();
  const cudaStream_t stream = cuda::current_stream(device);
  const Tensor ws = float64_workspace(c.x, prepared_doubles(c.B, c.K + c.Kq, c.D), "importance_log_weights");
  const Params<T> p = make_params<T>(c, mdata<double>(ws));
  launch_prepare(p, stream);
  const int64_t nb = (c.N + kThreads - 1) / kThreads;
  const size_t smem = staged_bytes(p.J, p.D, sizeof(T));
  rows_kernel<T><<<unsigned(c.B * nb), kThreads, staged ? smem : 0, stream>>>(p, cdata<T>(c.x),
                                                                             mdata<T>(c.log_weights), nb, staged);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool staged_applies(const ImportanceLogWeightsCall& c) {
  return staged_bytes(c.K + c.Kq, c.D, c.x.scalar_type() == ScalarType::Double ? 8 : 4) <= kSharedBudget;
}

void launch_staged(const ImportanceLogWeightsCall& c) {
  dispatch_float(c.x.scalar_type(), [&](auto zero) { launch_rows_typed<decltype(zero)>(c, true); });
}

void launch_global(const ImportanceLogWeightsCall& c) {
  dispatch_float(c.x.scalar_type(), [&](auto zero) { launch_rows_typed<decltype(zero)>(c, false); });
}

}  // namespace importance_log_weights_paths
}  // namespace fused_ops
