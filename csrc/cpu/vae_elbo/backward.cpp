// \brief CPU kernels of fused_ops::vae_elbo_backward (the backward of vae_elbo) and
// fused_ops::vae_elbo_train_backward (the backward of vae_elbo_train).  They
// share everything but stage 1's first step: vae_elbo_backward recomputes
// the forward's activations, vae_elbo_train_backward reads them from the
// buffer vae_elbo_train saved (VaeSavedLayout) and may skip grad_x (and its
// product with w_enc) when x needs no gradient -- on the CPU the recomputed
// products cost as much as the forward itself.
//
// Stage 1, in parallel over blocks of kRows samples (fixed, never derived
// from the thread count): each block recomputes its forward activations
// (h, mu/logvar, z, the decoder hidden layer g and the logits) with BLAS
// products on the block, then runs the chain rule back to x with fused
// elementwise epilogues:
//   ga3  = d_recon * (p - x) / max((1 - p) p, 1e-12) * (1 - p) * p   (BCE, then sigmoid backward)
//   gx   = d_recon * -logit(p)                                       (BCE's target gradient)
//   ga2  = (ga3 @ w_dec2) * (g > 0);   gz = ga2 @ w_dec1
//   gmu  = gz + d_kl * mu;   glv = 0.5 * (gz * eps * std) + (-0.5 d_kl) * (1 - exp(logvar))
//   geps = gz * std;   ga1 = ([gmu, glv] @ [w_mu; w_logvar]) * (h > 0);   gx += ga1 @ w_enc
// (for a likelihood other than the Bernoulli default, ga3 and gx are
// common/likelihood.h's recon_backward instead of the first two lines).
// The per-sample tensors the weight gradients need (ga3, g, ga2, z, [gmu,
// glv], h, ga1) go to batch-sized buffers.
// Stage 2: every weight gradient is ONE product over all rows (a^T @ b read
// through strided views, no transposes copied) and every bias gradient a
// column sum in row order, so results do not depend on the thread count.
//
// Scratch: B * (I + 4H + 3L) elements (plus per-block buffers).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/likelihood.h"
#include "common/matmul.h"
#include "vae_elbo_backward.h"

namespace fused_ops {
namespace {

constexpr int64_t kRows = 64;  // samples per block

template <typename T>
struct BwdArgs {
  const T *g_elbo, *g_recon, *g_kl;  // nullptr: None
  const T *x, *eps, *w_enc, *b_enc, *w_mulv, *b_mulv, *w_dec1, *b_dec1, *w_dec2, *b_dec2;
  int64_t B, I, H, L;
  // batch-sized scratch
  T *ga3, *g, *ga2, *z, *gml, *h, *ga1;
  // outputs written in stage 1 (gx: nullptr when grad_x is not wanted)
  T *gx, *geps;
  // vae_elbo_train_backward: the forward's activations (VaeSavedLayout), read
  // instead of recomputed; nullptr for vae_elbo_backward.  h, g and z above
  // then point into it (read only).
  const T* saved;
  int64_t likelihood;  // common/likelihood.h
};

template <typename T>
void block(const BwdArgs<T>& a, int64_t c) {
  const int64_t I = a.I, H = a.H, L = a.L;
  const int64_t r0 = c * kRows, rows = std::min(a.B, r0 + kRows) - r0;
  const T* x = a.x + r0 * I;
  T* h = a.h + r0 * H;
  T* g = a.g + r0 * H;
  T* z = a.z + r0 * L;
  T* ga3 = a.ga3 + r0 * I;
  T* ga2 = a.ga2 + r0 * H;
  T* gml = a.gml + r0 * 2 * L;
  T* ga1 = a.ga1 + r0 * H;
  T* gx = a.gx ? a.gx + r0 * I : nullptr;
  const bool recompute = a.saved == nullptr;
  const VaeSavedLayout lay(a.B, I, H, L);
  std::vector<T> ml_local(recompute ? rows * 2 * L : 0), sd(rows * L), gz(rows * L),
      t(a.gx ? rows * I : 0);
  const T* ml = recompute ? ml_local.data() : a.saved + lay.ml + r0 * 2 * L;
  const T* logits = recompute ? ga3 : a.saved + lay.logits + r0 * I;
  auto bias_relu = [](T* v, const T* b, int64_t rows_, int64_t n) {
    for (int64_t r = 0; r < rows_; ++r) {
      T* row = v + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const T u = row[j] + b[j];
        row[j] = u < T(0) ? T(0) : u;
      }
    }
  };
  if (recompute) {
    // ---- forward recompute (h, g, z land in the batch-sized buffers, the
    // logits without bias in ga3)
    linear_nt(x, I, a.w_enc, I, h, H, rows, H, I);
    bias_relu(h, a.b_enc, rows, H);
    linear_nt(h, H, a.w_mulv, H, ml_local.data(), 2 * L, rows, 2 * L, H);
    for (int64_t r = 0; r < rows; ++r) {
      T* m = ml_local.data() + r * 2 * L;
      const T* e = a.eps + (r0 + r) * L;
      for (int64_t l = 0; l < L; ++l) {
        m[l] += a.b_mulv[l];
        m[L + l] += a.b_mulv[L + l];
        const T s = std::exp(T(0.5) * m[L + l]);
        sd[r * L + l] = s;
        z[r * L + l] = m[l] + s * e[l];
      }
    }
    linear_nt(z, L, a.w_dec1, L, g, H, rows, H, L);
    bias_relu(g, a.b_dec1, rows, H);
    linear_nt(g, H, a.w_dec2, H, ga3, I, rows, I, H);
  } else {
    for (int64_t k = 0; k < rows * L; ++k) {
      sd[k] = std::exp(T(0.5) * ml[(k / L) * 2 * L + L + k % L]);
    }
  }
  // ---- BCE + sigmoid backward (PyTorch's formulas and clamp)
  const T kEps = T(1e-12);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r0 + r;
    const bool has_recon = a.g_elbo || a.g_recon;
    T dr = T(0);
    if (a.g_elbo) dr = -a.g_elbo[b];
    if (a.g_recon) dr = a.g_elbo ? dr + a.g_recon[b] : a.g_recon[b];
    T* gar = ga3 + r * I;
    const T* lr = logits + r * I;  // == gar when recomputed (then still without bias)
    T* gxr = a.gx ? gx + r * I : nullptr;
    const T* xr = x + r * I;
    if (a.likelihood != kBernoulli) {  // common/likelihood.h's gradients, scalar
      for (int64_t i = 0; i < I; ++i) {
        const T av = recompute ? lr[i] + a.b_dec2[i] : lr[i];
        T gxv;
        recon_backward(a.likelihood, av, xr[i], dr, gar[i], gxv);
        if (gxr) gxr[i] = dr != T(0) ? gxv : T(0);
      }
      continue;
    }
    for (int64_t i = 0; i < I; ++i) {
      const T av = recompute ? lr[i] + a.b_dec2[i] : lr[i];
      const T p = T(1) / (T(1) + std::exp(-av));
      const T q = T(1) - p;
      const T den = std::max(q * p, kEps);
      const T gp = dr * (p - xr[i]) / den;
      gar[i] = gp * q * p;
      // BCE's target gradient -logit(p) * d_recon; a zero upstream adds
      // exactly zero (no 0 * inf at saturated p).
      if (gxr) gxr[i] = (has_recon && dr != T(0)) ? -std::log(p / q) * dr : T(0);
    }
  }
  // ---- decoder backward (the ReLU masks zero the gradient where the
  // activation is <= 0 and pass it at NaN, as PyTorch's threshold_backward)
  matmul(ga3, I, 1, a.w_dec2, H, 1, ga2, H, rows, H, I);
  for (int64_t k = 0; k < rows * H; ++k)
    if (g[k] <= T(0)) ga2[k] = T(0);
  matmul(ga2, H, 1, a.w_dec1, L, 1, gz.data(), L, rows, L, H);
  // ---- reparameterisation + KL backward
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r0 + r;
    T dk = T(0);
    if (a.g_elbo) dk = -a.g_elbo[b];
    if (a.g_kl) dk = a.g_elbo ? dk + a.g_kl[b] : a.g_kl[b];
    const T* m = ml + r * 2 * L;
    const T* e = a.eps + b * L;
    T* gm = gml + r * 2 * L;
    T* ge = a.geps + b * L;
    for (int64_t l = 0; l < L; ++l) {
      const T mu = m[l], lv = m[L + l], s = sd[r * L + l], gzl = gz[r * L + l];
      gm[l] = gzl + dk * mu;
      gm[L + l] = T(0.5) * (gzl * e[l] * s) + (T(-0.5) * dk) * (T(1) - std::exp(lv));
      ge[l] = gzl * s;
    }
  }
  // ---- encoder backward
  matmul(gml, 2 * L, 1, a.w_mulv, H, 1, ga1, H, rows, H, 2 * L);
  for (int64_t k = 0; k < rows * H; ++k)
    if (h[k] <= T(0)) ga1[k] = T(0);
  if (a.gx) {
    matmul(ga1, H, 1, a.w_enc, I, 1, t.data(), I, rows, I, H);
    for (int64_t k = 0; k < rows * I; ++k) gx[k] += t[k];
  }
}

// out[j] = sum_r in[r * ld + j] for j < n, rows in order (double accumulation),
// in parallel over column chunks.
template <typename T>
void column_sums(const T* in, int64_t ld, int64_t rows, int64_t n, T* out) {
  torch::stable::parallel_for(0, n, 64, [&](int64_t j0, int64_t j1) {
    std::vector<double> acc(j1 - j0, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = in + r * ld;
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += double(row[j]);
    }
    for (int64_t j = j0; j < j1; ++j) out[j] = T(acc[j - j0]);
  });
}

template <typename T>
void vae_elbo_backward_kernel(const VaeElboBackwardCall& c, const T* saved = nullptr) {
  const int64_t B = c.B, I = c.I, H = c.H, L = c.L;
  if (B == 0) {
    for (const Tensor* t : {&c.gw_enc, &c.gb_enc, &c.gw_mu, &c.gb_mu, &c.gw_logvar, &c.gb_logvar,
                            &c.gw_dec1, &c.gb_dec1, &c.gw_dec2, &c.gb_dec2})
      std::fill_n(mdata<T>(*t), t->numel(), T(0));
    return;
  }
  std::vector<T> w_mulv(2 * L * H), b_mulv(2 * L);
  std::copy_n(cdata<T>(c.w_mu), L * H, w_mulv.begin());
  std::copy_n(cdata<T>(c.w_logvar), L * H, w_mulv.begin() + L * H);
  std::copy_n(cdata<T>(c.b_mu), L, b_mulv.begin());
  std::copy_n(cdata<T>(c.b_logvar), L, b_mulv.begin() + L);
  // h, g, z: recomputed into scratch, or read from the forward's saved activations.
  const int64_t recomputed = saved ? 0 : B;
  std::vector<T> ga3(B * I), g(recomputed * H), ga2(B * H), z(recomputed * L), gml(B * 2 * L),
      h(recomputed * H), ga1(B * H);
  const VaeSavedLayout lay(B, I, H, L);
  T* h_ptr = saved ? const_cast<T*>(saved + lay.h) : h.data();
  T* g_ptr = saved ? const_cast<T*>(saved + lay.g) : g.data();
  T* z_ptr = saved ? const_cast<T*>(saved + lay.z) : z.data();
  BwdArgs<T> a{cdata_or_null<T>(c.g_elbo),
               cdata_or_null<T>(c.g_recon),
               cdata_or_null<T>(c.g_kl),
               cdata<T>(c.x),
               cdata<T>(c.eps),
               cdata<T>(c.w_enc),
               cdata<T>(c.b_enc),
               w_mulv.data(),
               b_mulv.data(),
               cdata<T>(c.w_dec1),
               cdata<T>(c.b_dec1),
               cdata<T>(c.w_dec2),
               cdata<T>(c.b_dec2),
               B, I, H, L,
               ga3.data(), g_ptr, ga2.data(), z_ptr, gml.data(), h_ptr, ga1.data(),
               c.gx.numel() ? mdata<T>(c.gx) : nullptr, mdata<T>(c.geps),
               saved,
               c.likelihood};
  const int64_t blocks = (B + kRows - 1) / kRows;
  torch::stable::parallel_for(0, blocks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t k = c0; k < c1; ++k) block(a, k);
  });
  // Weight gradients: one product over all rows each (multithreaded BLAS).
  matmul(a.ga3, 1, I, a.g, H, 1, mdata<T>(c.gw_dec2), H, I, H, B);
  matmul(a.ga2, 1, H, a.z, L, 1, mdata<T>(c.gw_dec1), L, H, L, B);
  matmul(a.gml, 1, 2 * L, a.h, H, 1, mdata<T>(c.gw_mu), H, L, H, B);
  matmul(a.gml + L, 1, 2 * L, a.h, H, 1, mdata<T>(c.gw_logvar), H, L, H, B);
  matmul(a.ga1, 1, H, a.x, I, 1, mdata<T>(c.gw_enc), I, H, I, B);
  column_sums(a.ga3, I, B, I, mdata<T>(c.gb_dec2));
  column_sums(a.ga2, H, B, H, mdata<T>(c.gb_dec1));
  column_sums(a.gml, 2 * L, B, L, mdata<T>(c.gb_mu));
  column_sums(a.gml + L, 2 * L, B, L, mdata<T>(c.gb_logvar));
  column_sums(a.ga1, H, B, H, mdata<T>(c.gb_enc));
}

VaeElboBackwardResult vae_elbo_backward_cpu(
    const std::optional<Tensor>& grad_elbo, const std::optional<Tensor>& grad_recon,
    const std::optional<Tensor>& grad_kl, const Tensor& x, const Tensor& eps, const Tensor& w_enc,
    const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu, const Tensor& w_logvar,
    const Tensor& b_logvar, const Tensor& w_dec1, const Tensor& b_dec1, const Tensor& w_dec2,
    const Tensor& b_dec2, int64_t likelihood) {
  if (is_bfloat16(x)) {  // checked, then the float32 backward on float32 copies
    return vae_elbo_backward_bfloat16(vae_elbo_backward_cpu, grad_elbo, grad_recon, grad_kl, x, eps, w_enc,
                                      b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1,
                                      w_dec2, b_dec2, likelihood);
  }
  VaeElboBackwardCall c(grad_elbo, grad_recon, grad_kl, x, eps, w_enc, b_enc, w_mu, b_mu,
                        w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2, /*with_grad_x=*/true,
                        /*allow_bfloat16=*/true);  // the messages of the bfloat16-taking op
  c.likelihood = check_vae_likelihood(likelihood);
  dispatch_float(x.scalar_type(), [&](auto zero) { vae_elbo_backward_kernel<decltype(zero)>(c); });
  return c.result();
}

VaeElboBackwardResult vae_elbo_train_backward_cpu(
    const std::optional<Tensor>& grad_elbo, const std::optional<Tensor>& grad_recon,
    const std::optional<Tensor>& grad_kl, const Tensor& x, const Tensor& eps, const Tensor& w_enc,
    const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu, const Tensor& w_logvar,
    const Tensor& b_logvar, const Tensor& w_dec1, const Tensor& b_dec1, const Tensor& w_dec2,
    const Tensor& b_dec2, const Tensor& saved, bool compute_grad_x, int64_t likelihood) {
  VaeElboBackwardCall c(grad_elbo, grad_recon, grad_kl, x, eps, w_enc, b_enc, w_mu, b_mu,
                        w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2, compute_grad_x);
  c.likelihood = check_vae_likelihood(likelihood);
  check_vae_saved(saved, c);
  const Tensor saved_c = as_contiguous(saved);
  dispatch_float(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    vae_elbo_backward_kernel<T>(c, cdata<T>(saved_c));
  });
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("vae_elbo_backward", TORCH_BOX(&vae_elbo_backward_cpu));
  m.impl("vae_elbo_train_backward", TORCH_BOX(&vae_elbo_train_backward_cpu));
}

}  // namespace fused_ops
