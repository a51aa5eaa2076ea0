// \brief CUDA entry point of fused_ops::snis: argument checks and the
// kernel-path table (snis/cuda).
//
// Outputs per problem b of log weights lw [B, N] (and samples x [B, N, D]):
//   log_norm_weights = lw - logsumexp(lw),  ess = 1 / sum w^2,
//   log_evidence = logsumexp(lw) - log N,  mean = sum w x,  variance = sum w (x - mean)^2.
// Both paths run the block-level passes of kernels.cuh; they differ in how
// problems map to blocks (split: chunks of one problem over many blocks,
// merged in a fixed order; block: one block per problem, one launch).
// docs/snis.md describes the design.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <climits>

#include "common/dispatch.h"
#include "cuda/snis/kernels.cuh"

namespace fused_ops {
namespace {

using Call = SnisCall;
namespace sp = snis_paths;

const dispatch::PathTable<Call, 2> kPaths("snis", "cuda", {{
    {"split", "N >= 8192 and B < 4 x SMs (few problems, at least two chunks each)",
     "chunks of each problem over the whole GPU, partials merged in a fixed order", sp::split_applies,
     sp::launch_split},
    {"block", "anything else (any B, N, D)", "one block per problem: one launch for a whole batch",
     dispatch::always<Call>, sp::launch_block},
}});

SnisResult snis_cuda(const Tensor& log_weights, const std::optional<Tensor>& samples, bool moments) {
  const cuda::TensorDeviceGuard guard(log_weights);
  Call c(log_weights, samples, moments);
  FUSED_OPS_CHECK(log_weights.is_cuda(), "log_weights must be a CUDA tensor, got ", device_str(log_weights));
  FUSED_OPS_CHECK(c.D <= INT_MAX, "snis: D must fit in int32, got D=", c.D);
  if (c.B == 0) return c.result();
  kPaths.run(c);
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("snis", TORCH_BOX(&snis_cuda));
}

}  // namespace fused_ops
