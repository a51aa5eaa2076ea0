// \brief fused_ops::vae_elbo_backward: argument validation shared by the CPU and
// CUDA wrappers of the backward of fused_ops::vae_elbo.
//
// Schema (csrc/fused_ops.cpp):
//   vae_elbo_backward(Tensor? grad_elbo, Tensor? grad_recon, Tensor? grad_kl,
//                     <the 12 inputs of vae_elbo>) -> 12 gradients
// Each upstream gradient is [B] or None (= zeros).  The gradients come back
// contiguous, one per forward input, in the forward's argument order.
#pragma once

#include <optional>
#include <tuple>
#include <utility>

#include "common/low_precision.h"
#include "vae_elbo.h"

namespace fused_ops {

using VaeElboBackwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                         Tensor, Tensor, Tensor, Tensor, Tensor>;

// One backward call: the forward's checked, contiguous inputs, contiguous
// upstream gradients (nullopt where None) and freshly allocated gradient outputs.
// allow_bfloat16: vae_elbo_backward's checks, whose messages name bfloat16
// too (its bfloat16 calls are cast to float32 before they get here).
struct VaeElboBackwardCall : VaeElboInputs {
  std::optional<Tensor> g_elbo, g_recon, g_kl;
  Tensor gx, geps, gw_enc, gb_enc, gw_mu, gb_mu, gw_logvar, gb_logvar, gw_dec1, gb_dec1, gw_dec2,
      gb_dec2;

  VaeElboBackwardCall(const std::optional<Tensor>& grad_elbo,
                      const std::optional<Tensor>& grad_recon,
                      const std::optional<Tensor>& grad_kl, const Tensor& x_, const Tensor& eps_,
                      const Tensor& w_enc_, const Tensor& b_enc_, const Tensor& w_mu_,
                      const Tensor& b_mu_, const Tensor& w_logvar_, const Tensor& b_logvar_,
                      const Tensor& w_dec1_, const Tensor& b_dec1_, const Tensor& w_dec2_,
                      const Tensor& b_dec2_, bool with_grad_x = true, bool allow_bfloat16 = false)
      : VaeElboInputs(x_, eps_, w_enc_, b_enc_, w_mu_, b_mu_, w_logvar_, b_logvar_, w_dec1_,
                      b_dec1_, w_dec2_, b_dec2_, allow_bfloat16) {
    auto grad = [&](const std::optional<Tensor>& g, const char* name) -> std::optional<Tensor> {
      if (!g.has_value()) return std::nullopt;
      check_rank(*g, name, 1, "[B]");
      check_size(*g, name, 0, B, "B, the batch size of x");
      check_same_float_dtype_and_device({{x_, "x"}, {*g, name}});
      return as_contiguous(*g);
    };
    g_elbo = grad(grad_elbo, "grad_elbo");
    g_recon = grad(grad_recon, "grad_recon");
    g_kl = grad(grad_kl, "grad_kl");
    // Without grad_x (vae_elbo_train_backward when x needs no gradient) it
    // comes back as an empty tensor.
    gx = with_grad_x ? empty_like_device(x_, {B, I}) : empty_like_device(x_, {0});
    geps = empty_like_device(x_, {B, L});
    gw_enc = empty_like_device(x_, {H, I});
    gb_enc = empty_like_device(x_, {H});
    gw_mu = empty_like_device(x_, {L, H});
    gb_mu = empty_like_device(x_, {L});
    gw_logvar = empty_like_device(x_, {L, H});
    gb_logvar = empty_like_device(x_, {L});
    gw_dec1 = empty_like_device(x_, {H, L});
    gb_dec1 = empty_like_device(x_, {H});
    gw_dec2 = empty_like_device(x_, {I, H});
    gb_dec2 = empty_like_device(x_, {I});
  }

  VaeElboBackwardResult result() const {
    return {gx,    geps,      gw_enc,    gb_enc,  gw_mu,   gb_mu,
            gw_logvar, gb_logvar, gw_dec1, gb_dec1, gw_dec2, gb_dec2};
  }
};

// The backward of bfloat16 inputs: checked first (the forward's rules with
// bfloat16 allowed, and each upstream gradient in x's dtype, so a mixed call
// is refused by name; ranks and sizes are checked again, on the float32
// copies, by VaeElboBackwardCall), then `impl` (the device's backward, its
// whole float32 path table) on float32 copies, the gradients rounded to
// bfloat16 (common/low_precision.h).
template <typename Impl>
VaeElboBackwardResult vae_elbo_backward_bfloat16(
    Impl impl,
    const std::optional<Tensor>& grad_elbo, const std::optional<Tensor>& grad_recon,
    const std::optional<Tensor>& grad_kl, const Tensor& x, const Tensor& eps, const Tensor& w_enc,
    const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu, const Tensor& w_logvar,
    const Tensor& b_logvar, const Tensor& w_dec1, const Tensor& b_dec1, const Tensor& w_dec2,
    const Tensor& b_dec2, int64_t likelihood) {
  const auto s = check_vae_elbo_args(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1,
                                     b_dec1, w_dec2, b_dec2, /*allow_bfloat16=*/true);
  for (const auto& [g, name] : {std::pair<const std::optional<Tensor>&, const char*>{grad_elbo, "grad_elbo"},
                                {grad_recon, "grad_recon"},
                                {grad_kl, "grad_kl"}}) {
    if (!g.has_value()) continue;
    check_rank(*g, name, 1, "[B]");
    check_size(*g, name, 0, s.B, "B, the batch size of x");
    check_same_float_dtype_and_device({{x, "x"}, {*g, name}}, /*allow_bfloat16=*/true);
  }
  check_vae_likelihood(likelihood);
  return low_precision::in_float32(ScalarType::BFloat16, impl, grad_elbo, grad_recon, grad_kl, x, eps,
                                   w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1,
                                   w_dec2, b_dec2, likelihood);
}

}  // namespace fused_ops
