// \brief fused_ops::importance_sampling and its backward: the argument checks
// shared by the CPU and CUDA wrappers, and the call structs (checked sizes,
// contiguous inputs, freshly allocated outputs) that the kernels and the CUDA
// path tables (csrc/cuda/importance_sampling/) take.
#pragma once

#include <torch/csrc/stable/ops.h>

#include <optional>
#include <tuple>

#include "common/checks.h"

namespace fused_ops {

struct ImportanceSamplingSizes {
  int64_t N, D, K;
};

inline ImportanceSamplingSizes check_importance_sampling_args(
    const Tensor& samples, const Tensor& mix_weights, const Tensor& mix_mus,
    const Tensor& mix_stds, const Tensor& q_mu, const Tensor& q_std) {
  check_rank(samples, "samples", 2, "[N, D]");
  check_rank(mix_weights, "mix_weights", 1, "[K]");
  check_rank(mix_mus, "mix_mus", 2, "[K, D]");
  check_rank(mix_stds, "mix_stds", 2, "[K, D]");
  check_rank(q_mu, "q_mu", 1, "[D]");
  check_rank(q_std, "q_std", 1, "[D]");
  const int64_t N = samples.size(0), D = samples.size(1), K = mix_weights.size(0);
  FUSED_OPS_CHECK(N >= 1, "samples must hold at least one sample (N >= 1): the self-normalised ",
                  "weights are undefined for N = 0, got shape ", shape_str(samples));
  FUSED_OPS_CHECK(K >= 1, "mix_weights must hold at least one mixture component (K >= 1), got shape ",
                  shape_str(mix_weights));
  check_size(mix_mus, "mix_mus", 0, K, "K, the number of mixture components in mix_weights");
  check_size(mix_mus, "mix_mus", 1, D, "D, the sample dimension of samples");
  check_size(mix_stds, "mix_stds", 0, K, "K, the number of mixture components in mix_weights");
  check_size(mix_stds, "mix_stds", 1, D, "D, the sample dimension of samples");
  check_size(q_mu, "q_mu", 0, D, "D, the sample dimension of samples");
  check_size(q_std, "q_std", 0, D, "D, the sample dimension of samples");
  check_same_float_dtype_and_device({{samples, "samples"},
                                     {mix_weights, "mix_weights"},
                                     {mix_mus, "mix_mus"},
                                     {mix_stds, "mix_stds"},
                                     {q_mu, "q_mu"},
                                     {q_std, "q_std"}});
  return {N, D, K};
}

using ImportanceSamplingResult = std::tuple<Tensor, Tensor, Tensor>;

// One call's checked sizes, contiguous inputs and freshly allocated outputs:
// everything a device wrapper needs before it launches its kernel.
struct ImportanceSamplingCall {
  int64_t N, D, K;
  Tensor x, mix_weights, mix_mus, mix_stds, q_mu, q_std;
  Tensor weighted_mean, ess, log_weights;

  ImportanceSamplingCall(const Tensor& samples, const Tensor& mix_weights_,
                         const Tensor& mix_mus_, const Tensor& mix_stds_,
                         const Tensor& q_mu_, const Tensor& q_std_) {
    const auto sizes =
        check_importance_sampling_args(samples, mix_weights_, mix_mus_, mix_stds_, q_mu_, q_std_);
    N = sizes.N, D = sizes.D, K = sizes.K;
    x = as_contiguous(samples);
    mix_weights = as_contiguous(mix_weights_);
    mix_mus = as_contiguous(mix_mus_);
    mix_stds = as_contiguous(mix_stds_);
    q_mu = as_contiguous(q_mu_);
    q_std = as_contiguous(q_std_);
    weighted_mean = empty_like_device(samples, {D});
    ess = empty_like_device(samples, {});
    log_weights = empty_like_device(samples, {N});
  }

  ImportanceSamplingResult result() const { return {weighted_mean, ess, log_weights}; }
};


// ---------------------------------------------------------------------------
// importance_sampling_backward
// ---------------------------------------------------------------------------

using ImportanceSamplingGrads = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// One backward call's checked sizes, contiguous inputs (absent upstream
// gradients stay empty: they count as zero) and freshly allocated gradients.
struct ImportanceSamplingBackwardCall {
  int64_t N, D, K;
  std::optional<Tensor> grad_mean, grad_ess, grad_lw;
  Tensor x, mix_weights, mix_mus, mix_stds, q_mu, q_std;
  Tensor weighted_mean, log_weights;
  Tensor grad_x, grad_mix_weights, grad_mix_mus, grad_mix_stds, grad_q_mu, grad_q_std;

  ImportanceSamplingBackwardCall(const std::optional<Tensor>& grad_weighted_mean,
                                 const std::optional<Tensor>& grad_ess_,
                                 const std::optional<Tensor>& grad_log_weights,
                                 const Tensor& samples, const Tensor& mix_weights_,
                                 const Tensor& mix_mus_, const Tensor& mix_stds_,
                                 const Tensor& q_mu_, const Tensor& q_std_,
                                 const Tensor& weighted_mean_, const Tensor& log_weights_) {
    const auto sizes =
        check_importance_sampling_args(samples, mix_weights_, mix_mus_, mix_stds_, q_mu_, q_std_);
    N = sizes.N, D = sizes.D, K = sizes.K;
    check_rank(weighted_mean_, "weighted_mean", 1, "[D]");
    check_size(weighted_mean_, "weighted_mean", 0, D, "D, the sample dimension of samples");
    check_rank(log_weights_, "log_weights", 1, "[N]");
    check_size(log_weights_, "log_weights", 0, N, "N, the number of samples");
    check_same_float_dtype_and_device({{samples, "samples"},
                                       {weighted_mean_, "weighted_mean"},
                                       {log_weights_, "log_weights"}});
    if (grad_weighted_mean) {
      check_rank(*grad_weighted_mean, "grad_weighted_mean", 1, "[D]");
      check_size(*grad_weighted_mean, "grad_weighted_mean", 0, D, "D, the sample dimension of samples");
      check_same_float_dtype_and_device({{samples, "samples"}, {*grad_weighted_mean, "grad_weighted_mean"}});
      grad_mean = as_contiguous(*grad_weighted_mean);
    }
    if (grad_ess_) {
      check_rank(*grad_ess_, "grad_ess", 0, "[]");
      check_same_float_dtype_and_device({{samples, "samples"}, {*grad_ess_, "grad_ess"}});
      grad_ess = as_contiguous(*grad_ess_);
    }
    if (grad_log_weights) {
      check_rank(*grad_log_weights, "grad_log_weights", 1, "[N]");
      check_size(*grad_log_weights, "grad_log_weights", 0, N, "N, the number of samples");
      check_same_float_dtype_and_device({{samples, "samples"}, {*grad_log_weights, "grad_log_weights"}});
      grad_lw = as_contiguous(*grad_log_weights);
    }
    x = as_contiguous(samples);
    mix_weights = as_contiguous(mix_weights_);
    mix_mus = as_contiguous(mix_mus_);
    mix_stds = as_contiguous(mix_stds_);
    q_mu = as_contiguous(q_mu_);
    q_std = as_contiguous(q_std_);
    weighted_mean = as_contiguous(weighted_mean_);
    log_weights = as_contiguous(log_weights_);
    grad_x = empty_like_device(samples, {N, D});
    grad_mix_weights = empty_like_device(samples, {K});
    grad_mix_mus = empty_like_device(samples, {K, D});
    grad_mix_stds = empty_like_device(samples, {K, D});
    grad_q_mu = empty_like_device(samples, {D});
    grad_q_std = empty_like_device(samples, {D});
  }

  ImportanceSamplingGrads result() const {
    return {grad_x, grad_mix_weights, grad_mix_mus, grad_mix_stds, grad_q_mu, grad_q_std};
  }
};

ImportanceSamplingResult importance_sampling_cpu(const Tensor& samples,
                                                 const Tensor& mix_weights,
                                                 const Tensor& mix_mus,
                                                 const Tensor& mix_stds,
                                                 const Tensor& q_mu, const Tensor& q_std);

}  // namespace fused_ops
