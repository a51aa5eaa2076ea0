// \brief CUDA entry points of fused_ops::vae_elbo_backward and
// vae_elbo_train_backward: argument checks, the empty batch, the kernel-path
// tables, and the ops' CUDA registrations.
//
// Two paths, chosen by the amount of work (multiply-adds of the products,
// about B H (6 I + 8 L)): one cooperative launch while the GPU work is small
// enough that host calls would dominate (backward_persistent.cu), cuBLAS
// products with fused elementwise kernels beyond (backward_cublas.cu).
// Force one through fused_ops._paths or FUSED_OPS_FORCE_PATH
// ("vae_elbo_backward=cublas"); docs/vae_elbo.md describes both.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <optional>
#include <type_traits>

#include "common/dispatch.h"
#include "cuda/vae_elbo/backward_paths.cuh"

namespace fused_ops {
namespace {

using vae_elbo_backward_kernels::BackwardLaunch;

const dispatch::PathTable<BackwardLaunch, 2> kPaths("vae_elbo_backward", "cuda", {{
    {"persistent", "B H (6 I + 8 L) <= 1.5e9 multiply-adds (B <= 1181 at 784-256-32)",
     "one cooperative launch of tile products: small batches would be bound by cuBLAS's host calls",
     vae_elbo_backward_kernels::persistent_applies, vae_elbo_backward_kernels::launch_persistent},
    {"cublas", "anything else",
     "products on cuBLAS, elementwise stages fused between them: large batches",
     dispatch::always<BackwardLaunch>, vae_elbo_backward_kernels::launch_cublas},
}});

// vae_elbo_train_backward: the chain rule on vae_elbo_train's activations,
// no forward recomputed.  One path; the table reports it and refuses a forced
// name that is not it, as every table does.
const dispatch::PathTable<BackwardLaunch, 1> kTrainPaths("vae_elbo_train_backward", "cuda", {{
    {"cublas", "anything",
     "products on cuBLAS over the saved activations (8 or 9 of vae_elbo_backward's 13: no forward)",
     dispatch::always<BackwardLaunch>, vae_elbo_backward_kernels::launch_cublas},
}});

// An empty batch: the weight and bias gradients are zero (the per-sample
// gradients are empty).
template <typename T>
void zero_weight_grads(const VaeElboBackwardCall& c) {
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  for (const Tensor* t : {&c.gw_enc, &c.gb_enc, &c.gw_mu, &c.gb_mu, &c.gw_logvar, &c.gb_logvar,
                          &c.gw_dec1, &c.gb_dec1, &c.gw_dec2, &c.gb_dec2})
    FUSED_OPS_CUDA_CHECK(cudaMemsetAsync(mdata<T>(*t), 0, size_t(t->numel()) * sizeof(T), stream));
}

VaeElboBackwardResult vae_elbo_backward_cuda(
    const std::optional<Tensor>& grad_elbo, const std::optional<Tensor>& grad_recon,
    const std::optional<Tensor>& grad_kl, const Tensor& x, const Tensor& eps, const Tensor& w_enc,
    const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu, const Tensor& w_logvar,
    const Tensor& b_logvar, const Tensor& w_dec1, const Tensor& b_dec1, const Tensor& w_dec2,
    const Tensor& b_dec2, int64_t likelihood) {
  const cuda::TensorDeviceGuard guard(x);
  if (is_bfloat16(x)) {  // checked, then the float32 backward on float32 copies
    return vae_elbo_backward_bfloat16(vae_elbo_backward_cuda, grad_elbo, grad_recon, grad_kl, x, eps, w_enc,
                                      b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1,
                                      w_dec2, b_dec2, likelihood);
  }
  VaeElboBackwardCall c(grad_elbo, grad_recon, grad_kl, x, eps, w_enc, b_enc, w_mu, b_mu,
                        w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2, /*with_grad_x=*/true,
                        /*allow_bfloat16=*/true);  // the messages of the bfloat16-taking op
  c.likelihood = check_vae_likelihood(likelihood);
  FUSED_OPS_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", device_str(x));
  dispatch_float(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    if (c.B == 0) {
      zero_weight_grads<T>(c);
    } else {
      kPaths.run(BackwardLaunch{c, std::is_same_v<T, float>});
    }
  });
  return c.result();
}

// The checks of the CPU wrapper (csrc/cpu/vae_elbo/backward.cpp), in its order.
VaeElboBackwardResult vae_elbo_train_backward_cuda(
    const std::optional<Tensor>& grad_elbo, const std::optional<Tensor>& grad_recon,
    const std::optional<Tensor>& grad_kl, const Tensor& x, const Tensor& eps, const Tensor& w_enc,
    const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu, const Tensor& w_logvar,
    const Tensor& b_logvar, const Tensor& w_dec1, const Tensor& b_dec1, const Tensor& w_dec2,
    const Tensor& b_dec2, const Tensor& saved, bool compute_grad_x, int64_t likelihood) {
  const cuda::TensorDeviceGuard guard(x);
  VaeElboBackwardCall c(grad_elbo, grad_recon, grad_kl, x, eps, w_enc, b_enc, w_mu, b_mu,
                        w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2, compute_grad_x);
  c.likelihood = check_vae_likelihood(likelihood);
  check_vae_saved(saved, c);
  FUSED_OPS_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", device_str(x));
  const Tensor saved_c = as_contiguous(saved);
  dispatch_float(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    if (c.B == 0) {
      zero_weight_grads<T>(c);
    } else {
      BackwardLaunch l{c, std::is_same_v<T, float>};
      l.saved = &saved_c;
      kTrainPaths.run(l);
    }
  });
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("vae_elbo_backward", TORCH_BOX(&vae_elbo_backward_cuda));
  m.impl("vae_elbo_train_backward", TORCH_BOX(&vae_elbo_train_backward_cuda));
}

}  // namespace fused_ops
