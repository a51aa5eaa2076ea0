// CPU kernel of fused_ops::ode_mlp_backward: csrc/ode_mlp_core.h's backward
// sequence over the whole batch, products through torch's BLAS (which threads
// them), the elementwise passes of cpu/ode_mlp/ops.h.

#include <torch/csrc/stable/library.h>

#include "cpu/ode_mlp/ops.h"
#include "ode_mlp_backward.h"

namespace fused_ops {

std::vector<Tensor> ode_mlp_backward_cpu(const Tensor& grad_states, const Tensor& states,
                                         const Tensor& x0, const Tensor& t_grid,
                                         OptTensors weights, OptTensors biases,
                                         const Tensor& time_bias, std::optional<Tensor> sample_bias,
                                         int64_t method, int64_t activation, double act_param) {
  OdeMlpBackwardCall c(grad_states, states, x0, t_grid, weights, biases, time_bias, sample_bias,
                       method, activation, act_param);
  dispatch_float(c.x0.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const OdeMlpPtrs<T> p(c);
    ode_mlp_backward_run(p, cpu::OdeCpuOps<T>{}, cdata<T>(c.states), cdata<T>(c.grad_states),
                         c.template grads<T>(), c.x0, cpu_device());
  });
  return c.outputs;
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("ode_mlp_backward", TORCH_BOX(&ode_mlp_backward_cpu));
}

}  // namespace fused_ops
