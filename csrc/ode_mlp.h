// fused_ops::ode_mlp: a fixed-grid Runge-Kutta integration of an MLP
// velocity field (torchdiffeq's euler, midpoint, heun2, heun3 and rk4 = 3/8
// rule), with the argument checks shared by the CPU and CUDA wrappers and by
// the backward (csrc/ode_mlp_backward.h).
//
// The velocity field v(y) of evaluation e (step k, stage i, e = k * stages + i):
//   a_0 = y W_0^T + time_bias[e] (+ sample_bias, per row)    h_0 = act(a_0)
//   a_l = h_{l-1} W_l^T + biases[l-1]                         h_l = act(a_l)   (0 < l < L-1)
//   v   = h_{L-2} W_{L-1}^T + biases[L-2]                     (no activation after the last layer)
// W_l are nn.Linear weights [H_l, H_{l-1}] (H_{-1} = H_{L-1} = D).  The first
// layer's bias, the contribution of the time features (per evaluation time)
// and of any conditioning features (per row) are folded by the caller into
// time_bias [num_evals, H_0] and sample_bias [B, H_0] (fused_ops/ops/_ode.py),
// so autograd reaches whatever produced them.
//
// A step k with dt = t_grid[k+1] - t_grid[k] (in the tensors' dtype, as
// torchdiffeq computes it; negative on a decreasing grid):
//   Y_i = y_k + dt * sum_{j<i} A[i][j] K_j,  K_i = v_{k*s+i}(Y_i)
//   y_{k+1} = y_k + dt * sum_i B[i] K_i
// Output: every state y_0 .. y_S ([S+1, B, D], all_states) or y_S alone ([1, B, D]).
#pragma once

#include <torch/headeronly/macros/Macros.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "common/activation_checks.h"
#include "common/activations.h"
#include "common/checks.h"

namespace fused_ops {

constexpr int64_t kOdeMaxLayers = 8;

// The weights and biases lists (Tensor?[] in the schema: a None is named by the checks).
using OptTensors = std::vector<std::optional<Tensor>>;
constexpr int kOdeMaxStages = 4;

enum OdeMethod : int64_t { kEuler = 0, kMidpoint = 1, kHeun2 = 2, kHeun3 = 3, kRk4 = 4 };
constexpr int64_t kNumOdeMethods = 5;

// A method's Butcher tableau (torchdiffeq's fixed_grid.py / rk_common.py):
// stages, a[i][j] for j < i, b[i].  Doubles, rounded to T where used.
struct OdeTableau {
  int stages;
  double a[kOdeMaxStages][kOdeMaxStages];
  double b[kOdeMaxStages];
};

C10_HOST_DEVICE inline OdeTableau ode_tableau(int64_t method) {
  switch (method) {
    case kEuler: return {1, {{0}}, {1.0}};
    case kMidpoint: return {2, {{0}, {0.5}}, {0.0, 1.0}};
    case kHeun2: return {2, {{0}, {1.0}}, {0.5, 0.5}};
    case kHeun3: return {3, {{0}, {1.0 / 3}, {0.0, 2.0 / 3}}, {0.25, 0.0, 0.75}};
    default:  // kRk4: the 3/8 rule (torchdiffeq's rk4_alt_step_func)
      return {4, {{0}, {1.0 / 3}, {-1.0 / 3, 1.0}, {1.0, -1.0, 1.0}}, {0.125, 0.375, 0.375, 0.125}};
  }
}

inline int ode_stages(int64_t method) { return ode_tableau(method).stages; }

// The checked sizes and contiguous inputs of a call (forward and backward).
struct OdeMlpInputs {
  int64_t B = 0, D = 0, L = 0, S = 0, stages = 0, method = 0, act = 0, H0 = 0, Hmax = 0;
  double act_param = 0;
  std::vector<int64_t> widths;  // H_0 .. H_{L-1} (= D)
  Tensor x0, t_grid, time_bias;
  std::optional<Tensor> sample_bias;
  std::vector<Tensor> weights, biases;

  OdeMlpInputs(const Tensor& x0_, const Tensor& t_grid_, const OptTensors& weights_opt,
               const OptTensors& biases_opt, const Tensor& time_bias_,
               const std::optional<Tensor>& sample_bias_, int64_t method_, int64_t act_,
               double act_param_) {
    FUSED_OPS_CHECK(method_ >= 0 && method_ < kNumOdeMethods,
                    "method must be 0 .. 4 (euler, midpoint, heun2, heun3, rk4), got ", method_);
    check_activation_code(act_);
    check_rank(x0_, "x0", 2, "[B, D]");
    check_rank(t_grid_, "t_grid", 1, "[num_steps + 1]");
    // None in a list reads as an undefined tensor, which check_rank names.
    std::vector<Tensor> weights_, biases_;
    for (const auto& w : weights_opt) weights_.push_back(w ? *w : Tensor());
    for (const auto& b : biases_opt) biases_.push_back(b ? *b : Tensor());
    B = x0_.size(0), D = x0_.size(1), S = t_grid_.size(0) - 1;
    FUSED_OPS_CHECK(D >= 1, "x0 must have at least one feature (D >= 1), got shape ", shape_str(x0_));
    FUSED_OPS_CHECK(S >= 0, "t_grid must hold at least one time (the start), got shape ",
                    shape_str(t_grid_));
    L = int64_t(weights_.size());
    FUSED_OPS_CHECK(L >= 1 && L <= kOdeMaxLayers, "weights must hold 1 to 8 Linear weights, got ", L);
    FUSED_OPS_CHECK(int64_t(biases_.size()) == L - 1,
                    "biases must hold one bias per layer after the first (", L - 1, "), got ",
                    biases_.size());
    int64_t in = D;
    for (int64_t l = 0; l < L; ++l) {
      const std::string name = "weights[" + std::to_string(l) + "]";
      check_rank(weights_[l], name.c_str(), 2, "[out, in]");
      const int64_t out = weights_[l].size(0);
      FUSED_OPS_CHECK(out >= 1, name, " must have at least one output, got shape ", shape_str(weights_[l]));
      check_size(weights_[l], name.c_str(), 1, in,
                 l == 0 ? "D, the features of x0" : "the output width of the layer before");
      if (l == L - 1) check_size(weights_[l], name.c_str(), 0, D, "D: the last layer gives the velocity");
      if (l > 0) {
        const std::string bname = "biases[" + std::to_string(l - 1) + "]";
        check_rank(biases_[l - 1], bname.c_str(), 1, "[out]");
        check_size(biases_[l - 1], bname.c_str(), 0, out, ("the output width of " + name).c_str());
      }
      widths.push_back(out);
      Hmax = std::max(Hmax, out);
      in = out;
    }
    H0 = widths[0];
    stages = ode_stages(method_);
    check_rank(time_bias_, "time_bias", 2, "[num_steps * stages, H_0]");
    check_size(time_bias_, "time_bias", 0, S * stages, "num_steps * stages: one row per evaluation");
    check_size(time_bias_, "time_bias", 1, H0, "H_0, the output width of weights[0]");
    if (sample_bias_) {
      check_rank(*sample_bias_, "sample_bias", 2, "[B, H_0]");
      check_size(*sample_bias_, "sample_bias", 0, B, "B, the rows of x0");
      check_size(*sample_bias_, "sample_bias", 1, H0, "H_0, the output width of weights[0]");
    }
    check_same_float_dtype_and_device({{x0_, "x0"}, {t_grid_, "t_grid"}});
    for (int64_t l = 0; l < L; ++l) {
      const std::string name = "weights[" + std::to_string(l) + "]";
      check_same_float_dtype_and_device({{x0_, "x0"}, {weights_[l], name.c_str()}});
    }
    for (int64_t l = 1; l < L; ++l) {
      const std::string bname = "biases[" + std::to_string(l - 1) + "]";
      check_same_float_dtype_and_device({{x0_, "x0"}, {biases_[l - 1], bname.c_str()}});
    }
    check_same_float_dtype_and_device({{x0_, "x0"}, {time_bias_, "time_bias"}});
    if (sample_bias_) check_same_float_dtype_and_device({{x0_, "x0"}, {*sample_bias_, "sample_bias"}});
    method = method_, act = act_, act_param = act_param_;
    x0 = as_contiguous(x0_);
    t_grid = as_contiguous(t_grid_);
    time_bias = as_contiguous(time_bias_);
    if (sample_bias_) sample_bias = as_contiguous(*sample_bias_);
    for (const Tensor& w : weights_) weights.push_back(as_contiguous(w));
    for (const Tensor& b : biases_) biases.push_back(as_contiguous(b));
  }
};

// Raw pointers of a call, one element type.
template <typename T>
struct OdeMlpPtrs {
  const T* x0;
  const T* t;
  const T* time_bias;
  const T* sample_bias;  // nullptr: none
  const T* w[kOdeMaxLayers];
  const T* b[kOdeMaxLayers];  // b[l] for l >= 1; b[0] unused (time_bias)
  int64_t width[kOdeMaxLayers];
  int64_t B, D, L, S, method, act;
  T act_param;

  explicit OdeMlpPtrs(const OdeMlpInputs& c)
      : x0(cdata<T>(c.x0)), t(cdata<T>(c.t_grid)), time_bias(cdata<T>(c.time_bias)),
        sample_bias(c.sample_bias ? cdata<T>(*c.sample_bias) : nullptr), w{}, b{}, width{},
        B(c.B), D(c.D), L(c.L), S(c.S), method(c.method), act(c.act), act_param(T(c.act_param)) {
    for (int64_t l = 0; l < c.L; ++l) {
      w[l] = cdata<T>(c.weights[l]);
      b[l] = l ? cdata<T>(c.biases[l - 1]) : nullptr;
      width[l] = c.widths[l];
    }
  }
  int64_t in_width(int64_t l) const { return l ? width[l - 1] : D; }
};

// A forward call: the inputs and the output [S+1 or 1, B, D].
struct OdeMlpCall : OdeMlpInputs {
  bool all_states;
  Tensor states;

  OdeMlpCall(const Tensor& x0_, const Tensor& t_grid_, const OptTensors& weights_,
             const OptTensors& biases_, const Tensor& time_bias_,
             const std::optional<Tensor>& sample_bias_, int64_t method_, int64_t act_,
             double act_param_, bool all_states_)
      : OdeMlpInputs(x0_, t_grid_, weights_, biases_, time_bias_, sample_bias_, method_, act_,
                     act_param_),
        all_states(all_states_) {
    states = empty_like_device(x0_, {all_states ? S + 1 : 1, B, D});
  }
};

}  // namespace fused_ops
