// \brief fused_ops::snis and its backward: self-normalised importance
// sampling of given log weights.  The argument checks shared by the CPU and
// CUDA wrappers and the call structs (checked sizes, contiguous inputs,
// freshly allocated outputs) that the kernels and the CUDA path table
// (csrc/cuda/snis/) take.
//
// Layout: log_weights [..., N] is B = prod(...) independent problems of N
// weights, row-major ([B, N]); samples [..., N, D] is [B, N, D].  The
// outputs not asked for (mean and variance without samples, variance
// without moments) are empty tensors of shape [0].
#pragma once

#include <torch/csrc/stable/ops.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/checks.h"

namespace fused_ops {

struct SnisSizes {
  int64_t B, N, D;
  bool has_samples, moments;
};

// A new contiguous tensor of `sizes` (any rank) with the dtype and device of `like`.
inline Tensor snis_empty(const Tensor& like, const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (int64_t i = int64_t(sizes.size()) - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= sizes[i] > 1 ? sizes[i] : 1;
  }
  int32_t dtype = 0, device_type = 0;
  AtenTensorHandle out = nullptr;
  const bool ok = aoti_torch_get_dtype(like.get(), &dtype) == AOTI_TORCH_SUCCESS &&
                  aoti_torch_get_device_type(like.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                  aoti_torch_empty_strided(int64_t(sizes.size()), sizes.data(), strides.data(), dtype,
                                           device_type, like.get_device_index(), &out) == AOTI_TORCH_SUCCESS;
  FUSED_OPS_CHECK(ok, "fused_ops: could not allocate an output of snis (", dtype_str(like.scalar_type()), ", ",
                  device_str(like), ")");
  return Tensor(out);
}

inline std::vector<int64_t> snis_batch_shape(const Tensor& log_weights) {
  std::vector<int64_t> shape;
  for (int64_t i = 0; i + 1 < log_weights.dim(); ++i) shape.push_back(log_weights.size(i));
  return shape;
}

// `lw_name`: the argument's name (the backward checks log_norm_weights by the same rules).
inline SnisSizes check_snis_args(const Tensor& log_weights, const std::optional<Tensor>& samples,
                                 bool moments, const char* lw_name = "log_weights") {
  FUSED_OPS_CHECK(log_weights.defined(), lw_name, " must be a 1-D tensor [N] or batched [..., N], got None");
  FUSED_OPS_CHECK(log_weights.dim() >= 1, lw_name, " must be a 1-D tensor [N] or batched [..., N], got shape ",
                  shape_str(log_weights));
  const int64_t R = log_weights.dim(), N = log_weights.size(R - 1);
  FUSED_OPS_CHECK(N >= 1, lw_name, " must hold at least one weight per problem (N >= 1): the self-normalised ",
                  "weights are undefined for N = 0, got shape ", shape_str(log_weights));
  int64_t B = 1;
  for (int64_t i = 0; i + 1 < R; ++i) B *= log_weights.size(i);
  int64_t D = 0;
  const bool has_samples = samples.has_value() && samples->defined();
  if (has_samples) {
    FUSED_OPS_CHECK(samples->dim() == R + 1, "samples must be a ", R + 1,
                    "-D tensor [..., N, D] (the dimensions of ", lw_name, ", then D), got shape ",
                    shape_str(*samples));
    for (int64_t i = 0; i < R; ++i) {
      check_size(*samples, "samples", i, log_weights.size(i),
                 i + 1 == R ? "N, the number of weights in log_weights" : "a batch dimension of log_weights");
    }
    D = samples->size(R);
    check_same_float_dtype_and_device({{log_weights, lw_name}, {*samples, "samples"}});
  } else {
    check_same_float_dtype_and_device({{log_weights, lw_name}});
  }
  FUSED_OPS_CHECK(has_samples || !moments, "samples must be a ", R + 1,
                  "-D tensor [..., N, D] when moments=True (the variance is a moment of the samples), got None");
  return {B, N, D, has_samples, moments};
}

using SnisResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// One call's checked sizes, contiguous inputs and freshly allocated outputs.
struct SnisCall {
  int64_t B, N, D;
  bool has_samples, moments;
  Tensor lw, x;  // x: undefined without samples
  Tensor log_norm_weights, ess, log_evidence, mean, variance;

  SnisCall(const Tensor& log_weights, const std::optional<Tensor>& samples, bool moments_) {
    const SnisSizes s = check_snis_args(log_weights, samples, moments_);
    B = s.B, N = s.N, D = s.D, has_samples = s.has_samples, moments = s.moments;
    lw = as_contiguous(log_weights);
    if (has_samples) x = as_contiguous(*samples);
    std::vector<int64_t> batch = snis_batch_shape(log_weights), lw_shape = batch, d_shape = batch;
    lw_shape.push_back(N);
    d_shape.push_back(D);
    log_norm_weights = snis_empty(log_weights, lw_shape);
    ess = snis_empty(log_weights, batch);
    log_evidence = snis_empty(log_weights, batch);
    mean = snis_empty(log_weights, has_samples ? d_shape : std::vector<int64_t>{0});
    variance = snis_empty(log_weights, moments ? d_shape : std::vector<int64_t>{0});
  }

  SnisResult result() const { return {log_norm_weights, ess, log_evidence, mean, variance}; }
};

// ---------------------------------------------------------------------------
// snis_backward
// ---------------------------------------------------------------------------

using SnisGrads = std::tuple<Tensor, Tensor>;

inline void check_snis_upstream(const std::optional<Tensor>& g, const char* name, const Tensor& like,
                                const char* like_name, const Tensor& lnw) {
  if (!g || !g->defined()) return;
  FUSED_OPS_CHECK(g->dim() == like.dim(), name, " must be a ", like.dim(), "-D tensor with the shape of ",
                  like_name, " ", shape_str(like), ", got shape ", shape_str(*g));
  for (int64_t i = 0; i < like.dim(); ++i) {
    FUSED_OPS_CHECK(g->size(i) == like.size(i), name, ".shape[", i, "] must be ", like.size(i), " (the shape of ",
                    like_name, " ", shape_str(like), "), got shape ", shape_str(*g));
  }
  check_same_float_dtype_and_device({{lnw, "log_norm_weights"}, {*g, name}});
}

// One backward call: checked sizes, contiguous inputs (absent upstream
// gradients stay empty: zero) and freshly allocated gradients.
struct SnisBackwardCall {
  int64_t B, N, D;
  bool has_samples;
  std::optional<Tensor> g_lw, g_ess, g_logz, g_mean, g_var;
  Tensor lnw, x, mean, variance;
  Tensor grad_log_weights, grad_samples;

  SnisBackwardCall(const std::optional<Tensor>& grad_log_norm_weights, const std::optional<Tensor>& grad_ess,
                   const std::optional<Tensor>& grad_log_evidence, const std::optional<Tensor>& grad_mean,
                   const std::optional<Tensor>& grad_variance, const Tensor& log_norm_weights,
                   const std::optional<Tensor>& samples, const Tensor& mean_, const Tensor& variance_) {
    const SnisSizes s = check_snis_args(log_norm_weights, samples, false, "log_norm_weights");
    B = s.B, N = s.N, D = s.D, has_samples = s.has_samples;
    const std::vector<int64_t> batch = snis_batch_shape(log_norm_weights);
    // The expected shapes of the per-problem outputs, as tensors to compare against.
    const Tensor batch_like = snis_empty(log_norm_weights, batch);
    std::vector<int64_t> d_shape = batch;
    d_shape.push_back(D);
    const Tensor d_like = snis_empty(log_norm_weights, has_samples ? d_shape : std::vector<int64_t>{0});
    check_snis_upstream(mean_, "mean", d_like, has_samples ? "samples' [..., D]" : "an empty tensor", log_norm_weights);
    // The forward's variance: [..., D] with moments=True, else an empty [0].
    bool has_var = has_samples && variance_.defined() && variance_.dim() == d_like.dim();
    for (int64_t i = 0; has_var && i < d_like.dim(); ++i) has_var = variance_.size(i) == d_like.size(i);
    if (!(variance_.defined() && variance_.dim() == 1 && variance_.size(0) == 0)) {
      check_snis_upstream(variance_, "variance", d_like, "samples' [..., D], or an empty [0]", log_norm_weights);
    }
    check_snis_upstream(grad_log_norm_weights, "grad_log_norm_weights", log_norm_weights, "log_norm_weights",
                        log_norm_weights);
    check_snis_upstream(grad_ess, "grad_ess", batch_like, "ess", log_norm_weights);
    check_snis_upstream(grad_log_evidence, "grad_log_evidence", batch_like, "log_evidence", log_norm_weights);
    FUSED_OPS_CHECK(has_samples || !(grad_mean && grad_mean->defined()),
                    "grad_mean needs samples (the mean is a moment of the samples), got samples None");
    check_snis_upstream(grad_mean, "grad_mean", d_like, "mean", log_norm_weights);
    const bool want_var = grad_variance && grad_variance->defined();
    FUSED_OPS_CHECK(!want_var || has_var, "grad_variance needs the forward's variance (moments=True)");
    check_snis_upstream(grad_variance, "grad_variance", d_like, "variance", log_norm_weights);
    auto keep = [](const std::optional<Tensor>& g) -> std::optional<Tensor> {
      if (!g || !g->defined()) return std::nullopt;
      return as_contiguous(*g);
    };
    g_lw = keep(grad_log_norm_weights), g_ess = keep(grad_ess), g_logz = keep(grad_log_evidence);
    g_mean = keep(grad_mean), g_var = keep(grad_variance);
    lnw = as_contiguous(log_norm_weights);
    if (has_samples) x = as_contiguous(*samples);
    mean = as_contiguous(mean_);
    if (has_var) variance = as_contiguous(variance_);
    std::vector<int64_t> lw_shape = batch;
    lw_shape.push_back(N);
    grad_log_weights = snis_empty(log_norm_weights, lw_shape);
    std::vector<int64_t> x_shape = lw_shape;
    x_shape.push_back(D);
    grad_samples = snis_empty(log_norm_weights, has_samples ? x_shape : std::vector<int64_t>{0});
  }

  SnisGrads result() const { return {grad_log_weights, grad_samples}; }
};

}  // namespace fused_ops
