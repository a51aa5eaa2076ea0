// \brief fused_ops::importance_log_weights and its backward: the unnormalised
// importance log weights lw = log p(x) - log q(x) of B independent problems,
// target p and proposal q both diagonal Gaussian mixtures.  The argument
// checks shared by the CPU and CUDA wrappers and the call structs (checked
// sizes, contiguous inputs, freshly allocated outputs) that the kernels and
// the CUDA path tables (csrc/cuda/importance_log_weights/) take.
//
// Layout (row-major, problem b first):
//   samples [B, N, D];  target: mix_weights [B, K], mix_mus / mix_stds [B, K, D];
//   proposal: q_weights [B, Kq], q_mus / q_stds [B, Kq, D];  output lw [B, N].
// The kernels treat the K + Kq components of one problem as one list
// (j < K: the target's, j >= K: the proposal's), so a Gaussian proposal is
// Kq = 1 with weight 1.
#pragma once

#include <torch/csrc/stable/ops.h>

#include <optional>
#include <tuple>

#include "common/checks.h"

namespace fused_ops {

struct ImportanceLogWeightsSizes {
  int64_t B, N, D, K, Kq;
};

inline ImportanceLogWeightsSizes check_importance_log_weights_args(
    const Tensor& samples, const Tensor& mix_weights, const Tensor& mix_mus, const Tensor& mix_stds,
    const Tensor& q_weights, const Tensor& q_mus, const Tensor& q_stds) {
  check_rank(samples, "samples", 3, "[B, N, D]");
  check_rank(mix_weights, "mix_weights", 2, "[B, K]");
  check_rank(mix_mus, "mix_mus", 3, "[B, K, D]");
  check_rank(mix_stds, "mix_stds", 3, "[B, K, D]");
  check_rank(q_weights, "q_weights", 2, "[B, Kq]");
  check_rank(q_mus, "q_mus", 3, "[B, Kq, D]");
  check_rank(q_stds, "q_stds", 3, "[B, Kq, D]");
  const int64_t B = samples.size(0), N = samples.size(1), D = samples.size(2);
  const int64_t K = mix_weights.size(1), Kq = q_weights.size(1);
  FUSED_OPS_CHECK(N >= 1, "samples must hold at least one sample per problem (N >= 1): the self-normalised ",
                  "weights are undefined for N = 0, got shape ", shape_str(samples));
  FUSED_OPS_CHECK(K >= 1, "mix_weights must hold at least one mixture component (K >= 1), got shape ",
                  shape_str(mix_weights));
  FUSED_OPS_CHECK(Kq >= 1, "q_weights must hold at least one proposal component (Kq >= 1), got shape ",
                  shape_str(q_weights));
  const char* batch = "B, the number of problems in samples";
  const char* dim = "D, the sample dimension of samples";
  check_size(mix_weights, "mix_weights", 0, B, batch);
  check_size(mix_mus, "mix_mus", 0, B, batch);
  check_size(mix_mus, "mix_mus", 1, K, "K, the number of mixture components in mix_weights");
  check_size(mix_mus, "mix_mus", 2, D, dim);
  check_size(mix_stds, "mix_stds", 0, B, batch);
  check_size(mix_stds, "mix_stds", 1, K, "K, the number of mixture components in mix_weights");
  check_size(mix_stds, "mix_stds", 2, D, dim);
  check_size(q_weights, "q_weights", 0, B, batch);
  check_size(q_mus, "q_mus", 0, B, batch);
  check_size(q_mus, "q_mus", 1, Kq, "Kq, the number of proposal components in q_weights");
  check_size(q_mus, "q_mus", 2, D, dim);
  check_size(q_stds, "q_stds", 0, B, batch);
  check_size(q_stds, "q_stds", 1, Kq, "Kq, the number of proposal components in q_weights");
  check_size(q_stds, "q_stds", 2, D, dim);
  check_same_float_dtype_and_device({{samples, "samples"},
                                     {mix_weights, "mix_weights"},
                                     {mix_mus, "mix_mus"},
                                     {mix_stds, "mix_stds"},
                                     {q_weights, "q_weights"},
                                     {q_mus, "q_mus"},
                                     {q_stds, "q_stds"}});
  return {B, N, D, K, Kq};
}

// The seven inputs, contiguous, with their checked sizes.
struct ImportanceLogWeightsInputs {
  int64_t B, N, D, K, Kq;
  Tensor x, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds;

  ImportanceLogWeightsInputs(const Tensor& samples, const Tensor& mix_weights_, const Tensor& mix_mus_,
                             const Tensor& mix_stds_, const Tensor& q_weights_, const Tensor& q_mus_,
                             const Tensor& q_stds_) {
    const auto s = check_importance_log_weights_args(samples, mix_weights_, mix_mus_, mix_stds_, q_weights_,
                                                     q_mus_, q_stds_);
    B = s.B, N = s.N, D = s.D, K = s.K, Kq = s.Kq;
    x = as_contiguous(samples);
    mix_weights = as_contiguous(mix_weights_);
    mix_mus = as_contiguous(mix_mus_);
    mix_stds = as_contiguous(mix_stds_);
    q_weights = as_contiguous(q_weights_);
    q_mus = as_contiguous(q_mus_);
    q_stds = as_contiguous(q_stds_);
  }
};

// One forward call: the inputs and the freshly allocated lw [B, N].
struct ImportanceLogWeightsCall : ImportanceLogWeightsInputs {
  Tensor log_weights;

  ImportanceLogWeightsCall(const Tensor& samples, const Tensor& mix_weights_, const Tensor& mix_mus_,
                           const Tensor& mix_stds_, const Tensor& q_weights_, const Tensor& q_mus_,
                           const Tensor& q_stds_)
      : ImportanceLogWeightsInputs(samples, mix_weights_, mix_mus_, mix_stds_, q_weights_, q_mus_, q_stds_) {
    log_weights = empty_like_device(samples, {B, N});
  }
};

// ---------------------------------------------------------------------------
// importance_log_weights_backward
// ---------------------------------------------------------------------------

using ImportanceLogWeightsGrads = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// One backward call: the upstream gradient grad_log_weights [B, N] (absent:
// zero, and so are all the gradients), the inputs, and the freshly
// allocated gradients of all seven inputs.
struct ImportanceLogWeightsBackwardCall : ImportanceLogWeightsInputs {
  bool has_grad = false;
  Tensor grad_lw;
  Tensor grad_x, grad_mix_weights, grad_mix_mus, grad_mix_stds, grad_q_weights, grad_q_mus, grad_q_stds;

  ImportanceLogWeightsBackwardCall(const std::optional<Tensor>& grad_log_weights, const Tensor& samples,
                                   const Tensor& mix_weights_, const Tensor& mix_mus_, const Tensor& mix_stds_,
                                   const Tensor& q_weights_, const Tensor& q_mus_, const Tensor& q_stds_)
      : ImportanceLogWeightsInputs(samples, mix_weights_, mix_mus_, mix_stds_, q_weights_, q_mus_, q_stds_) {
    has_grad = grad_log_weights.has_value() && grad_log_weights->defined();
    if (has_grad) {
      const Tensor& g = *grad_log_weights;
      check_rank(g, "grad_log_weights", 2, "[B, N]");
      check_size(g, "grad_log_weights", 0, B, "B, the number of problems in samples");
      check_size(g, "grad_log_weights", 1, N, "N, the number of samples per problem");
      check_same_float_dtype_and_device({{samples, "samples"}, {g, "grad_log_weights"}});
      grad_lw = as_contiguous(g);
    }
    grad_x = empty_like_device(samples, {B, N, D});
    grad_mix_weights = empty_like_device(samples, {B, K});
    grad_mix_mus = empty_like_device(samples, {B, K, D});
    grad_mix_stds = empty_like_device(samples, {B, K, D});
    grad_q_weights = empty_like_device(samples, {B, Kq});
    grad_q_mus = empty_like_device(samples, {B, Kq, D});
    grad_q_stds = empty_like_device(samples, {B, Kq, D});
  }

  // The gradients of a call without an upstream gradient: zero.
  void zero_all() {
    for (Tensor* t : {&grad_x, &grad_mix_weights, &grad_mix_mus, &grad_mix_stds, &grad_q_weights, &grad_q_mus,
                      &grad_q_stds}) {
      torch::stable::zero_(*t);
    }
  }

  ImportanceLogWeightsGrads result() const {
    return {grad_x, grad_mix_weights, grad_mix_mus, grad_mix_stds, grad_q_weights, grad_q_mus, grad_q_stds};
  }
};

}  // namespace fused_ops
