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
// Two modes, chosen from the sizes only (so results never depend on anything
// else):
//
// resident   when num_steps * B <= 512 and 6 * num_steps * B * H <= 4 Mi
//            elements (the default B=8, H=256, 32 steps: 256 rows, 0.4 Mi
//            elements): the trajectory
//            pass keeps every step's h1, s1, h2, s2, and the reverse pass keeps
//            every step's g_v, g_a2, g_a1 (and column-sum partials), so
//            no activation is recomputed and each weight gradient is ONE
//            product over all num_steps * B rows at the end (gw3 = G_v^T H2
//            with the steps stacked as rows, ...), written straight into the
//            output; the bias gradients are summed from the partials.  Per
//            step: 3 products (trajectory) + 3 (adjoint).  (CUDA runs this
//            mode as one cooperative launch of the same arithmetic,
//            cuda/flow_euler/backward_resident.cu, not through this step
//            sequence.)
//            Memory: 6 n B H + n B D (trajectory x_0 .. x_{n-1}) + n B D (g_v)
//            + 3 B D + partials n P (2 H + D).
// streaming  otherwise (large batches): only x_1 .. x_{n-1} are kept; each
//            reverse step recomputes its hidden layers from x_k (2 products)
//            and adds its weight-gradient products (3, over B rows) to the
//            outputs.  Memory: (n - 1) B D + 6 B H + 4 B D + a weight-sized
//            scratch (2 H D + H H) + partials P (2 H + D); nothing of size
//            n B H.
//
// P (column-sum partials per step) is 1 on CPU.  On CUDA it is ceil(B / 256)
// when streaming and 0 when resident: the cooperative kernel sums the bias
// gradients over all n B rows at the end, so it keeps no per-step partials.
//
// Determinism: every product is one BLAS/cuBLAS call, every column sum runs
// over rows in a fixed order, and per-step contributions are added in a
// fixed step order, so the results are
// bitwise reproducible for the same inputs on the same device (on CPU at a
// given number of threads, which the BLAS may use inside a product).
#pragma once

#include <algorithm>
#include <tuple>

#include "common/matmul.h"
#include "flow_euler.h"

namespace fused_ops {

struct FlowEulerBackwardCall : FlowEulerInputs {
  Tensor grad_x;
  Tensor grad_x0, grad_w1, grad_b1, grad_w2, grad_b2, grad_w3, grad_b3;

  FlowEulerBackwardCall(const Tensor& grad_x_, const Tensor& x0_, const Tensor& w1_,
                        const Tensor& b1_, const Tensor& w2_, const Tensor& b2_,
                        const Tensor& w3_, const Tensor& b3_, int64_t num_steps_)
      : FlowEulerInputs(x0_, w1_, b1_, w2_, b2_, w3_, b3_, num_steps_) {
    check_rank(grad_x_, "grad_x", 2, "[B, D], the shape of x0");
    FUSED_OPS_CHECK(grad_x_.size(0) == B && grad_x_.size(1) == D,
                    "grad_x must have the shape of x0 ", shape_str(x0_), ", got ",
                    shape_str(grad_x_));
    check_same_float_dtype_and_device({{x0_, "x0"}, {grad_x_, "grad_x"}});
    grad_x = as_contiguous(grad_x_);
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

// Above this many elements of per-step activations (6 n B H) the backward
// streams (recomputes per step) instead of keeping them (module comment).
constexpr int64_t kResidentBudget = int64_t(1) << 22;

// ... and above this many stacked rows (num_steps * B): one product with
// such a long inner dimension rounds worse than the reference's per-step
// products summed (docs/flow_euler.md, Numerics).
constexpr int64_t kResidentMaxRows = 512;

inline bool flow_backward_resident(int64_t B, int64_t H, int64_t num_steps) {
  // (in double: the product of the sizes may not fit int64)
  return double(num_steps) * double(B) <= double(kResidentMaxRows) &&
         6.0 * double(num_steps) * double(B) * double(H) <= double(kResidentBudget);
}

// Pointers of one backward call, in one workspace.  Per-step buffers hold
// `slots` steps: num_steps when resident, else 1 (reused by every step).
template <typename T>
struct FlowBackwardArgs {
  int64_t B, D, H, num_steps, P;  // P: column-sum partials per column and step
  bool resident;
  int64_t slots;
  const T *grad_x, *x0, *w1, *b1, *w2, *b2, *w3, *b3;
  T *gx0, *gw1, *gb1, *gw2, *gb2, *gw3, *gb3;
  // Workspace.
  T* traj;                 // resident: x_0 .. x_{n-1}; streaming: x_1 .. x_{n-1}; [., B, D]
  T *G, *GX, *V;           // [B, D]
  T* GV;                   // [slots, B, D]
  T *S1, *H1, *S2, *H2, *GA2, *GA1;  // [slots, B, H]
  T *GW1s, *GW2s, *GW3s;   // streaming only: [H, D], [H, H], [D, H]
  T *P1, *P2, *P3;         // [slots, P, H], [slots, P, H], [slots, P, D]

  const T* state(int64_t k) const {
    if (resident) return traj + k * B * D;
    return k == 0 ? x0 : traj + (k - 1) * B * D;
  }
  T* mutable_state(int64_t k) const {  // k >= 1 when streaming
    return traj + (resident ? k : k - 1) * B * D;
  }
  int64_t slot(int64_t k) const { return resident ? k : 0; }
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
  const int64_t B = a.B, D = a.D, H = a.H, S = a.slots;
  a.traj = take((a.resident ? a.num_steps : a.num_steps - 1) * B * D);
  a.G = take(B * D), a.GX = take(B * D), a.V = take(B * D);
  a.GV = take(S * B * D);
  a.S1 = take(S * B * H), a.H1 = take(S * B * H), a.S2 = take(S * B * H), a.H2 = take(S * B * H);
  a.GA2 = take(S * B * H), a.GA1 = take(S * B * H);
  const bool scratch = !a.resident;
  a.GW1s = take(scratch ? H * D : 0), a.GW2s = take(scratch ? H * H : 0);
  a.GW3s = take(scratch ? D * H : 0);
  a.P1 = take(S * a.P * H), a.P2 = take(S * a.P * H), a.P3 = take(S * a.P * D);
  return off;
}

// The six weight and bias gradient outputs (all a B == 0 call touches: it
// zeroes them).
template <typename T>
void set_weight_grads(const FlowEulerBackwardCall& c, FlowBackwardArgs<T>& a) {
  a.gw1 = mdata<T>(c.grad_w1);
  a.gb1 = mdata<T>(c.grad_b1);
  a.gw2 = mdata<T>(c.grad_w2);
  a.gb2 = mdata<T>(c.grad_b2);
  a.gw3 = mdata<T>(c.grad_w3);
  a.gb3 = mdata<T>(c.grad_b3);
}

// Fills the argument struct of a call whose output tensors exist, allocating
// the workspace (kept alive by the returned tensor), for the given mode
// (by default the one the sizes choose, flow_backward_resident).
template <typename T>
Tensor flow_backward_args(const FlowEulerBackwardCall& c, int64_t P, FlowBackwardArgs<T>& a,
                          bool resident) {
  a.B = c.B, a.D = c.D, a.H = c.H, a.num_steps = c.num_steps, a.P = P;
  a.resident = resident;
  a.slots = a.resident ? c.num_steps : 1;
  a.grad_x = cdata<T>(c.grad_x);
  a.x0 = cdata<T>(c.x0);
  a.w1 = cdata<T>(c.w1);
  a.b1 = cdata<T>(c.b1);
  a.w2 = cdata<T>(c.w2);
  a.b2 = cdata<T>(c.b2);
  a.w3 = cdata<T>(c.w3);
  a.b3 = cdata<T>(c.b3);
  a.gx0 = mdata<T>(c.grad_x0);
  set_weight_grads(c, a);
  const int64_t n = flow_backward_layout<T>(a, nullptr);
  Tensor workspace = empty_like_device(c.x0, {n});
  flow_backward_layout<T>(a, mdata<T>(workspace));
  return workspace;
}

template <typename T>
Tensor flow_backward_args(const FlowEulerBackwardCall& c, int64_t P, FlowBackwardArgs<T>& a) {
  return flow_backward_args<T>(c, P, a, flow_backward_resident(c.B, c.H, c.num_steps));
}

// The step sequence of the module comment.  Ops (per device) provides:
//   zero_grads(a)                       weight/bias gradients = 0
//   copy(dst, src, n)                   n elements
//   act(A, Hout, S, bias, w_time, ld_w, t, want_s)
//       z = A + (bias[j] + t * w_time[j * ld_w]) (time term if w_time);
//       Hout = silu(z); S = silu'(z) if want_s (S may alias A); [B, H]
//   update(x_next, x, V, b3, dt)        x_next = x + dt * (V + b3), [B, D]
//   scale_colsum(g_in, gx_add, g_out, gv, dt, partial)
//       g_out = g_in + gx_add (gx_add may be null; g_out may alias g_in);
//       gv = dt * g_out; partial[p, j] = column sums of gv over row chunk p
//   mul_colsum(gh, s, partial)          gh *= s (in place); partials of gh, [B, H]
//   accumulate(a, t)                    streaming: gw* += GW*s; gb* += sum_p P*;
//                                       gw1[:, D] += t * sum_p P1
//   finish(a)                           gx0 = G + GX
// All of them run in stream order with the products.
//
// Resident mode runs here on CPU only (CUDA runs it as one cooperative
// launch), so its last step is the caller's, not an Ops member that CUDA
// would have to stub: on return the bias gradients and gw1[:, D] are still
// zero, and the caller sets them from every step's partials P*[k]
// (gb* = sum_k sum_p P*[k], gw1[:, D] = sum_k t_k sum_p P1[k]).
template <typename T, typename Ops>
void run_flow_euler_backward(const FlowBackwardArgs<T>& a, const torch::stable::Device& dev,
                             const Ops& ops) {
  const int64_t B = a.B, D = a.D, H = a.H, n = a.num_steps, P = a.P;
  const T dt = flow_step_size<T>(n);
  ops.zero_grads(a);

  // Per-step buffers of step k (the same ones for every k when streaming).
  struct Step {
    T *S1, *H1, *S2, *H2, *GA2, *GA1, *GV, *P1, *P2, *P3;
  };
  auto step_buffers = [&](int64_t k) {
    const int64_t s = a.slot(k);
    return Step{a.S1 + s * B * H, a.H1 + s * B * H,  a.S2 + s * B * H, a.H2 + s * B * H,
                a.GA2 + s * B * H, a.GA1 + s * B * H, a.GV + s * B * D, a.P1 + s * P * H,
                a.P2 + s * P * H,  a.P3 + s * P * D};
  };

  // Layers 1 and 2 at state x (time t) into the step's S1, H1, S2, H2 (S only if want_s).
  auto hidden = [&](const Step& b, const T* x, T t, bool want_s) {
    linear_nt<T>(x, D, a.w1, D + 1, b.S1, H, B, H, D, dev);
    ops.act(b.S1, b.H1, b.S1, a.b1, a.w1 + D, D + 1, t, want_s);
    linear_nt<T>(b.H1, H, a.w2, H, b.S2, H, B, H, H, dev);
    ops.act(b.S2, b.H2, b.S2, a.b2, static_cast<const T*>(nullptr), 0, t, want_s);
  };

  // The trajectory (x_n is not needed); when resident, also every step's
  // hidden layers, kept for the reverse pass.
  if (a.resident) ops.copy(a.traj, a.x0, B * D);
  const int64_t forward_steps = a.resident ? n : n - 1;
  for (int64_t k = 0; k < forward_steps; ++k) {
    const Step b = step_buffers(k);
    hidden(b, a.state(k), flow_step_time<T>(k, n), a.resident);
    if (k + 1 < n) {
      linear_nt<T>(b.H2, H, a.w3, H, a.V, D, B, D, H, dev);
      ops.update(a.mutable_state(k + 1), a.state(k), a.V, a.b3, dt);
    }
  }

  // The steps in reverse.  G holds dL/dx_{k+1} once scale_colsum has added
  // the previous step's pending GX = g_a1 w1[:, :D].
  for (int64_t k = n - 1; k >= 0; --k) {
    const T t = flow_step_time<T>(k, n);
    const T* x = a.state(k);
    const Step b = step_buffers(k);
    if (!a.resident) hidden(b, x, t, true);
    if (k == n - 1) {
      ops.scale_colsum(a.grad_x, static_cast<const T*>(nullptr), a.G, b.GV, dt, b.P3);
    } else {
      ops.scale_colsum(a.G, a.GX, a.G, b.GV, dt, b.P3);
    }
    // g_h2 = GV [B, D] @ w3 [D, H] (streaming: gw3 part GV^T [D, B] @ H2 [B, H]).
    if (!a.resident) matmul<T>(b.GV, 1, D, b.H2, H, 1, a.GW3s, H, D, H, B, dev);
    matmul<T>(b.GV, D, 1, a.w3, H, 1, b.GA2, H, B, H, D, dev);
    ops.mul_colsum(b.GA2, b.S2, b.P2);
    // g_h1 = GA2 @ w2 (streaming: gw2 part GA2^T @ H1).
    if (!a.resident) matmul<T>(b.GA2, 1, H, b.H1, H, 1, a.GW2s, H, H, H, B, dev);
    matmul<T>(b.GA2, H, 1, a.w2, H, 1, b.GA1, H, B, H, H, dev);
    ops.mul_colsum(b.GA1, b.S1, b.P1);
    // Pending g_x part GA1 @ w1[:, :D] (streaming: gw1[:, :D] part GA1^T @ x_k).
    if (!a.resident) matmul<T>(b.GA1, 1, H, x, D, 1, a.GW1s, D, H, D, B, dev);
    matmul<T>(b.GA1, H, 1, a.w1, D + 1, 1, a.GX, D, B, D, H, dev);
    if (!a.resident) ops.accumulate(a, t);
  }

  if (a.resident) {
    // Each weight gradient as one product over all n * B rows (the steps
    // stacked), straight into the output: gw3 = GV^T H2, gw2 = GA2^T H1,
    // gw1[:, :D] = GA1^T X (row stride D + 1 leaves the time column alone).
    // The bias gradients are the caller's (comment above the function).
    const int64_t R = n * B;
    matmul<T>(a.GV, 1, D, a.H2, H, 1, a.gw3, H, D, H, R, dev);
    matmul<T>(a.GA2, 1, H, a.H1, H, 1, a.gw2, H, H, H, R, dev);
    matmul<T>(a.GA1, 1, H, a.traj, D, 1, a.gw1, D + 1, H, D, R, dev);
  }
  ops.finish(a);
}

}  // namespace fused_ops
