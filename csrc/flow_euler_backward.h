// fused_ops::flow_euler_backward: the discrete adjoint of flow_euler through
// all Euler steps.  Argument checks, the output allocation and the step
// sequence are shared by the CPU and CUDA implementations; each device
// supplies only its elementwise epilogues (an `Ops` struct, see
// run_flow_euler_backward below).  The matrix products go through
// common/matmul.h on the tensors' device (torch's CPU BLAS, or cuBLAS on
// torch's current CUDA stream).
//
// Math, per step k = num_steps-1 .. 0, with g = dL/dx_{k+1} (grad_x at the
// start), t_k = (k + 0.5) / num_steps, dt = 1 / num_steps and x_k the state
// before step k (recomputed from x0 first):
//
//   a1 = x_k w1[:, :D]^T + t_k w1[:, D] + b1     h1 = silu(a1)   s1 = silu'(a1)
//   a2 = h1 w2^T + b2                             h2 = silu(a2)   s2 = silu'(a2)
//   g_v  = dt * g
//   gw3 += g_v^T h2          gb3 += colsum(g_v)
//   g_a2 = (g_v w3) * s2
//   gw2 += g_a2^T h1         gb2 += colsum(g_a2)
//   g_a1 = (g_a2 w2) * s1
//   gw1[:, :D] += g_a1^T x_k gb1 += colsum(g_a1)   gw1[:, D] += t_k * colsum(g_a1)
//   g = g + g_a1 w1[:, :D]                          (= dL/dx_k)
//
// and grad_x0 = g after step 0.  silu'(a) = s (1 + a (1 - s)), s = sigmoid(a),
// PyTorch's SiLU backward.
//
// Memory (elements of the dtype): the trajectory x_1 .. x_{num_steps-1},
// (num_steps - 1) * B * D; six B x H activation/gradient buffers; four B x D
// buffers; one weight-sized scratch (2 H D + H H) and the column-sum partials
// (P x (2 H + D), P = 1 on CPU, ceil(B / 256) on CUDA).  Nothing of size
// num_steps * B * H is ever held: each step's activations are recomputed.
//
// Determinism: every product is one BLAS/cuBLAS call over all rows, every
// column sum runs over rows in a fixed order, and the per-step weight
// gradients are added to the accumulators in step order, so the results are
// bitwise reproducible for the same inputs on the same device (on CPU at a
// given number of threads, which the BLAS may use inside a product).
#pragma once

#include <algorithm>
#include <tuple>

#include "common/matmul.h"
#include "flow_euler.h"

namespace fused_ops {

struct FlowEulerBackwardCall {
  int64_t B, D, H, num_steps;
  Tensor grad_x, x0, w1, b1, w2, b2, w3, b3;
  Tensor grad_x0, grad_w1, grad_b1, grad_w2, grad_b2, grad_w3, grad_b3;

  FlowEulerBackwardCall(const Tensor& grad_x_, const Tensor& x0_, const Tensor& w1_,
                        const Tensor& b1_, const Tensor& w2_, const Tensor& b2_,
                        const Tensor& w3_, const Tensor& b3_, int64_t num_steps_) {
    const auto sizes = check_flow_euler_args(x0_, w1_, b1_, w2_, b2_, w3_, b3_, num_steps_);
    B = sizes.B, D = sizes.D, H = sizes.H, num_steps = num_steps_;
    check_rank(grad_x_, "grad_x", 2, "[B, D], the shape of x0");
    FUSED_OPS_CHECK(grad_x_.size(0) == B && grad_x_.size(1) == D,
                    "grad_x must have the shape of x0 ", shape_str(x0_), ", got ",
                    shape_str(grad_x_));
    check_same_float_dtype_and_device({{x0_, "x0"}, {grad_x_, "grad_x"}});
    grad_x = as_contiguous(grad_x_);
    x0 = as_contiguous(x0_);
    w1 = as_contiguous(w1_);
    b1 = as_contiguous(b1_);
    w2 = as_contiguous(w2_);
    b2 = as_contiguous(b2_);
    w3 = as_contiguous(w3_);
    b3 = as_contiguous(b3_);
    grad_x0 = empty_like_device(x0_, {B, D});
    grad_w1 = empty_like_device(x0_, {H, D + 1});
    grad_b1 = empty_like_device(x0_, {H});
    grad_w2 = empty_like_device(x0_, {H, H});
    grad_b2 = empty_like_device(x0_, {H});
    grad_w3 = empty_like_device(x0_, {D, H});
    grad_b3 = empty_like_device(x0_, {D});
  }

  using Grads = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
  Grads grads() const { return {grad_x0, grad_w1, grad_b1, grad_w2, grad_b2, grad_w3, grad_b3}; }
};

// Pointers of one backward call, in one workspace.
template <typename T>
struct FlowBackwardArgs {
  int64_t B, D, H, num_steps, P;  // P: column-sum partials per column
  const T *grad_x, *x0, *w1, *b1, *w2, *b2, *w3, *b3;
  T *gx0, *gw1, *gb1, *gw2, *gb2, *gw3, *gb3;
  // Workspace.
  T* traj;                         // x_1 .. x_{n-1}, [n-1, B, D]
  T *G, *GV, *GX, *V;              // [B, D]
  T *S1, *H1, *S2, *H2, *GA2, *GA1;  // [B, H]
  T *GW1s, *GW2s, *GW3s;           // [H, D], [H, H], [D, H]
  T *P1, *P2, *P3;                 // [P, H], [P, H], [P, D]

  const T* state(int64_t k) const { return k == 0 ? x0 : traj + (k - 1) * B * D; }
  T* mutable_state(int64_t k) const { return traj + (k - 1) * B * D; }  // k >= 1
};

// Number of elements the workspace needs, and the pointer layout in it (each
// buffer starts at a multiple of 64 elements).
template <typename T>
int64_t flow_backward_layout(FlowBackwardArgs<T>& a, T* base) {
  int64_t off = 0;
  auto take = [&](int64_t n) {
    T* p = base ? base + off : nullptr;
    off += (n + 63) / 64 * 64;
    return p;
  };
  const int64_t B = a.B, D = a.D, H = a.H;
  a.traj = take((a.num_steps - 1) * B * D);
  a.G = take(B * D), a.GV = take(B * D), a.GX = take(B * D), a.V = take(B * D);
  a.S1 = take(B * H), a.H1 = take(B * H), a.S2 = take(B * H), a.H2 = take(B * H);
  a.GA2 = take(B * H), a.GA1 = take(B * H);
  a.GW1s = take(H * D), a.GW2s = take(H * H), a.GW3s = take(D * H);
  a.P1 = take(a.P * H), a.P2 = take(a.P * H), a.P3 = take(a.P * D);
  return off;
}

// Fills the argument struct of a call whose output tensors exist, allocating
// the workspace (kept alive by the returned tensor).
template <typename T>
Tensor flow_backward_args(const FlowEulerBackwardCall& c, int64_t P, FlowBackwardArgs<T>& a) {
  a.B = c.B, a.D = c.D, a.H = c.H, a.num_steps = c.num_steps, a.P = P;
  a.grad_x = c.grad_x.const_data_ptr<T>();
  a.x0 = c.x0.const_data_ptr<T>();
  a.w1 = c.w1.const_data_ptr<T>();
  a.b1 = c.b1.const_data_ptr<T>();
  a.w2 = c.w2.const_data_ptr<T>();
  a.b2 = c.b2.const_data_ptr<T>();
  a.w3 = c.w3.const_data_ptr<T>();
  a.b3 = c.b3.const_data_ptr<T>();
  a.gx0 = c.grad_x0.mutable_data_ptr<T>();
  a.gw1 = c.grad_w1.mutable_data_ptr<T>();
  a.gb1 = c.grad_b1.mutable_data_ptr<T>();
  a.gw2 = c.grad_w2.mutable_data_ptr<T>();
  a.gb2 = c.grad_b2.mutable_data_ptr<T>();
  a.gw3 = c.grad_w3.mutable_data_ptr<T>();
  a.gb3 = c.grad_b3.mutable_data_ptr<T>();
  const int64_t n = flow_backward_layout<T>(a, nullptr);
  Tensor workspace = empty_like_device(c.x0, {n});
  flow_backward_layout<T>(a, workspace.mutable_data_ptr<T>());
  return workspace;
}

// The step sequence of the module comment.  Ops (per device) provides:
//   zero_grads(a)                       weight/bias gradients = 0
//   act(A, Hout, S, bias, w_time, ld_w, t, want_s)
//       z = A + t * w_time[j * ld_w] (if w_time) + bias[j]; Hout = silu(z);
//       S = silu'(z) if want_s (S may alias A); [B, H]
//   update(x_next, x, V, b3, dt)        x_next = x + dt * (V + b3), [B, D]
//   scale_colsum(g_in, gx_add, g_out, gv, dt, partial)
//       g_out = g_in + gx_add (gx_add may be null; g_out may alias g_in);
//       gv = dt * g_out; partial[p, j] = column sums of gv over row chunk p
//   mul_colsum(gh, s, partial)          gh *= s (in place); partials of gh, [B, H]
//   accumulate(a, t)                    gw* += GW*s; gb* += sum_p P*; gw1[:, D] += t * sum_p P1
//   finish(a)                           gx0 = G + GX
// All of them run in stream order with the products.
template <typename T, typename Ops>
void run_flow_euler_backward(const FlowBackwardArgs<T>& a, const torch::stable::Device& dev,
                             const Ops& ops) {
  const int64_t B = a.B, D = a.D, H = a.H, n = a.num_steps;
  const T dt = flow_step_size<T>(n);
  ops.zero_grads(a);

  // Layers 1 and 2 at state x (time t): S1, H1, S2, H2 (S only if want_s).
  auto hidden = [&](const T* x, T t, bool want_s) {
    linear_nt<T>(x, D, a.w1, D + 1, a.S1, H, B, H, D, dev);
    ops.act(a.S1, a.H1, a.S1, a.b1, a.w1 + D, D + 1, t, want_s);
    linear_nt<T>(a.H1, H, a.w2, H, a.S2, H, B, H, H, dev);
    ops.act(a.S2, a.H2, a.S2, a.b2, static_cast<const T*>(nullptr), 0, t, want_s);
  };

  // The trajectory x_1 .. x_{n-1} (x_n is not needed).
  for (int64_t k = 0; k + 1 < n; ++k) {
    hidden(a.state(k), flow_step_time<T>(k, n), false);
    linear_nt<T>(a.H2, H, a.w3, H, a.V, D, B, D, H, dev);
    ops.update(a.mutable_state(k + 1), a.state(k), a.V, a.b3, dt);
  }

  // The steps in reverse.  G holds dL/dx_{k+1} once scale_colsum has added
  // the previous step's pending GX = g_a1 w1[:, :D].
  for (int64_t k = n - 1; k >= 0; --k) {
    const T t = flow_step_time<T>(k, n);
    const T* x = a.state(k);
    hidden(x, t, true);
    if (k == n - 1) {
      ops.scale_colsum(a.grad_x, static_cast<const T*>(nullptr), a.G, a.GV, dt, a.P3);
    } else {
      ops.scale_colsum(a.G, a.GX, a.G, a.GV, dt, a.P3);
    }
    // gw3 part: GV^T [D, B] @ H2 [B, H]; g_h2 = GV [B, D] @ w3 [D, H].
    matmul<T>(a.GV, 1, D, a.H2, H, 1, a.GW3s, H, D, H, B, dev);
    matmul<T>(a.GV, D, 1, a.w3, H, 1, a.GA2, H, B, H, D, dev);
    ops.mul_colsum(a.GA2, a.S2, a.P2);
    // gw2 part: GA2^T @ H1; g_h1 = GA2 @ w2.
    matmul<T>(a.GA2, 1, H, a.H1, H, 1, a.GW2s, H, H, H, B, dev);
    matmul<T>(a.GA2, H, 1, a.w2, H, 1, a.GA1, H, B, H, H, dev);
    ops.mul_colsum(a.GA1, a.S1, a.P1);
    // gw1[:, :D] part: GA1^T @ x_k; pending g_x part: GA1 @ w1[:, :D].
    matmul<T>(a.GA1, 1, H, x, D, 1, a.GW1s, D, H, D, B, dev);
    matmul<T>(a.GA1, H, 1, a.w1, D + 1, 1, a.GX, D, B, D, H, dev);
    ops.accumulate(a, t);
  }
  ops.finish(a);
}

}  // namespace fused_ops
