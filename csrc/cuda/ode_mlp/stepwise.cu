// \brief ode_mlp's "stepwise" CUDA path: csrc/ode_mlp_core.h's step sequence
// over the whole batch, its products cuBLAS calls (common/matmul.h, torch's
// current stream), its elementwise work the kernels of cuda/ode_mlp/ops.cuh.
//
// When chosen: paths.cuh's rule (stepwise_applies), set from the measured
// crossovers with tiled and the fused kernel: where one cuBLAS product per
// layer and stage over all B rows beats the one-launch kernels, and the
// launches (about stages (2 L + 1) + 1 per step) cost little
// beside the products.  Memory: one stage's activations for all rows plus
// the stage inputs and velocities, stages * B * 2 D + B sum H_l + 2 B D
// elements.  float32 products follow torch.backends.cuda.matmul.allow_tf32
// (off by default: float32 accurate); deterministic for fixed shapes, as the
// backward's products are.
#include <cuda_runtime.h>

#include "common/dispatch.h"
#include "cuda/ode_mlp/ops.cuh"
#include "cuda/ode_mlp/paths.cuh"
#include "cuda/primitives/runtime.cuh"
#include "ode_mlp_core.h"

namespace fused_ops {
namespace ode_mlp_paths {

bool stepwise_applies(const OdeMlpCall& c) {
  if (dispatch::is_forced("ode_mlp", "cuda", "stepwise")) return true;
  if (c.B < kStepwiseMinRows) return false;
  // Multiply-adds of one row's evaluation of the field (the time column is a bias).
  double macs = 0;
  for (int64_t l = 0; l < c.L; ++l) macs += double(c.widths[l]) * double(l ? c.widths[l - 1] : c.D);
  if (macs >= kStepwiseFewTilesMacs && c.B < kStepwiseFewTilesRows) return true;
  if (c.Hmax <= kStepwiseNarrowWidth && c.B >= kStepwiseNarrowRows) return true;
  return !tiled_applies(c) && (macs >= kStepwiseWideMacs || c.B >= kStepwiseManyRows);
}

void launch_stepwise(const OdeMlpCall& c) {
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  dispatch_float(c.x0.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const OdeMlpPtrs<T> p(c);
    const Tensor work = empty_like_device(c.x0, {ode_mlp_forward_work(p, c.B)});
    ode_mlp_forward_rows(p, ode_cuda::OdeCudaOps<T>{stream}, mdata<T>(c.states), c.all_states, 0, c.B,
                         mdata<T>(work), c.x0.device());
  });
}

}  // namespace ode_mlp_paths
}  // namespace fused_ops
