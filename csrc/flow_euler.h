// fused_ops::flow_euler: argument validation shared by the CPU and CUDA
// wrappers, and the per-device entry points.
#pragma once

#include <torch/headeronly/macros/Macros.h>

#include "common/checks.h"

namespace fused_ops {

// The largest num_steps (INT_MAX).
constexpr int64_t kMaxFlowSteps = 2147483647;

struct FlowEulerSizes {
  int64_t B, D, H;
};

inline FlowEulerSizes check_flow_euler_args(const Tensor& x0, const Tensor& w1,
                                            const Tensor& b1, const Tensor& w2,
                                            const Tensor& b2, const Tensor& w3,
                                            const Tensor& b3, int64_t num_steps) {
  // One bound on both devices, forward and backward, before anything is
  // allocated: the CUDA kernels count steps in int32.
  FUSED_OPS_CHECK(num_steps >= 1 && num_steps <= kMaxFlowSteps,
                  "num_steps must be at least 1 and at most 2147483647 (INT_MAX), got ", num_steps);
  check_rank(x0, "x0", 2, "[B, D]");
  check_rank(w1, "w1", 2, "[H, D + 1]");
  check_rank(b1, "b1", 1, "[H]");
  check_rank(w2, "w2", 2, "[H, H]");
  check_rank(b2, "b2", 1, "[H]");
  check_rank(w3, "w3", 2, "[D, H]");
  check_rank(b3, "b3", 1, "[D]");
  const int64_t B = x0.size(0), D = x0.size(1), H = w1.size(0);
  FUSED_OPS_CHECK(D >= 1, "x0 must have at least one feature (D >= 1), got shape ", shape_str(x0));
  FUSED_OPS_CHECK(H >= 1, "w1 must have at least one hidden unit (H = w1.shape[0] >= 1), got shape ",
              shape_str(w1));
  // w1's last input column multiplies the time feature t.
  check_size(w1, "w1", 1, D + 1, "D + 1: the features of x0 plus the time t");
  check_size(b1, "b1", 0, H, "H, the hidden width w1.shape[0]");
  check_size(w2, "w2", 0, H, "H, the hidden width w1.shape[0]");
  check_size(w2, "w2", 1, H, "H, the hidden width w1.shape[0]");
  check_size(b2, "b2", 0, H, "H, the hidden width w1.shape[0]");
  check_size(w3, "w3", 0, D, "D, the features of x0");
  check_size(w3, "w3", 1, H, "H, the hidden width w1.shape[0]");
  check_size(b3, "b3", 0, D, "D, the features of x0");
  check_same_float_dtype_and_device({{x0, "x0"},
                                     {w1, "w1"},
                                     {b1, "b1"},
                                     {w2, "w2"},
                                     {b2, "b2"},
                                     {w3, "w3"},
                                     {b3, "b3"}});
  return {B, D, H};
}

// Time of step k and the step size, rounded to the working precision the
// way the reference rounds them: a Python float (double) converted once.
// Host and device: the CUDA kernels that loop over steps call them too.
template <typename T>
C10_HOST_DEVICE inline T flow_step_time(int64_t k, int64_t num_steps) {
  return T((double(k) + 0.5) / double(num_steps));
}
template <typename T>
C10_HOST_DEVICE inline T flow_step_size(int64_t num_steps) {
  return T(1.0 / double(num_steps));
}

// The checked sizes and contiguous inputs of a call: what the forward's and
// the backward's call structs share.
struct FlowEulerInputs {
  int64_t B, D, H, num_steps;
  Tensor x0, w1, b1, w2, b2, w3, b3;

  FlowEulerInputs(const Tensor& x0_, const Tensor& w1_, const Tensor& b1_, const Tensor& w2_,
                  const Tensor& b2_, const Tensor& w3_, const Tensor& b3_, int64_t num_steps_) {
    const auto sizes = check_flow_euler_args(x0_, w1_, b1_, w2_, b2_, w3_, b3_, num_steps_);
    B = sizes.B, D = sizes.D, H = sizes.H, num_steps = num_steps_;
    x0 = as_contiguous(x0_);
    w1 = as_contiguous(w1_);
    b1 = as_contiguous(b1_);
    w2 = as_contiguous(w2_);
    b2 = as_contiguous(b2_);
    w3 = as_contiguous(w3_);
    b3 = as_contiguous(b3_);
  }
};

// One forward call: the inputs and the freshly allocated output.
struct FlowEulerCall : FlowEulerInputs {
  Tensor x;

  FlowEulerCall(const Tensor& x0_, const Tensor& w1_, const Tensor& b1_, const Tensor& w2_,
                const Tensor& b2_, const Tensor& w3_, const Tensor& b3_, int64_t num_steps_)
      : FlowEulerInputs(x0_, w1_, b1_, w2_, b2_, w3_, b3_, num_steps_) {
    x = empty_like_device(x0_, {B, D});
  }
};

Tensor flow_euler_cpu(const Tensor& x0, const Tensor& w1, const Tensor& b1,
                          const Tensor& w2, const Tensor& b2, const Tensor& w3,
                          const Tensor& b3, int64_t num_steps);

}  // namespace fused_ops
