// \brief fused_ops::vae_elbo: argument validation shared by the CPU and CUDA
// wrappers, and the call structs they start from (inputs checked and made
// contiguous, outputs allocated; vae_elbo_train's saved activations).
//
// Sizes come from x [B, I], w_enc [H, I] (H) and w_mu [L, H] (L); every other
// tensor is checked against them, so a weight chain that does not connect is
// reported at the first tensor that breaks it.
#pragma once

#include <tuple>

#include "common/checks.h"
#include "common/likelihood.h"

namespace fused_ops {

struct VaeElboSizes {
  int64_t B, I, H, L;
};

inline VaeElboSizes check_vae_elbo_args(const Tensor& x, const Tensor& eps,
                                        const Tensor& w_enc, const Tensor& b_enc,
                                        const Tensor& w_mu, const Tensor& b_mu,
                                        const Tensor& w_logvar, const Tensor& b_logvar,
                                        const Tensor& w_dec1, const Tensor& b_dec1,
                                        const Tensor& w_dec2, const Tensor& b_dec2,
                                        bool allow_bfloat16 = false) {
  check_rank(x, "x", 2, "[B, I]");
  check_rank(eps, "eps", 2, "[B, L]");
  check_rank(w_enc, "w_enc", 2, "[H, I]");
  check_rank(b_enc, "b_enc", 1, "[H]");
  check_rank(w_mu, "w_mu", 2, "[L, H]");
  check_rank(b_mu, "b_mu", 1, "[L]");
  check_rank(w_logvar, "w_logvar", 2, "[L, H]");
  check_rank(b_logvar, "b_logvar", 1, "[L]");
  check_rank(w_dec1, "w_dec1", 2, "[H, L]");
  check_rank(b_dec1, "b_dec1", 1, "[H]");
  check_rank(w_dec2, "w_dec2", 2, "[I, H]");
  check_rank(b_dec2, "b_dec2", 1, "[I]");
  const int64_t B = x.size(0), I = x.size(1), H = w_enc.size(0), L = w_mu.size(0);
  FUSED_OPS_CHECK(I >= 1, "x must have at least one feature (I >= 1), got shape ", shape_str(x));
  FUSED_OPS_CHECK(H >= 1, "w_enc must have at least one hidden unit (H >= 1), got shape ",
              shape_str(w_enc));
  FUSED_OPS_CHECK(L >= 1, "w_mu must have at least one latent unit (L >= 1), got shape ",
              shape_str(w_mu));
  check_size(w_enc, "w_enc", 1, I, "I, the input dimension of x");
  check_size(b_enc, "b_enc", 0, H, "H, the hidden dimension of w_enc");
  check_size(w_mu, "w_mu", 1, H, "H, the hidden dimension of w_enc");
  check_size(b_mu, "b_mu", 0, L, "L, the latent dimension of w_mu");
  check_size(w_logvar, "w_logvar", 0, L, "L, the latent dimension of w_mu");
  check_size(w_logvar, "w_logvar", 1, H, "H, the hidden dimension of w_enc");
  check_size(b_logvar, "b_logvar", 0, L, "L, the latent dimension of w_mu");
  check_size(eps, "eps", 0, B, "B, the batch size of x");
  check_size(eps, "eps", 1, L, "L, the latent dimension of w_mu");
  check_size(w_dec1, "w_dec1", 0, H, "H, the hidden dimension of w_enc");
  check_size(w_dec1, "w_dec1", 1, L, "L, the latent dimension of w_mu");
  check_size(b_dec1, "b_dec1", 0, H, "H, the hidden dimension of w_enc");
  check_size(w_dec2, "w_dec2", 0, I, "I, the input dimension of x");
  check_size(w_dec2, "w_dec2", 1, H, "H, the hidden dimension of w_enc");
  check_size(b_dec2, "b_dec2", 0, I, "I, the input dimension of x");
  check_same_float_dtype_and_device({{x, "x"},
                                     {eps, "eps"},
                                     {w_enc, "w_enc"},
                                     {b_enc, "b_enc"},
                                     {w_mu, "w_mu"},
                                     {b_mu, "b_mu"},
                                     {w_logvar, "w_logvar"},
                                     {b_logvar, "b_logvar"},
                                     {w_dec1, "w_dec1"},
                                     {b_dec1, "b_dec1"},
                                     {w_dec2, "w_dec2"},
                                     {b_dec2, "b_dec2"}},
                                    allow_bfloat16);
  return {B, I, H, L};
}

using VaeElboResult = std::tuple<Tensor, Tensor, Tensor>;

// The likelihood argument (common/likelihood.h), checked after the tensors;
// fused_ops/ops/_vae_elbo.py's _check_likelihood has the same message.
inline int64_t check_vae_likelihood(int64_t likelihood) {
  FUSED_OPS_CHECK(likelihood >= 0 && likelihood < kNumVaeLikelihoods,
                  "likelihood must be 0 (Bernoulli), 1 (Bernoulli from logits), 2 (Gaussian, mean "
                  "sigmoid(logits)) or 3 (Gaussian, mean = logits), got ", likelihood);
  return likelihood;
}

// One call's checked sizes and contiguous inputs: what the forward and the
// backward wrappers (vae_elbo_backward.h) both start from.  allow_bfloat16:
// the CUDA forward's bfloat16 path (all inputs bfloat16, outputs too).
struct VaeElboInputs {
  int64_t B, I, H, L;
  int64_t likelihood = kBernoulli;  // set by the wrappers (check_vae_likelihood)
  Tensor x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2;

  VaeElboInputs(const Tensor& x_, const Tensor& eps_, const Tensor& w_enc_, const Tensor& b_enc_,
                const Tensor& w_mu_, const Tensor& b_mu_, const Tensor& w_logvar_,
                const Tensor& b_logvar_, const Tensor& w_dec1_, const Tensor& b_dec1_,
                const Tensor& w_dec2_, const Tensor& b_dec2_, bool allow_bfloat16 = false) {
    const auto s = check_vae_elbo_args(x_, eps_, w_enc_, b_enc_, w_mu_, b_mu_, w_logvar_,
                                       b_logvar_, w_dec1_, b_dec1_, w_dec2_, b_dec2_,
                                       allow_bfloat16);
    B = s.B, I = s.I, H = s.H, L = s.L;
    x = as_contiguous(x_);
    eps = as_contiguous(eps_);
    w_enc = as_contiguous(w_enc_);
    b_enc = as_contiguous(b_enc_);
    w_mu = as_contiguous(w_mu_);
    b_mu = as_contiguous(b_mu_);
    w_logvar = as_contiguous(w_logvar_);
    b_logvar = as_contiguous(b_logvar_);
    w_dec1 = as_contiguous(w_dec1_);
    b_dec1 = as_contiguous(b_dec1_);
    w_dec2 = as_contiguous(w_dec2_);
    b_dec2 = as_contiguous(b_dec2_);
  }
};

// One forward call: the inputs plus freshly allocated outputs.
struct VaeElboCall : VaeElboInputs {
  Tensor elbo, recon, kl;

  VaeElboCall(const Tensor& x_, const Tensor& eps_, const Tensor& w_enc_, const Tensor& b_enc_,
              const Tensor& w_mu_, const Tensor& b_mu_, const Tensor& w_logvar_,
              const Tensor& b_logvar_, const Tensor& w_dec1_, const Tensor& b_dec1_,
              const Tensor& w_dec2_, const Tensor& b_dec2_, bool allow_bfloat16 = false)
      : VaeElboInputs(x_, eps_, w_enc_, b_enc_, w_mu_, b_mu_, w_logvar_, b_logvar_, w_dec1_,
                      b_dec1_, w_dec2_, b_dec2_, allow_bfloat16) {
    elbo = empty_like_device(x_, {B});
    recon = empty_like_device(x_, {B});
    kl = empty_like_device(x_, {B});
  }

  VaeElboResult result() const { return {elbo, recon, kl}; }
};

// ---------------------------------------------------------------------------
// vae_elbo_train: the forward that also keeps its activations
// ---------------------------------------------------------------------------
//
// Recomputing the forward in the backward costs as much as the forward's
// products (the CPU's BLAS, CUDA's cuBLAS chain at large batches); when
// autograd needs the backward, vae_elbo_train computes the same losses and
// keeps the activations the backward would recompute, in one flat buffer of
// planar sections:
//   h [B, H] (after ReLU) | ml [B, 2L] (mu, logvar) | z [B, L] |
//   g [B, H] (decoder hidden, after ReLU) | logits [B, I] (with bias)
struct VaeSavedLayout {
  int64_t h, ml, z, g, logits, total;  // section offsets, total size, in elements

  VaeSavedLayout(int64_t B, int64_t I, int64_t H, int64_t L)
      : h(0),
        ml(h + B * H),
        z(ml + B * 2 * L),
        g(z + B * L),
        logits(g + B * H),
        total(logits + B * I) {}
};

// vae_elbo_train_backward's rules for its `saved` argument (both devices):
// vae_elbo_train's fourth output for these inputs.
inline void check_vae_saved(const Tensor& saved, const VaeElboInputs& c) {
  const int64_t expected = VaeSavedLayout(c.B, c.I, c.H, c.L).total;
  check_rank(saved, "saved", 1, "[B * (2H + 3L + I)], vae_elbo_train's fourth output");
  FUSED_OPS_CHECK(saved.size(0) == expected, "saved must hold B * (2H + 3L + I) = ", expected,
                  " elements (vae_elbo_train's fourth output for these inputs), got shape ",
                  shape_str(saved));
  check_same_float_dtype_and_device({{c.x, "x"}, {saved, "saved"}});
}

using VaeElboTrainResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;

struct VaeElboTrainCall : VaeElboCall {
  Tensor saved;

  VaeElboTrainCall(const Tensor& x_, const Tensor& eps_, const Tensor& w_enc_,
                   const Tensor& b_enc_, const Tensor& w_mu_, const Tensor& b_mu_,
                   const Tensor& w_logvar_, const Tensor& b_logvar_, const Tensor& w_dec1_,
                   const Tensor& b_dec1_, const Tensor& w_dec2_, const Tensor& b_dec2_)
      : VaeElboCall(x_, eps_, w_enc_, b_enc_, w_mu_, b_mu_, w_logvar_, b_logvar_, w_dec1_,
                    b_dec1_, w_dec2_, b_dec2_) {
    saved = empty_like_device(x_, {VaeSavedLayout(B, I, H, L).total});
  }

  VaeElboTrainResult result() const { return {elbo, recon, kl, saved}; }
};

}  // namespace fused_ops
