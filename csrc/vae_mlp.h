// fused_ops::vae_mlp_elbo: the per-sample ELBO of a VAE whose encoder and
// decoder are MLPs of 1 to 4 hidden layers (any widths, one activation across
// both networks), with the argument checks shared by the CPU and CUDA
// wrappers and by the backward (vae_mlp_elbo_backward).
//
//   h_0 = x;  h_l = act(h_{l-1} E_l^T + e_l)              l = 1 .. Le    (enc_weights/biases)
//   [mu | logvar] = h_Le W_head^T + b_head                 [B, 2L]        (split at L)
//   z = mu + exp(0.5 logvar) eps
//   g_0 = z;  g_l = act(g_{l-1} D_l^T + d_l)               l = 1 .. Ld-1  (dec_weights/biases)
//   a = g_{Ld-1} D_Ld^T + d_Ld                             [B, I]         (logits / means)
//   recon = sum_i term(a_i, x_i)     (common/likelihood.h; with dec_logvar s [I], likelihood 3:
//                                     0.5 ((a - x)^2 e^{-s} + s + log 2 pi), Normal's NLL)
//   kl = -0.5 sum_l (1 + logvar - mu^2 - exp(logvar));   elbo = -(recon + kl)
//
// The weights are nn.Linear's [out, in]; the sizes come from x [B, I], eps
// [B, L] and the weights, each checked against the layer before, so a chain
// that does not connect is reported at the first tensor that breaks it,
// with its list index.
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "common/activation_checks.h"
#include "common/activations.h"
#include "common/checks.h"
#include "common/likelihood.h"

namespace fused_ops {

constexpr int64_t kVaeMlpMaxHidden = 4;
constexpr int64_t kVaeMlpMaxLayers = kVaeMlpMaxHidden + 1;  // the decoder's output layer

using VaeOptTensors = std::vector<std::optional<Tensor>>;

constexpr double kHalfLog2Pi = 0.91893853320467274178;  // 0.5 log(2 pi)

// One element's term with a learned log-variance s: -Normal(a, e^{s/2}).log_prob(x).
template <typename T>
C10_HOST_DEVICE inline T gaussian_nll_term(T a, T x, T s) {
  const T d = a - x;
  return T(0.5) * d * d * std::exp(-s) + T(0.5) * s + T(kHalfLog2Pi);
}

// Its gradients, times the upstream d: at the mean (ga; gx = -ga) and at s (gs).
template <typename T>
C10_HOST_DEVICE inline void gaussian_nll_backward(T a, T x, T s, T d, T& ga, T& gs) {
  const T inv_var = std::exp(-s), diff = a - x;
  ga = d * diff * inv_var;
  gs = d * T(0.5) * (T(1) - diff * diff * inv_var);
}

// The checked sizes and contiguous inputs of a call (forward and backward).
struct VaeMlpInputs {
  int64_t B = 0, I = 0, L = 0, Le = 0, Ld = 0, act = 0, likelihood = 0;
  double act_param = 0;
  std::vector<int64_t> enc_width, dec_width;  // outputs of each layer (dec_width.back() == I)
  Tensor x, eps, w_head, b_head;
  std::optional<Tensor> dec_logvar;
  std::vector<Tensor> enc_w, enc_b, dec_w, dec_b;

  VaeMlpInputs(const Tensor& x_, const Tensor& eps_, const VaeOptTensors& enc_w_,
               const VaeOptTensors& enc_b_, const Tensor& w_head_, const Tensor& b_head_,
               const VaeOptTensors& dec_w_, const VaeOptTensors& dec_b_,
               const std::optional<Tensor>& dec_logvar_, int64_t act_, double act_param_,
               int64_t likelihood_) {
    check_activation_code(act_);
    FUSED_OPS_CHECK(likelihood_ >= 0 && likelihood_ < kNumVaeLikelihoods,
                    "likelihood must be 0 (Bernoulli), 1 (Bernoulli from logits), 2 (Gaussian, mean "
                    "sigmoid(logits)) or 3 (Gaussian, mean = logits), got ", likelihood_);
    check_rank(x_, "x", 2, "[B, I]");
    check_rank(eps_, "eps", 2, "[B, L]");
    B = x_.size(0), I = x_.size(1), L = eps_.size(1);
    FUSED_OPS_CHECK(I >= 1, "x must have at least one feature (I >= 1), got shape ", shape_str(x_));
    check_size(eps_, "eps", 0, B, "B, the batch size of x");
    FUSED_OPS_CHECK(L >= 1, "eps must have at least one latent unit (L >= 1), got shape ",
                    shape_str(eps_));
    Le = int64_t(enc_w_.size()), Ld = int64_t(dec_w_.size());
    FUSED_OPS_CHECK(Le >= 1 && Le <= kVaeMlpMaxHidden,
                    "enc_weights must hold 1 to 4 Linear weights (the encoder's hidden layers), got ", Le);
    FUSED_OPS_CHECK(int64_t(enc_b_.size()) == Le, "enc_biases must hold one bias per encoder layer (",
                    Le, "), got ", enc_b_.size());
    FUSED_OPS_CHECK(Ld >= 2 && Ld <= kVaeMlpMaxLayers,
                    "dec_weights must hold 2 to 5 Linear weights (1 to 4 hidden layers and the output "
                    "layer), got ", Ld);
    FUSED_OPS_CHECK(int64_t(dec_b_.size()) == Ld, "dec_biases must hold one bias per decoder layer (",
                    Ld, "), got ", dec_b_.size());
    enc_w = chain(enc_w_, enc_b_, "enc", I, "I, the features of x", enc_width, enc_b);
    check_rank(w_head_, "w_head", 2, "[2L, H]");
    check_rank(b_head_, "b_head", 1, "[2L]");
    check_size(w_head_, "w_head", 0, 2 * L, "2L: mu and logvar rows, L = eps.shape[1]");
    check_size(w_head_, "w_head", 1, enc_width.back(), "the output width of the last encoder layer");
    check_size(b_head_, "b_head", 0, 2 * L, "2L: mu and logvar, L = eps.shape[1]");
    dec_w = chain(dec_w_, dec_b_, "dec", L, "L, the latent units of eps", dec_width, dec_b);
    check_size(dec_w.back(), ("dec_weights[" + std::to_string(Ld - 1) + "]").c_str(), 0, I,
               "I: the last decoder layer gives the features of x");
    if (dec_logvar_) {
      FUSED_OPS_CHECK(likelihood_ == kGaussian,
                      "dec_logvar (a learned per-feature log-variance) needs likelihood 3 (Gaussian, "
                      "mean = logits), got likelihood ", likelihood_);
      check_rank(*dec_logvar_, "dec_logvar", 1, "[I]");
      check_size(*dec_logvar_, "dec_logvar", 0, I, "I, the features of x");
    }
    check_same_float_dtype_and_device({{x_, "x"}, {eps_, "eps"}});
    check_dtypes(x_, enc_w, enc_b, "enc");
    check_same_float_dtype_and_device({{x_, "x"}, {w_head_, "w_head"}});
    check_same_float_dtype_and_device({{x_, "x"}, {b_head_, "b_head"}});
    check_dtypes(x_, dec_w, dec_b, "dec");
    if (dec_logvar_) check_same_float_dtype_and_device({{x_, "x"}, {*dec_logvar_, "dec_logvar"}});
    act = act_, act_param = act_param_, likelihood = likelihood_;
    x = as_contiguous(x_);
    eps = as_contiguous(eps_);
    w_head = as_contiguous(w_head_);
    b_head = as_contiguous(b_head_);
    if (dec_logvar_) dec_logvar = as_contiguous(*dec_logvar_);
    for (auto* v : {&enc_w, &enc_b, &dec_w, &dec_b}) {
      for (Tensor& t : *v) t = as_contiguous(t);
    }
  }

 private:
  // Checks one network's weights [out, in] and biases [out] (None in a list
  // reads as an undefined tensor, which check_rank names); returns the weights.
  static std::vector<Tensor> chain(const VaeOptTensors& ws, const VaeOptTensors& bs,
                                   const char* net, int64_t in, const char* in_what,
                                   std::vector<int64_t>& widths, std::vector<Tensor>& biases) {
    std::vector<Tensor> out;
    for (size_t l = 0; l < ws.size(); ++l) {
      const std::string wn = std::string(net) + "_weights[" + std::to_string(l) + "]";
      const std::string bn = std::string(net) + "_biases[" + std::to_string(l) + "]";
      const Tensor w = ws[l] ? *ws[l] : Tensor();
      const Tensor b = bs[l] ? *bs[l] : Tensor();
      check_rank(w, wn.c_str(), 2, "[out, in]");
      FUSED_OPS_CHECK(w.size(0) >= 1, wn, " must have at least one output, got shape ", shape_str(w));
      check_size(w, wn.c_str(), 1, in, l == 0 ? in_what : "the output width of the layer before");
      check_rank(b, bn.c_str(), 1, "[out]");
      check_size(b, bn.c_str(), 0, w.size(0), ("the output width of " + wn).c_str());
      in = w.size(0);
      widths.push_back(in);
      out.push_back(w);
      biases.push_back(b);
    }
    return out;
  }
  static void check_dtypes(const Tensor& x, const std::vector<Tensor>& ws,
                           const std::vector<Tensor>& bs, const char* net) {
    for (size_t l = 0; l < ws.size(); ++l) {
      const std::string wn = std::string(net) + "_weights[" + std::to_string(l) + "]";
      const std::string bn = std::string(net) + "_biases[" + std::to_string(l) + "]";
      check_same_float_dtype_and_device({{x, "x"}, {ws[l], wn.c_str()}});
      check_same_float_dtype_and_device({{x, "x"}, {bs[l], bn.c_str()}});
    }
  }
};

// Raw pointers of a call, one element type.  Layer k of the chain runs
// encoder layers k < Le, then the head, then decoder layers.
template <typename T>
struct VaeMlpPtrs {
  const T *x, *eps, *w_head, *b_head, *dec_logvar;  // dec_logvar: nullptr when absent
  const T* ew[kVaeMlpMaxHidden];
  const T* eb[kVaeMlpMaxHidden];
  const T* dw[kVaeMlpMaxLayers];
  const T* db[kVaeMlpMaxLayers];
  int64_t ewidth[kVaeMlpMaxHidden], dwidth[kVaeMlpMaxLayers];
  int64_t B, I, L, Le, Ld, act, likelihood;
  T act_param;

  explicit VaeMlpPtrs(const VaeMlpInputs& c)
      : x(cdata<T>(c.x)), eps(cdata<T>(c.eps)), w_head(cdata<T>(c.w_head)),
        b_head(cdata<T>(c.b_head)), dec_logvar(c.dec_logvar ? cdata<T>(*c.dec_logvar) : nullptr),
        ew{}, eb{}, dw{}, db{}, ewidth{}, dwidth{}, B(c.B), I(c.I), L(c.L), Le(c.Le), Ld(c.Ld),
        act(c.act), likelihood(c.likelihood), act_param(T(c.act_param)) {
    for (int64_t l = 0; l < Le; ++l) {
      ew[l] = cdata<T>(c.enc_w[l]), eb[l] = cdata<T>(c.enc_b[l]), ewidth[l] = c.enc_width[l];
    }
    for (int64_t l = 0; l < Ld; ++l) {
      dw[l] = cdata<T>(c.dec_w[l]), db[l] = cdata<T>(c.dec_b[l]), dwidth[l] = c.dec_width[l];
    }
  }
  int64_t enc_in(int64_t l) const { return l ? ewidth[l - 1] : I; }
  int64_t dec_in(int64_t l) const { return l ? dwidth[l - 1] : L; }
  int64_t H() const { return ewidth[Le - 1]; }  // the head's input width
};

// A forward call: the inputs and the outputs elbo, recon, kl [B].
struct VaeMlpCall : VaeMlpInputs {
  Tensor elbo, recon, kl;

  VaeMlpCall(const Tensor& x_, const Tensor& eps_, const VaeOptTensors& enc_w_,
             const VaeOptTensors& enc_b_, const Tensor& w_head_, const Tensor& b_head_,
             const VaeOptTensors& dec_w_, const VaeOptTensors& dec_b_,
             const std::optional<Tensor>& dec_logvar_, int64_t act_, double act_param_,
             int64_t likelihood_)
      : VaeMlpInputs(x_, eps_, enc_w_, enc_b_, w_head_, b_head_, dec_w_, dec_b_, dec_logvar_, act_,
                     act_param_, likelihood_) {
    elbo = empty_like_device(x_, {B});
    recon = empty_like_device(x_, {B});
    kl = empty_like_device(x_, {B});
  }
};

// A backward call: the upstream gradients (None: zero) and the gradient
// outputs, one list: grad_x, grad_eps, grad_enc_weights[Le], grad_enc_biases[Le],
// grad_w_head, grad_b_head, grad_dec_weights[Ld], grad_dec_biases[Ld], and
// grad_dec_logvar when dec_logvar was given.
struct VaeMlpBackwardCall : VaeMlpInputs {
  std::optional<Tensor> grad_elbo, grad_recon, grad_kl;
  // outputs[0], x's gradient [B, I], is an empty tensor when !grad_x.
  std::vector<Tensor> outputs;

  VaeMlpBackwardCall(const std::optional<Tensor>& ge, const std::optional<Tensor>& gr,
                     const std::optional<Tensor>& gk, const Tensor& x_, const Tensor& eps_,
                     const VaeOptTensors& enc_w_, const VaeOptTensors& enc_b_,
                     const Tensor& w_head_, const Tensor& b_head_, const VaeOptTensors& dec_w_,
                     const VaeOptTensors& dec_b_, const std::optional<Tensor>& dec_logvar_,
                     int64_t act_, double act_param_, int64_t likelihood_, bool grad_x)
      : VaeMlpInputs(x_, eps_, enc_w_, enc_b_, w_head_, b_head_, dec_w_, dec_b_, dec_logvar_, act_,
                     act_param_, likelihood_) {
    for (auto [g, name, dst] : {std::tuple{&ge, "grad_elbo", &grad_elbo},
                                std::tuple{&gr, "grad_recon", &grad_recon},
                                std::tuple{&gk, "grad_kl", &grad_kl}}) {
      if (!*g) continue;
      check_rank(**g, name, 1, "[B]");
      check_size(**g, name, 0, B, "B, the batch size of x");
      check_same_float_dtype_and_device({{x_, "x"}, {**g, name}});
      *dst = as_contiguous(**g);
    }
    auto like = [&](const Tensor& t) {
      return t.dim() == 1 ? empty_like_device(x_, {t.size(0)})
                          : empty_like_device(x_, {t.size(0), t.size(1)});
    };
    outputs.push_back(grad_x ? empty_like_device(x_, {B, I}) : empty_like_device(x_, {0}));
    outputs.push_back(empty_like_device(x_, {B, L}));
    for (const Tensor& t : enc_w) outputs.push_back(like(t));
    for (const Tensor& t : enc_b) outputs.push_back(like(t));
    outputs.push_back(like(w_head));
    outputs.push_back(like(b_head));
    for (const Tensor& t : dec_w) outputs.push_back(like(t));
    for (const Tensor& t : dec_b) outputs.push_back(like(t));
    if (dec_logvar) outputs.push_back(like(*dec_logvar));
  }
};

}  // namespace fused_ops
