// \brief fused_ops::ode_mlp_backward on CUDA: the entry point and its path
// table.  One path, "stepwise": csrc/ode_mlp_core.h's backward sequence
// (per step: recompute the stages from the saved state, then the adjoint of
// every stage in reverse), its products as cuBLAS calls over all B rows (the
// weight gradients over the stages of a step stacked as rows) on torch's
// current stream, its elementwise work the kernels of cuda/ode_mlp/ops.cuh.
// Launches per step: about stages * (3 L + 4) + 3 L + 2; memory besides the
// saved states: stages * B * (2 D + 3 sum H_l) + 3 B D + the largest weight.
// float32 products follow torch.backends.cuda.matmul.allow_tf32 (off by
// default).  Deterministic: fixed product shapes, column sums in row order.
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "common/dispatch.h"
#include "cuda/ode_mlp/ops.cuh"
#include "cuda/primitives/runtime.cuh"
#include "ode_mlp_backward.h"

namespace fused_ops {
namespace {

void launch_stepwise(const OdeMlpBackwardCall& c) {
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  dispatch_float(c.x0.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const OdeMlpPtrs<T> p(c);
    ode_mlp_backward_run(p, ode_cuda::OdeCudaOps<T>{stream}, cdata<T>(c.states),
                         cdata<T>(c.grad_states), c.template grads<T>(), c.x0, c.x0.device());
  });
}

const dispatch::PathTable<OdeMlpBackwardCall, 1> kOdeMlpBackwardPaths(
    "ode_mlp_backward", "cuda",
    {{
        {"stepwise", "anything", "correct for every input: cuBLAS products, fused elementwise kernels",
         dispatch::always<OdeMlpBackwardCall>, launch_stepwise},
    }});

std::vector<Tensor> ode_mlp_backward_cuda(const Tensor& grad_states, const Tensor& states,
                                          const Tensor& x0, const Tensor& t_grid,
                                          OptTensors weights, OptTensors biases,
                                          const Tensor& time_bias, std::optional<Tensor> sample_bias,
                                          int64_t method, int64_t activation, double act_param) {
  const cuda::TensorDeviceGuard guard(x0);
  OdeMlpBackwardCall c(grad_states, states, x0, t_grid, weights, biases, time_bias, sample_bias,
                       method, activation, act_param);
  FUSED_OPS_CHECK(x0.is_cuda(), "x0 must be a CUDA tensor, got ", device_str(x0));
  kOdeMlpBackwardPaths.run(c);
  return c.outputs;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("ode_mlp_backward", TORCH_BOX(&ode_mlp_backward_cuda));
}

}  // namespace fused_ops
