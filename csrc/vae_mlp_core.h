// \brief The sequence of fused_ops::vae_mlp_elbo (csrc/vae_mlp.h for the
// math), written once for every device: the forward over a block of rows and
// the backward over the whole batch.  Products go through common/matmul.h on
// the tensors' device (torch's CPU BLAS, or the CUDA matmul table on torch's
// current stream, which also takes a hidden layer's bias_act as its
// epilogue); the elementwise work is the device's `Ops` (cpu/vae_mlp/ops.h,
// cuda/vae_mlp/ops.cuh), each one fused pass:
//
//   bias_act(A, H, b, nullptr, rows, cols, act, p)  A += b; H = act(A) (H == A: in place)
//   head(ML, b_head, eps, Z, kl, rows, L)           ML += b_head; z = mu + exp(lv / 2) eps;
//                                                   kl per row
//   recon(A, b, x, s, kl, recon, elbo, rows, I, lk) A += b; recon per row; elbo = -(recon + kl)
//   recon_backward(GA, A, x, s, ge, gr, gk, GX, GS, rows, I, lk)
//                                                   d = gr - ge per row: GA = d dterm/da,
//                                                   GX = d dterm/dx (GX given), GS = d dterm/ds (s given)
//   head_backward(GML, GZ, ML, eps, ge, gk, GEPS, rows, L)
//                                                   c = gk - ge: gmu = gz + c mu,
//                                                   glv = gz eps std / 2 - c (1 - exp(lv)) / 2,
//                                                   geps = gz std
//   act_grad(G, A, n, act, p), add(dst, src, n), colsum(dst, src, rows, cols, accumulate),
//   zero(dst, n)                                    (the ode_mlp passes, reused)
//
// Memory layout: row-major [rows, width] buffers, one pre-activation buffer
// per layer (the forward applies the activation in place; the backward keeps
// the activations apart, it needs both), ML = [mu | logvar] [rows, 2L] as the
// head's one product writes it.  Backward, with G_l the gradient at layer l's
// pre-activation: G_{l-1} = (G_l W_l) * act'(A_{l-1}), gW_l = G_l^T IN_l,
// gb_l = colsum(G_l); every product over all B rows, every column sum in a
// fixed row order (deterministic).
#pragma once

#include <algorithm>

#include "common/matmul.h"
#include "vae_mlp.h"

namespace fused_ops {

// Activation buffers of `rows` rows.  keep: H apart from A (the backward).
template <typename T>
struct VaeMlpActs {
  T* A_enc[kVaeMlpMaxHidden];
  T* H_enc[kVaeMlpMaxHidden];
  T* A_dec[kVaeMlpMaxLayers];
  T* H_dec[kVaeMlpMaxLayers];
  T* ML;
  T* Z;

  static int64_t size(const VaeMlpPtrs<T>& p, int64_t rows, bool keep) {
    const int64_t k = keep ? 2 : 1;
    int64_t n = 3 * rows * p.L + rows * p.I;  // ML, Z, logits
    for (int64_t l = 0; l < p.Le; ++l) n += k * rows * p.ewidth[l];
    for (int64_t l = 0; l + 1 < p.Ld; ++l) n += k * rows * p.dwidth[l];
    return n;
  }
  VaeMlpActs(const VaeMlpPtrs<T>& p, int64_t rows, bool keep, T* at) : A_enc{}, H_enc{}, A_dec{}, H_dec{} {
    auto take = [&](int64_t n) {
      T* r = at;
      at += n;
      return r;
    };
    for (int64_t l = 0; l < p.Le; ++l) {
      A_enc[l] = take(rows * p.ewidth[l]);
      H_enc[l] = keep ? take(rows * p.ewidth[l]) : A_enc[l];
    }
    ML = take(2 * rows * p.L);
    Z = take(rows * p.L);
    for (int64_t l = 0; l < p.Ld; ++l) {
      const bool last = l + 1 == p.Ld;
      A_dec[l] = take(rows * p.dwidth[l]);
      H_dec[l] = keep && !last ? take(rows * p.dwidth[l]) : A_dec[l];
    }
  }
};

// The forward over rows [r0, r0 + rows); elbo, recon, kl point at row r0.
template <typename T, typename Ops>
void vae_mlp_forward_rows(const VaeMlpPtrs<T>& p, const Ops& ops, int64_t r0, int64_t rows,
                          const VaeMlpActs<T>& a, T* elbo, T* recon, T* kl,
                          const torch::stable::Device& dev) {
  const T* in = p.x + r0 * p.I;
  for (int64_t l = 0; l < p.Le; ++l) {
    const int64_t k = p.enc_in(l), n = p.ewidth[l];
    linear_nt_bias_act(ops, in, k, p.ew[l], k, a.A_enc[l], rows, n, k, p.eb[l], static_cast<const T*>(nullptr),
                       a.H_enc[l], p.act, p.act_param, dev);
    in = a.H_enc[l];
  }
  const int64_t H = p.H(), L = p.L;
  linear_nt(in, H, p.w_head, H, a.ML, 2 * L, rows, 2 * L, H, dev);
  ops.head(a.ML, p.b_head, p.eps + r0 * L, a.Z, kl, rows, L);
  in = a.Z;
  for (int64_t l = 0; l < p.Ld; ++l) {
    const int64_t k = p.dec_in(l), n = p.dwidth[l];
    if (l + 1 < p.Ld) {
      linear_nt_bias_act(ops, in, k, p.dw[l], k, a.A_dec[l], rows, n, k, p.db[l], static_cast<const T*>(nullptr),
                         a.H_dec[l], p.act, p.act_param, dev);
      in = a.H_dec[l];
    } else {
      linear_nt(in, k, p.dw[l], k, a.A_dec[l], n, rows, n, k, dev);
      ops.recon(a.A_dec[l], p.db[l], p.x + r0 * p.I, p.dec_logvar, kl, recon, elbo, rows, p.I,
                p.likelihood);
    }
  }
}

// The gradient outputs (csrc/vae_mlp.h's VaeMlpBackwardCall order), as raw
// pointers; x is nullptr when its gradient is not asked for.
template <typename T>
struct VaeMlpGrads {
  T *x, *eps, *w_head, *b_head, *dec_logvar;
  T* ew[kVaeMlpMaxHidden];
  T* eb[kVaeMlpMaxHidden];
  T* dw[kVaeMlpMaxLayers];
  T* db[kVaeMlpMaxLayers];

  VaeMlpGrads(const std::vector<Tensor>& out, int64_t Le, int64_t Ld, bool has_logvar)
      : ew{}, eb{}, dw{}, db{} {
    size_t i = 0;
    x = out[i].numel() ? mdata<T>(out[i]) : nullptr;  // not asked for (grad_x false), or B = 0
    ++i;
    eps = mdata<T>(out[i++]);
    for (int64_t l = 0; l < Le; ++l) ew[l] = mdata<T>(out[i++]);
    for (int64_t l = 0; l < Le; ++l) eb[l] = mdata<T>(out[i++]);
    w_head = mdata<T>(out[i++]);
    b_head = mdata<T>(out[i++]);
    for (int64_t l = 0; l < Ld; ++l) dw[l] = mdata<T>(out[i++]);
    for (int64_t l = 0; l < Ld; ++l) db[l] = mdata<T>(out[i++]);
    dec_logvar = has_logvar ? mdata<T>(out[i++]) : nullptr;
  }
};

// The backward over the whole batch: the forward recomputed with its
// activations kept, then the chain rule back to x (to the first layer's
// weights only when g.x is nullptr: its input-gradient product, the largest
// of the backward at image-sized inputs, is skipped).  ge, gr, gk: upstream
// gradients [B] or nullptr (zero).
template <typename T, typename Ops>
void vae_mlp_backward_run(const VaeMlpPtrs<T>& p, const Ops& ops, const T* ge, const T* gr,
                          const T* gk, const VaeMlpGrads<T>& g, const Tensor& like,
                          const torch::stable::Device& dev) {
  const int64_t B = p.B, I = p.I, L = p.L, H = p.H();
  if (B == 0) {  // the parameter gradients are sums over no rows
    for (int64_t l = 0; l < p.Le; ++l) {
      ops.zero(g.ew[l], p.ewidth[l] * p.enc_in(l));
      ops.zero(g.eb[l], p.ewidth[l]);
    }
    ops.zero(g.w_head, 2 * L * H);
    ops.zero(g.b_head, 2 * L);
    for (int64_t l = 0; l < p.Ld; ++l) {
      ops.zero(g.dw[l], p.dwidth[l] * p.dec_in(l));
      ops.zero(g.db[l], p.dwidth[l]);
    }
    if (g.dec_logvar) ops.zero(g.dec_logvar, I);
    return;
  }
  const int64_t acts_size = VaeMlpActs<T>::size(p, B, true);
  int64_t gsize = 3 * B * L + (g.x ? B * I : 0);  // GML, GZ, the target gradient (x's)
  for (int64_t l = 0; l < p.Le; ++l) gsize += B * p.ewidth[l];
  for (int64_t l = 0; l < p.Ld; ++l) gsize += B * p.dwidth[l];
  if (g.dec_logvar) gsize += B * I;
  const Tensor work = empty_like_device(like, {acts_size + gsize + 3 * B});
  T* at = mdata<T>(work);
  const VaeMlpActs<T> a(p, B, true, at);
  at += acts_size;
  auto take = [&](int64_t n) {
    T* r = at;
    at += n;
    return r;
  };
  T* G_enc[kVaeMlpMaxHidden];
  T* G_dec[kVaeMlpMaxLayers];
  for (int64_t l = 0; l < p.Le; ++l) G_enc[l] = take(B * p.ewidth[l]);
  for (int64_t l = 0; l < p.Ld; ++l) G_dec[l] = take(B * p.dwidth[l]);
  T* GML = take(2 * B * L);
  T* GZ = take(B * L);
  T* GXt = g.x ? take(B * I) : nullptr;  // the likelihood's gradient at x, when x's is asked for
  T* GS = g.dec_logvar ? take(B * I) : nullptr;
  T* losses = take(3 * B);
  vae_mlp_forward_rows(p, ops, 0, B, a, losses, losses + B, losses + 2 * B, dev);

  const int64_t Ld = p.Ld;
  ops.recon_backward(G_dec[Ld - 1], a.A_dec[Ld - 1], p.x, p.dec_logvar, ge, gr, gk, GXt, GS, B, I,
                     p.likelihood);
  if (GS) ops.colsum(g.dec_logvar, GS, B, I, false);
  for (int64_t l = Ld - 1; l >= 0; --l) {
    const int64_t k = p.dec_in(l), n = p.dwidth[l];
    const T* IN = l ? a.H_dec[l - 1] : a.Z;
    matmul(G_dec[l], 1, n, IN, k, 1, g.dw[l], k, n, k, B, dev);  // G^T [n, B] @ IN [B, k]
    ops.colsum(g.db[l], G_dec[l], B, n, false);
    T* gin = l ? G_dec[l - 1] : GZ;
    matmul(G_dec[l], n, 1, p.dw[l], k, 1, gin, k, B, k, n, dev);  // G [B, n] @ W [n, k]
    if (l) ops.act_grad(gin, a.A_dec[l - 1], B * k, p.act, p.act_param);
  }
  ops.head_backward(GML, GZ, a.ML, p.eps, ge, gk, g.eps, B, L);
  matmul(GML, 1, 2 * L, a.H_enc[p.Le - 1], H, 1, g.w_head, H, 2 * L, H, B, dev);
  ops.colsum(g.b_head, GML, B, 2 * L, false);
  matmul(GML, 2 * L, 1, p.w_head, H, 1, G_enc[p.Le - 1], H, B, H, 2 * L, dev);
  ops.act_grad(G_enc[p.Le - 1], a.A_enc[p.Le - 1], B * H, p.act, p.act_param);
  for (int64_t l = p.Le - 1; l >= 0; --l) {
    const int64_t k = p.enc_in(l), n = p.ewidth[l];
    const T* IN = l ? a.H_enc[l - 1] : p.x;
    matmul(G_enc[l], 1, n, IN, k, 1, g.ew[l], k, n, k, B, dev);
    ops.colsum(g.eb[l], G_enc[l], B, n, false);
    T* gin = l ? G_enc[l - 1] : g.x;
    if (!gin) break;  // l = 0 and x's gradient not asked for
    matmul(G_enc[l], n, 1, p.ew[l], k, 1, gin, k, B, k, n, dev);
    if (l) ops.act_grad(gin, a.A_enc[l - 1], B * k, p.act, p.act_param);
  }
  if (g.x) ops.add(g.x, GXt, B * I);
}

}  // namespace fused_ops
