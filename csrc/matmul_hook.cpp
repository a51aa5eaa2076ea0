// \brief fused_ops::_matmul: the products the ops' kernels run on raw buffers
// (common/matmul.h), as an op, so that tests and sanitizer runs reach them
// directly at any size and layout.  Private (no Python function): on CUDA a
// float32 call goes through the "matmul" path table like the ops' products.
//
// a [m, k] and b [k, n] with any strides (a transposed view is read in
// place, as the ops read a^T for weight gradients); the result [m, n] is
// new, row-major, filled with NaN before the product so that an element the
// product leaves unwritten shows.  fused_ops::_linear_act (CUDA float32):
// a hidden layer, the product with its bias and activation epilogue.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <torch/csrc/stable/accelerator.h>

#include <limits>
#include <optional>
#include <vector>

#include "common/activations.h"
#include "common/checks.h"
#include "common/matmul.h"

namespace fused_ops {
namespace {

Tensor matmul_hook(const Tensor& a, const Tensor& b) {
  check_rank(a, "a", 2, "[m, k]");
  check_rank(b, "b", 2, "[k, n]");
  check_same_float_dtype_and_device({{a, "a"}, {b, "b"}});
  check_size(b, "b", 0, a.size(1), "a.shape[1], the inner size");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  Tensor out = empty_like_device(a, {m, n});
  torch::stable::fill_(out, std::numeric_limits<double>::quiet_NaN());
  if (m == 0 || n == 0) return out;
  const torch::stable::Device dev = a.device();
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  if (a.is_cuda()) guard.emplace(a.get_device_index());  // the product runs on a's device
  dispatch_float(a.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    matmul(cdata<T>(a), a.stride(0), a.stride(1), cdata<T>(b), b.stride(0), b.stride(1), mdata<T>(out), n, m, n,
           k, dev);
  });
  return out;
}

#if defined(FUSED_OPS_WITH_CUDA)
// A hidden layer through the CUDA matmul table with its epilogue
// (common/matmul.h's linear_nt_bias_act on CUDA float32): out = a @ w^T +
// bias (+ row_bias), h = act(out) for act >= 0.  in_place: out holds
// act(out) and h is empty; act < 0: no activation, h empty.  out and h are
// filled with NaN first.
std::vector<Tensor> linear_act_hook(const Tensor& a, const Tensor& w, std::optional<Tensor> bias,
                                    std::optional<Tensor> row_bias, int64_t act, double act_param, bool in_place) {
  check_rank(a, "a", 2, "[m, k]");
  check_rank(w, "w", 2, "[n, k]");
  FUSED_OPS_CHECK(a.is_cuda() && a.scalar_type() == ScalarType::Float, "a must be a float32 CUDA tensor");
  check_same_float_dtype_and_device({{a, "a"}, {w, "w"}});
  check_size(w, "w", 1, a.size(1), "a.shape[1], the inner size");
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  FUSED_OPS_CHECK(a.is_contiguous(), "a must be contiguous");
  FUSED_OPS_CHECK(w.is_contiguous(), "w must be contiguous");
  if (bias.has_value()) {
    check_rank(*bias, "bias", 1, "[n]");
    check_size(*bias, "bias", 0, n, "w.shape[0]");
    FUSED_OPS_CHECK(bias->is_contiguous(), "bias must be contiguous");
    check_same_float_dtype_and_device({{a, "a"}, {*bias, "bias"}});
  }
  if (row_bias.has_value()) {
    check_rank(*row_bias, "row_bias", 2, "[m, n]");
    check_size(*row_bias, "row_bias", 0, m, "a.shape[0]");
    check_size(*row_bias, "row_bias", 1, n, "w.shape[0]");
    FUSED_OPS_CHECK(row_bias->is_contiguous(), "row_bias must be contiguous");
    check_same_float_dtype_and_device({{a, "a"}, {*row_bias, "row_bias"}});
  }
  FUSED_OPS_CHECK(act < kNumActs, "act must be an activation code below ", kNumActs, " (or < 0: none), got ", act);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor out = empty_like_device(a, {m, n});
  torch::stable::fill_(out, nan);
  const bool separate = act >= 0 && !in_place;
  Tensor h = empty_like_device(a, {separate ? m : 0, separate ? n : 0});
  if (separate) torch::stable::fill_(h, nan);
  if (m == 0 || n == 0) return {out, h};
  const torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  cuda_matmul::Call c{cdata<float>(a), k, 1, cdata<float>(w), 1, k, mdata<float>(out), n, m, n, k,
                      int(a.get_device_index())};
  float* hp = act < 0 ? nullptr : in_place ? mdata<float>(out) : mdata<float>(h);
  c.epilogue = {true, bias ? cdata<float>(*bias) : nullptr, row_bias ? cdata<float>(*row_bias) : nullptr, hp,
                act < 0 ? 0 : act, float(act_param)};
  cuda_matmul::run(c);
  return {out, h};
}
#endif

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) { m.impl("_matmul", TORCH_BOX(&matmul_hook)); }
#if defined(FUSED_OPS_WITH_CUDA)
STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("_matmul", TORCH_BOX(&matmul_hook));
  m.impl("_linear_act", TORCH_BOX(&linear_act_hook));
}
#endif

}  // namespace fused_ops
