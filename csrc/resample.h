// \brief fused_ops::resample: the argument checks shared by the CPU and CUDA
// wrappers, the call struct the kernels and the CUDA path table
// (csrc/cuda/resample/) take, and the sorted positions the three methods
// search for in the weights' CDF.
//
// resample(log_weights [..., N], uniforms [..., U], num_samples M, method)
// -> indices [..., M] (int64), one independent problem per leading index.
// U = M for "multinomial" and "stratified", 1 for "systematic".  Positions
// p_0 <= ... <= p_{M-1} in [0, 1) (float64):
//   multinomial: p_k = 1 - exp(L_k), L_k = sum_{j <= k} log1p(-u_j) / (M - j):
//                the k-th order statistic of M uniforms, generated in order
//                (the sequential method: 1 - p_k = (1 - p_{k-1}) V^(1/(M-k))
//                with V = 1 - u_k uniform on (0, 1]), so no sort is needed;
//   stratified:  p_k = (k + u_k) / M;   systematic: p_k = (k + u_0) / M.
// index_k = min { i : C_i > p_k C_{N-1} },  C_i = sum_{j <= i} exp(lw_j - max lw)
// (float64), clamped to the last index of positive weight, so an index of
// zero weight (lw = -inf) is never returned.  The indices are ascending.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/macros/Macros.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/checks.h"

namespace fused_ops {

enum class ResampleMethod : int { kMultinomial = 0, kStratified = 1, kSystematic = 2 };

inline ResampleMethod parse_resample_method(const std::string& method) {
  if (method == "multinomial") return ResampleMethod::kMultinomial;
  if (method == "stratified") return ResampleMethod::kStratified;
  FUSED_OPS_CHECK(method == "systematic",
                  "method must be 'multinomial', 'stratified' or 'systematic', got '", method, "'");
  return ResampleMethod::kSystematic;
}

// (k + u) / M: stratified and systematic positions (u = u_k, or u_0 for all k).
C10_HOST_DEVICE inline double strided_position(int64_t k, double u, int64_t M) {
  return (double(k) + u) / double(M);
}

// One term of the multinomial order-statistics scan: log1p(-u_k) / (M - k) <= 0.
// u in [0, 1) keeps it finite (1 - u >= 2^-53).
C10_HOST_DEVICE inline double order_statistic_term(int64_t k, double u, int64_t M) {
  return ::log1p(-u) / double(M - k);
}

// The position of a scan value L_k: 1 - exp(L_k), accurate for L_k near 0.
C10_HOST_DEVICE inline double order_statistic_position(double L) { return -::expm1(L); }

struct ResampleCall {
  int64_t B = 1, N = 0, M = 0, U = 0;  // problems, weights, samples, uniforms per problem
  ResampleMethod method = ResampleMethod::kSystematic;
  Tensor log_weights, uniforms, indices;

  ResampleCall(const Tensor& log_weights_, const Tensor& uniforms_, int64_t num_samples,
               const std::string& method_) {
    FUSED_OPS_CHECK(log_weights_.defined(),
                    "log_weights must be a 1-D tensor [N] or a batch of them [..., N], got None");
    const int64_t rank = log_weights_.dim();
    FUSED_OPS_CHECK(rank >= 1, "log_weights must be a 1-D tensor [N] or a batch of them [..., N], got shape ",
                    shape_str(log_weights_));
    method = parse_resample_method(method_);
    FUSED_OPS_CHECK(num_samples >= 0, "num_samples must be >= 0, got ", num_samples);
    M = num_samples;
    N = log_weights_.size(rank - 1);
    FUSED_OPS_CHECK(N >= 1, "log_weights must hold at least one weight per problem (N >= 1): there is ",
                    "nothing to resample from, got shape ", shape_str(log_weights_));
    U = method == ResampleMethod::kSystematic ? 1 : M;
    FUSED_OPS_CHECK(uniforms_.defined(), "uniforms must be a ", rank,
                    "-D tensor [..., U] (the batch shape of log_weights, then U), got None");
    FUSED_OPS_CHECK(uniforms_.dim() == rank, "uniforms must be a ", rank,
                    "-D tensor [..., U] (the batch shape of log_weights, then U), got shape ",
                    shape_str(uniforms_));
    for (int64_t d = 0; d + 1 < rank; ++d) {
      check_size(uniforms_, "uniforms", d, log_weights_.size(d), "the batch shape of log_weights");
      B *= log_weights_.size(d);
    }
    check_size(uniforms_, "uniforms", rank - 1, U,
               method == ResampleMethod::kSystematic ? "one uniform per problem for systematic resampling"
                                                     : "num_samples: one uniform per sample");
    const ScalarType dtype = log_weights_.scalar_type();
    FUSED_OPS_CHECK(dtype == ScalarType::Float || dtype == ScalarType::Double,
                    "log_weights must be float32 or float64, got ", dtype_str(dtype));
    FUSED_OPS_CHECK(uniforms_.scalar_type() == ScalarType::Double,
                    "uniforms must be float64 (draws in [0, 1)), got ", dtype_str(uniforms_.scalar_type()));
    FUSED_OPS_CHECK(ShimTensorInfo(uniforms_).same_device(ShimTensorInfo(log_weights_)),
                    "uniforms must be on the same device as log_weights (", device_str(log_weights_),
                    "), got ", device_str(uniforms_));
    log_weights = as_contiguous(log_weights_);
    uniforms = as_contiguous(uniforms_);
    indices = new_indices(log_weights_);
  }

 private:
  // int64 [..., M] on log_weights' device, contiguous.
  Tensor new_indices(const Tensor& like) const {
    const int64_t rank = like.dim();
    std::vector<int64_t> shape(rank), strides(rank);
    for (int64_t d = 0; d + 1 < rank; ++d) shape[d] = like.size(d);
    shape[rank - 1] = M;
    int64_t stride = 1;
    for (int64_t d = rank - 1; d >= 0; --d) {
      strides[d] = stride;
      stride *= shape[d] > 1 ? shape[d] : 1;
    }
    int32_t device_type = 0;
    AtenTensorHandle out = nullptr;
    const bool ok = aoti_torch_get_device_type(like.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                    aoti_torch_empty_strided(rank, shape.data(), strides.data(), aoti_torch_dtype_int64(),
                                             device_type, like.get_device_index(), &out) == AOTI_TORCH_SUCCESS;
    FUSED_OPS_CHECK(ok, "fused_ops: could not allocate the indices of resample");
    return Tensor(out);
  }
};

Tensor resample_cpu(const Tensor& log_weights, const Tensor& uniforms, int64_t num_samples,
                    std::string method);

}  // namespace fused_ops
