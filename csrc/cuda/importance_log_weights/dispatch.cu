// \brief CUDA entry points of fused_ops::importance_log_weights and its
// backward: argument checks and the kernel-path tables
// (importance_log_weights/cuda, importance_log_weights_backward/cuda).
//
// lw[b, i] = log p_b(x_bi) - log q_b(x_bi), target p_b and proposal q_b
// diagonal Gaussian mixtures (csrc/importance_log_weights.h).  Forward:
// "staged" and "global" (rows.cu: one thread per sample, the parameters in
// shared or global memory); backward: "tiled" (backward.cu: per-block
// partials reduced in a fixed order).  docs/importance_sampling.md
// ("Batched, mixture proposal, evidence") describes the design.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <climits>

#include "common/dispatch.h"
#include "cuda/importance_log_weights/paths.cuh"

namespace fused_ops {
namespace {

namespace ilw = importance_log_weights_paths;
using Call = ImportanceLogWeightsCall;
using BackwardCall = ImportanceLogWeightsBackwardCall;

const dispatch::PathTable<Call, 2> kPaths("importance_log_weights", "cuda", {{
    {"staged", "one problem's prepared parameters fit 48 KB of shared memory (J D <= ~4000 float32)",
     "one thread per sample row, the problem's parameters staged in shared memory", ilw::staged_applies,
     ilw::launch_staged},
    {"global", "any input", "one thread per sample row, the parameters read from global memory (L1)",
     dispatch::always<Call>, ilw::launch_global},
}});

const dispatch::PathTable<BackwardCall, 1> kBackwardPaths("importance_log_weights_backward", "cuda", {{
    {"tiled", "any input", "per-sample gradients, per-block parameter partials merged in a fixed order (no atomics)",
     dispatch::always<BackwardCall>, ilw::launch_tiled_backward},
}});

void check_int_sizes(const ImportanceLogWeightsInputs& c, const char* op) {
  FUSED_OPS_CHECK(c.D <= INT_MAX && c.K + c.Kq <= INT_MAX && (c.K + c.Kq) * c.D <= INT_MAX, op,
                  ": D, K + Kq and (K + Kq) * D must fit in int32, got D=", c.D, ", K=", c.K, ", Kq=", c.Kq);
}

Tensor importance_log_weights_cuda(const Tensor& samples, const Tensor& mix_weights, const Tensor& mix_mus,
                                   const Tensor& mix_stds, const Tensor& q_weights, const Tensor& q_mus,
                                   const Tensor& q_stds) {
  const cuda::TensorDeviceGuard guard(samples);
  Call c(samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds);
  FUSED_OPS_CHECK(samples.is_cuda(), "samples must be a CUDA tensor, got ", device_str(samples));
  check_int_sizes(c, "importance_log_weights");
  FUSED_OPS_CHECK(c.B * ((c.N + ilw::kThreads - 1) / ilw::kThreads) <= INT_MAX,
                  "importance_log_weights: B * ceil(N / 256) must fit in int32, got B=", c.B, ", N=", c.N);
  if (c.B == 0) return c.log_weights;
  kPaths.run(c);
  return c.log_weights;
}

ImportanceLogWeightsGrads importance_log_weights_backward_cuda(const std::optional<Tensor>& grad_log_weights,
    const Tensor& samples,
                                                               const Tensor& mix_weights, const Tensor& mix_mus,
                                                               const Tensor& mix_stds, const Tensor& q_weights,
                                                               const Tensor& q_mus, const Tensor& q_stds) {
  const cuda::TensorDeviceGuard guard(samples);
  BackwardCall c(grad_log_weights, samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds);
  FUSED_OPS_CHECK(samples.is_cuda(), "samples must be a CUDA tensor, got ", device_str(samples));
  check_int_sizes(c, "importance_log_weights_backward");
  if (c.B == 0) return c.result();
  if (!c.has_grad) {
    c.zero_all();
    return c.result();
  }
  kBackwardPaths.run(c);
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("importance_log_weights", TORCH_BOX(&importance_log_weights_cuda));
  m.impl("importance_log_weights_backward", TORCH_BOX(&importance_log_weights_backward_cuda));
}

}  // namespace fused_ops
