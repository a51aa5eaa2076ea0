// fused_ops::ode_mlp_backward: the discrete adjoint of ode_mlp through all
// steps and stages (the sequence is csrc/ode_mlp_core.h's
// ode_mlp_backward_run, shared by the CPU and CUDA implementations).  It
// reads the forward's saved states [S+1, B, D] (ode_mlp with all_states) and
// recomputes each step's stage activations from them: memory
// O(S * B * D) for the states plus O(stages * B * sum H_l) reused per step.
//
// Returns, as one list: grad_x0 [B, D], grad_weights[0 .. L-1],
// grad_biases[0 .. L-2], grad_time_bias [S * stages, H_0] and, when
// sample_bias was given, grad_sample_bias [B, H_0].
#pragma once

#include <vector>

#include "ode_mlp_core.h"

namespace fused_ops {

struct OdeMlpBackwardCall : OdeMlpInputs {
  Tensor grad_states, states;
  std::vector<Tensor> outputs;

  OdeMlpBackwardCall(const Tensor& grad_states_, const Tensor& states_, const Tensor& x0_,
                     const Tensor& t_grid_, const OptTensors& weights_,
                     const OptTensors& biases_, const Tensor& time_bias_,
                     const std::optional<Tensor>& sample_bias_, int64_t method_, int64_t act_,
                     double act_param_)
      : OdeMlpInputs(x0_, t_grid_, weights_, biases_, time_bias_, sample_bias_, method_, act_,
                     act_param_) {
    for (auto [t, name] : {std::pair<const Tensor&, const char*>{grad_states_, "grad_states"},
                           std::pair<const Tensor&, const char*>{states_, "states"}}) {
      check_rank(t, name, 3, "[num_steps + 1, B, D]");
      FUSED_OPS_CHECK(t.size(0) == S + 1 && t.size(1) == B && t.size(2) == D, name,
                      " must have the shape [num_steps + 1, B, D] = [", S + 1, ", ", B, ", ", D,
                      "], got ", shape_str(t));
    }
    check_same_float_dtype_and_device({{x0_, "x0"}, {grad_states_, "grad_states"}, {states_, "states"}});
    grad_states = as_contiguous(grad_states_);
    states = as_contiguous(states_);
    outputs.push_back(empty_like_device(x0_, {B, D}));
    for (int64_t l = 0; l < L; ++l) {
      outputs.push_back(empty_like_device(x0_, {widths[l], l ? widths[l - 1] : D}));
    }
    for (int64_t l = 1; l < L; ++l) outputs.push_back(empty_like_device(x0_, {widths[l]}));
    outputs.push_back(empty_like_device(x0_, {S * stages, H0}));
    if (sample_bias) outputs.push_back(empty_like_device(x0_, {B, H0}));
  }

  template <typename T>
  OdeMlpGrads<T> grads() const {
    OdeMlpGrads<T> g{};
    g.x0 = mdata<T>(outputs[0]);
    for (int64_t l = 0; l < L; ++l) g.w[l] = mdata<T>(outputs[1 + l]);
    for (int64_t l = 1; l < L; ++l) g.b[l] = mdata<T>(outputs[L + l]);
    g.time_bias = mdata<T>(outputs[2 * L]);
    g.sample_bias = sample_bias ? mdata<T>(outputs[2 * L + 1]) : nullptr;
    return g;
  }
};

}  // namespace fused_ops
