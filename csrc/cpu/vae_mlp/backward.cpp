// \brief CPU kernel of fused_ops::vae_mlp_elbo_backward: csrc/vae_mlp_core.h's
// backward over the whole batch (the forward recomputed with its activations
// kept, then the chain rule), products through torch's BLAS (which threads
// them: bitwise repeatable at a given thread count), the elementwise passes
// of cpu/vae_mlp/ops.h.

#include <torch/csrc/stable/library.h>

#include "cpu/vae_mlp/ops.h"
#include "vae_mlp_core.h"

namespace fused_ops {

std::vector<Tensor> vae_mlp_elbo_backward_cpu(
    std::optional<Tensor> grad_elbo, std::optional<Tensor> grad_recon, std::optional<Tensor> grad_kl,
    const Tensor& x, const Tensor& eps, VaeOptTensors enc_weights, VaeOptTensors enc_biases,
    const Tensor& w_head, const Tensor& b_head, VaeOptTensors dec_weights, VaeOptTensors dec_biases,
    std::optional<Tensor> dec_logvar, int64_t activation, double act_param, int64_t likelihood,
    bool grad_x) {
  VaeMlpBackwardCall c(grad_elbo, grad_recon, grad_kl, x, eps, enc_weights, enc_biases, w_head,
                       b_head, dec_weights, dec_biases, dec_logvar, activation, act_param,
                       likelihood, grad_x);
  dispatch_float(c.x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const VaeMlpPtrs<T> p(c);
    const VaeMlpGrads<T> g(c.outputs, c.Le, c.Ld, c.dec_logvar.has_value());
    vae_mlp_backward_run(p, cpu::VaeMlpCpuOps<T>{}, cdata_or_null<T>(c.grad_elbo),
                         cdata_or_null<T>(c.grad_recon), cdata_or_null<T>(c.grad_kl), g, c.x,
                         cpu_device());
  });
  return c.outputs;
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("vae_mlp_elbo_backward", TORCH_BOX(&vae_mlp_elbo_backward_cpu));
}

}  // namespace fused_ops
