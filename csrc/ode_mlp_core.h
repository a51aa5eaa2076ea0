// \brief The step sequence of fused_ops::ode_mlp, written once for every
// device: the MLP evaluation, one Runge-Kutta step, and the backward (the
// discrete adjoint of all steps and stages).  Products go through
// common/matmul.h on the tensors' device (torch's CPU BLAS, or the CUDA
// matmul table on torch's current stream, which also takes a hidden
// layer's bias_act as its epilogue); the elementwise work is the device's `Ops`
// (cpu/ode_mlp/ops.h, cuda/ode_mlp/ops.cuh), each a fused pass:
//
//   stage_input(Y, y, K, n, t, k, method, i)   Y = y + dt_k sum_{j<i} a_ij K_j
//   step_update(y1, y, K, n, t, k, method)     y1 = y + dt_k sum_i b_i K_i
//   bias_act(A, H, cb, rb, rows, cols, act, p) A += cb (+ rb per row); H = act(A) (H null: none)
//   kbar(G, g, Ybar, n, t, k, method, m)       G = dt_k (b_m g + sum_{i>m} a_im Ybar_i)
//   act_grad(G, A, n, act, p)                  G *= act'(A)
//   add(dst, src, n)                           dst += src
//   colsum(dst, src, rows, cols, accumulate)   dst (+)= column sums, rows in order
//   combine(g, Ybar, stages, up, n)            g += sum_m Ybar_m + up
//   stage_sum_add(dst, G, stages, n)           dst += sum_m G_m
//   copy(dst, src, n), zero(dst, n)
// where dt_k = t[k+1] - t[k] is read by the pass itself (on CUDA from device
// memory: no host synchronisation), and stacked buffers (K, Y, Ybar, G) hold
// the stages one after the other, n elements apart.
//
// Backward, per step k = S-1 .. 0, with g = dL/dy_{k+1} (grad_states[S] at
// the start): the step is recomputed from the saved state y_k, keeping every
// stage's input Y_i, pre-activations A_l and activations H_l (memory
// O(stages * B * sum H_l), reused by every step); then, stages m = s-1 .. 0:
//   Kbar_m = dt (b_m g + sum_{i>m} a_im Ybar_i)
//   G_{L-1} = Kbar_m;  G_{l-1} = (G_l W_l) * act'(A_{l-1});  Ybar_m = G_0 W_0
// then, over the stages of the step stacked as rows (one product per layer):
//   gW_l += G_l^T IN_l (IN_0 = Y, IN_l = H_{l-1}),  gb_l += colsum(G_l)
//   grad_time_bias[k s + m] = colsum(G_0 of stage m),  grad_sample_bias += sum_m G_0
//   g = g + sum_m Ybar_m + grad_states[k]
// and grad_x0 = g after step 0.  Deterministic: fixed product shapes, column
// sums in row order, steps in a fixed order.
#pragma once

#include <algorithm>
#include <vector>

#include "common/matmul.h"
#include "ode_mlp.h"

namespace fused_ops {

// Activation buffers of one evaluation: A[l], H[l] (H[l] == A[l]: in place).
template <typename T>
struct OdeMlpActs {
  T* A[kOdeMaxLayers];
  T* H[kOdeMaxLayers];
};

// out [rows, D] = v_e(Y) for the rows [r0, r0 + rows) (sample_bias rows offset by r0).
template <typename T, typename Ops>
void ode_mlp_eval(const OdeMlpPtrs<T>& p, const Ops& ops, const T* Y, int64_t r0, int64_t rows,
                  int64_t e, const OdeMlpActs<T>& acts, T* out, const torch::stable::Device& dev) {
  for (int64_t l = 0; l < p.L; ++l) {
    const int64_t in = p.in_width(l), n = p.width[l];
    const T* src = l ? acts.H[l - 1] : Y;
    const bool last = l == p.L - 1;
    T* dst = last ? out : acts.A[l];
    const T* cb = l ? p.b[l] : p.time_bias + e * n;
    const T* rb = (l == 0 && p.sample_bias) ? p.sample_bias + r0 * n : nullptr;
    linear_nt_bias_act(ops, src, in, p.w[l], in, dst, rows, n, in, cb, rb, last ? nullptr : acts.H[l], p.act,
                       p.act_param, dev);
  }
}

// Buffers of one step over `rows` rows.  Y and K: [stages][rows][D]; per
// layer A and H: [stages][rows][H_l] when every stage is kept (backward), else
// one stage's worth reused (forward; H aliases A).
template <typename T>
struct OdeStepBuffers {
  T* Y;
  T* K;
  T* A[kOdeMaxLayers];
  T* H[kOdeMaxLayers];
  bool keep_stages;

  // Elements needed.
  static int64_t size(const OdeMlpPtrs<T>& p, int stages, int64_t rows, bool keep) {
    int64_t n = 2 * stages * rows * p.D;
    for (int64_t l = 0; l + 1 < p.L; ++l) n += (keep ? 2 * stages : 1) * rows * p.width[l];
    return n;
  }
  OdeStepBuffers(const OdeMlpPtrs<T>& p, int stages, int64_t rows, bool keep, T* base)
      : A{}, H{}, keep_stages(keep) {
    Y = base;
    K = Y + stages * rows * p.D;
    T* at = K + stages * rows * p.D;
    for (int64_t l = 0; l + 1 < p.L; ++l) {
      A[l] = at;
      at += (keep ? stages : 1) * rows * p.width[l];
      if (keep) {
        H[l] = at;
        at += stages * rows * p.width[l];
      } else {
        H[l] = A[l];
      }
    }
  }
  OdeMlpActs<T> stage(const OdeMlpPtrs<T>& p, int i, int64_t rows) const {
    OdeMlpActs<T> a{};
    for (int64_t l = 0; l + 1 < p.L; ++l) {
      const int64_t off = keep_stages ? i * rows * p.width[l] : 0;
      a.A[l] = A[l] + off;
      a.H[l] = H[l] + off;
    }
    return a;
  }
};

// One step k over rows [r0, r0 + rows): y1 = step(y).  Y[0] holds a copy of y
// when the stages are kept (the stacked weight-gradient products read it).
template <typename T, typename Ops>
void ode_mlp_step(const OdeMlpPtrs<T>& p, const Ops& ops, const T* y, T* y1, int64_t r0,
                  int64_t rows, int64_t k, const OdeStepBuffers<T>& buf,
                  const torch::stable::Device& dev) {
  const OdeTableau tab = ode_tableau(p.method);
  const int64_t n = rows * p.D;
  for (int i = 0; i < tab.stages; ++i) {
    const T* Yi = y;
    if (i > 0) {
      ops.stage_input(buf.Y + i * n, y, buf.K, n, p.t, k, p.method, i);
      Yi = buf.Y + i * n;
    } else if (buf.keep_stages) {
      ops.copy(buf.Y, y, n);
    }
    ode_mlp_eval(p, ops, Yi, r0, rows, k * tab.stages + i, buf.stage(p, i, rows), buf.K + i * n, dev);
  }
  ops.step_update(y1, y, buf.K, n, p.t, k, p.method);
}

// Elements of the workspace ode_mlp_forward_rows needs for `rows` rows.
template <typename T>
int64_t ode_mlp_forward_work(const OdeMlpPtrs<T>& p, int64_t rows) {
  return OdeStepBuffers<T>::size(p, ode_tableau(p.method).stages, rows, false) + 2 * rows * p.D;
}

// The forward over rows [r0, r0 + rows): all S steps, one stage's
// activations reused.  With all_states, states [S+1, B, D] is stepped
// through in place; otherwise the state ping-pongs between two buffers of
// `work` and the last step writes states [1, B, D].
template <typename T, typename Ops>
void ode_mlp_forward_rows(const OdeMlpPtrs<T>& p, const Ops& ops, T* states, bool all_states,
                          int64_t r0, int64_t rows, T* work, const torch::stable::Device& dev) {
  const int s = ode_tableau(p.method).stages;
  const int64_t bsize = OdeStepBuffers<T>::size(p, s, rows, false);
  const OdeStepBuffers<T> buf(p, s, rows, false, work);
  T* ping[2] = {work + bsize, work + bsize + rows * p.D};
  const int64_t n = rows * p.D;
  auto at = [&](int64_t k) { return states + k * p.B * p.D + r0 * p.D; };
  if (all_states) {
    ops.copy(at(0), p.x0 + r0 * p.D, n);
    for (int64_t k = 0; k < p.S; ++k) ode_mlp_step(p, ops, at(k), at(k + 1), r0, rows, k, buf, dev);
    return;
  }
  const T* y = p.x0 + r0 * p.D;
  for (int64_t k = 0; k < p.S; ++k) {
    T* y1 = k + 1 == p.S ? at(0) : ping[k % 2];
    ode_mlp_step(p, ops, y, y1, r0, rows, k, buf, dev);
    y = y1;
  }
  if (p.S == 0) ops.copy(at(0), y, n);
}

// The gradient outputs of the backward, as raw pointers.
template <typename T>
struct OdeMlpGrads {
  T* x0;
  T* w[kOdeMaxLayers];
  T* b[kOdeMaxLayers];  // b[l] for l >= 1
  T* time_bias;
  T* sample_bias;  // nullptr: no sample_bias input
};

// The backward sequence over the whole batch.  `states` [S+1, B, D] and
// `grad_states` [S+1, B, D] are the forward's output and its gradient.
template <typename T, typename Ops>
void ode_mlp_backward_run(const OdeMlpPtrs<T>& p, const Ops& ops, const T* states,
                          const T* grad_states, const OdeMlpGrads<T>& gr, const Tensor& like,
                          const torch::stable::Device& dev) {
  const int s = ode_tableau(p.method).stages;
  const int64_t B = p.B, D = p.D, L = p.L, S = p.S, n = B * D;
  // Gradients start at zero (the time_bias rows are assigned, but not when B = 0).
  for (int64_t l = 0; l < L; ++l) {
    ops.zero(gr.w[l], p.width[l] * p.in_width(l));
    if (l) ops.zero(gr.b[l], p.width[l]);
  }
  ops.zero(gr.time_bias, S * s * p.width[0]);
  if (gr.sample_bias) ops.zero(gr.sample_bias, B * p.width[0]);
  if (B == 0) return;
  int64_t wmax = 0, gsize = 0;
  for (int64_t l = 0; l < L; ++l) {
    wmax = std::max(wmax, p.width[l] * p.in_width(l));
    gsize += s * B * p.width[l];
  }
  const int64_t step_size = OdeStepBuffers<T>::size(p, s, B, true);
  const Tensor work = empty_like_device(like, {step_size + gsize + s * n + n + n + wmax});
  T* base = mdata<T>(work);
  const OdeStepBuffers<T> buf(p, s, B, true, base);
  T* G[kOdeMaxLayers];
  T* at = base + step_size;
  for (int64_t l = 0; l < L; ++l) {
    G[l] = at;
    at += s * B * p.width[l];
  }
  T* Ybar = at;
  T* g = Ybar + s * n;
  T* y1 = g + n;  // the recomputed next state (unused: the saved one is exact)
  T* scratch = y1 + n;
  ops.copy(g, grad_states + S * n, n);
  for (int64_t k = S - 1; k >= 0; --k) {
    ode_mlp_step(p, ops, states + k * n, y1, 0, B, k, buf, dev);
    for (int m = s - 1; m >= 0; --m) {
      ops.kbar(G[L - 1] + m * n, g, Ybar, n, p.t, k, p.method, m);
      const OdeMlpActs<T> a = buf.stage(p, m, B);
      for (int64_t l = L - 1; l >= 1; --l) {
        const int64_t in = p.in_width(l), w = p.width[l];
        T* gin = G[l - 1] + m * B * in;
        matmul(G[l] + m * B * w, w, 1, p.w[l], in, 1, gin, in, B, in, w, dev);
        ops.act_grad(gin, a.A[l - 1], B * in, p.act, p.act_param);
      }
      matmul(G[0] + m * B * p.width[0], p.width[0], 1, p.w[0], D, 1, Ybar + m * n, D, B, D,
             p.width[0], dev);
    }
    for (int64_t l = 0; l < L; ++l) {
      const int64_t in = p.in_width(l), w = p.width[l];
      const T* IN = l ? buf.H[l - 1] : buf.Y;
      // G_l^T [w, s B] @ IN [s B, in]
      matmul(G[l], 1, w, IN, in, 1, scratch, in, w, in, s * B, dev);
      ops.add(gr.w[l], scratch, w * in);
      if (l) ops.colsum(gr.b[l], G[l], s * B, w, true);
    }
    for (int m = 0; m < s; ++m) {
      ops.colsum(gr.time_bias + (k * s + m) * p.width[0], G[0] + m * B * p.width[0], B, p.width[0],
                 false);
    }
    if (gr.sample_bias) ops.stage_sum_add(gr.sample_bias, G[0], s, B * p.width[0]);
    ops.combine(g, Ybar, s, grad_states + k * n, n);
  }
  ops.copy(gr.x0, g, n);
}

}  // namespace fused_ops
