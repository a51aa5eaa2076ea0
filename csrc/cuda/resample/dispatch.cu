// \brief CUDA entry point of fused_ops::resample: argument checks and the
// kernel-path table (resample/cuda).
//
// indices [..., M] (int64, ascending per problem) from log weights [..., N]
// and float64 uniforms: csrc/resample.h states the math.  Both paths build
// the float64 CDF of exp(lw - max) in shared-memory tiles and search it at
// the sorted positions; they differ in how many blocks share a problem.
// No host synchronisation: a problem without a positive weight (or with NaN
// or +inf) gets -1 in every index.  docs/resample.md describes the design.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "common/dispatch.h"
#include "cuda/resample/paths.cuh"

namespace fused_ops {
namespace {

using Call = ResampleCall;
namespace rp = resample_paths;

const dispatch::PathTable<Call, 2> kPaths("resample", "cuda", {{
    {"multiblock", "N >= 65536, at most 64 problems",
     "a few big problems: chunks of each problem on many blocks (three launches; multinomial: seven)",
     rp::multiblock_applies, rp::launch_multiblock},
    {"block", "anything else (any N, M, method, batch)",
     "one block per problem: batches of problems, and small N",
     dispatch::always<Call>, rp::launch_block},
}});

Tensor resample_cuda(const Tensor& log_weights, const Tensor& uniforms, int64_t num_samples, std::string method) {
  const cuda::TensorDeviceGuard guard(log_weights);
  Call c(log_weights, uniforms, num_samples, method);
  FUSED_OPS_CHECK(log_weights.is_cuda(), "log_weights must be a CUDA tensor, got ", device_str(log_weights));
  kPaths.run(c);
  return c.indices;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("resample", TORCH_BOX(&resample_cuda));
}

}  // namespace fused_ops
