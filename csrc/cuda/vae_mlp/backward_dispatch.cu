// \brief fused_ops::vae_mlp_elbo_backward on CUDA: the entry point and its
// path table.  One path, "cublas": csrc/vae_mlp_core.h's backward over the
// whole batch -- the forward recomputed with its activations kept, then per
// layer, last to first, two cuBLAS products (the weight gradient G^T IN and
// the gradient of the layer's input G W, no transposes copied) and fused
// kernels of cuda/vae_mlp/ops.cuh (the likelihood's backward at the logits
// and targets, the head's backward through the reparameterisation and KL,
// activation gradients, fixed-order column sums for the biases and
// dec_logvar).  Workspace: about B (2 sum of widths + 6L + 3I) elements.
// Deterministic: no atomics.
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "common/dispatch.h"
#include "cuda/primitives/runtime.cuh"
#include "cuda/vae_mlp/ops.cuh"
#include "vae_mlp_core.h"

namespace fused_ops {
namespace {

void launch_cublas(const VaeMlpBackwardCall& c) {
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  dispatch_float(c.x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const VaeMlpPtrs<T> p(c);
    const VaeMlpGrads<T> g(c.outputs, c.Le, c.Ld, c.dec_logvar.has_value());
    vae_mlp_backward_run(p, vae_mlp_cuda::VaeMlpCudaOps<T>(stream), cdata_or_null<T>(c.grad_elbo),
                         cdata_or_null<T>(c.grad_recon), cdata_or_null<T>(c.grad_kl), g, c.x,
                         c.x.device());
  });
}

const dispatch::PathTable<VaeMlpBackwardCall, 1> kVaeMlpBackwardPaths(
    "vae_mlp_elbo_backward", "cuda",
    {{
        {"cublas", "anything", "any depth and widths: cuBLAS products, fused elementwise kernels",
         dispatch::always<VaeMlpBackwardCall>, launch_cublas},
    }});

std::vector<Tensor> vae_mlp_elbo_backward_cuda(
    std::optional<Tensor> grad_elbo, std::optional<Tensor> grad_recon, std::optional<Tensor> grad_kl,
    const Tensor& x, const Tensor& eps, VaeOptTensors enc_weights, VaeOptTensors enc_biases,
    const Tensor& w_head, const Tensor& b_head, VaeOptTensors dec_weights, VaeOptTensors dec_biases,
    std::optional<Tensor> dec_logvar, int64_t activation, double act_param, int64_t likelihood,
    bool grad_x) {
  const cuda::TensorDeviceGuard guard(x);
  VaeMlpBackwardCall c(grad_elbo, grad_recon, grad_kl, x, eps, enc_weights, enc_biases, w_head,
                       b_head, dec_weights, dec_biases, dec_logvar, activation, act_param,
                       likelihood, grad_x);
  FUSED_OPS_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", device_str(x));
  kVaeMlpBackwardPaths.run(c);
  return c.outputs;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("vae_mlp_elbo_backward", TORCH_BOX(&vae_mlp_elbo_backward_cuda));
}

}  // namespace fused_ops
