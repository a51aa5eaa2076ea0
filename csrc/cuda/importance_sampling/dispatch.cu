// \brief CUDA entry point of fused_ops::importance_sampling: argument checks
// and the kernel-path table (importance_sampling/cuda).
//
// Outputs, for samples x [N, D] drawn from a diagonal Gaussian proposal q and
// a target p that is a K-component diagonal Gaussian mixture:
//   log_weights_i = lw_i - logsumexp_j lw_j,  lw_i = log p(x_i) - log q(x_i)
//   weighted_mean = sum_i w_i x_i,  ess = 1 / sum_i w_i^2,  w_i = exp(log_weights_i)
// Both paths are one cooperative launch of the same two phases (paths.cuh);
// they differ in where the prepared parameters and the row live.  The
// predicates are cheap host arithmetic (fast_plan), evaluated again by the
// launcher.  docs/importance_sampling.md describes the design and what was
// tried.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <climits>

#include "common/dispatch.h"
#include "cuda/importance_sampling/paths.cuh"

namespace fused_ops {
namespace {

using Call = ImportanceSamplingCall;
namespace is = importance_sampling_paths;

const dispatch::PathTable<Call, 2> kPaths("importance_sampling", "cuda", {{
    {"fast", "D <= 512 and the prepared parameters + group sums fit 96 KB of shared memory (small K*D)",
     "parameters in shared memory, each row read once into registers: no re-reads, no global workspace",
     is::fast_applies, is::launch_fast},
    {"general", "anything else (any D, K)",
     "parameters prepared into global memory, rows re-read from L1/L2 per component",
     dispatch::always<Call>, is::launch_general},
}});

ImportanceSamplingResult importance_sampling_cuda(const Tensor& samples, const Tensor& mix_weights,
                                                  const Tensor& mix_mus, const Tensor& mix_stds,
                                                  const Tensor& q_mu, const Tensor& q_std) {
  const cuda::TensorDeviceGuard guard(samples);
  Call c(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std);
  FUSED_OPS_CHECK(samples.is_cuda(), "samples must be a CUDA tensor, got ", device_str(samples));
  FUSED_OPS_CHECK(c.D <= INT_MAX && c.K <= INT_MAX,
                  "importance_sampling: D and K must fit in int32, got D=", c.D, ", K=", c.K);
  kPaths.run(c);
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("importance_sampling", TORCH_BOX(&importance_sampling_cuda));
}

}  // namespace fused_ops
