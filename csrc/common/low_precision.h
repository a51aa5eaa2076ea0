// \brief bfloat16 inputs of ops whose kernels compute in float32: the cast
// fallback, written once for every op that accepts them.
//
// An op that takes all-bfloat16 inputs checks them first (names, shapes,
// one dtype: check_same_float_dtype_and_device with allow_bfloat16, so a
// mixed call is refused naming the argument before anything is cast), then
// either takes a bfloat16 kernel path or calls
//   low_precision::in_float32(ScalarType::BFloat16, op_impl, args...)
// which casts every tensor argument to float32 (aten::to through the stable
// dispatcher, on the tensor's device and torch's current stream), runs the
// op's float32 implementation (its whole path table) and casts its tensor
// outputs back to bfloat16.  Non-tensor arguments pass unchanged, absent
// optional tensors stay absent.  The result is the float32 op's on the
// bfloat16 values, rounded once to bfloat16: the cast the Python functions
// make with Tensor.to for the other ops (fused_ops/ops/_dtypes.py), inside
// the op so that torch.ops.fused_ops.* and compiled graphs take bfloat16 too.
#pragma once

#include <torch/csrc/stable/ops.h>

#include <optional>
#include <tuple>
#include <utility>

#include "common/checks.h"

namespace fused_ops {

// Whether t is a bfloat16 tensor (false for an undefined one: the op's rank
// check names a missing argument).
inline bool is_bfloat16(const Tensor& t) {
  return t.defined() && t.scalar_type() == ScalarType::BFloat16;
}

namespace low_precision {

inline Tensor cast(const Tensor& t, ScalarType dtype) {
  return t.defined() ? torch::stable::to(t, dtype) : t;
}

inline std::optional<Tensor> cast(const std::optional<Tensor>& t, ScalarType dtype) {
  if (!t.has_value()) return std::nullopt;
  return cast(*t, dtype);
}

// Scalars (likelihood codes, flags) pass unchanged.
template <typename T>
const T& cast(const T& v, ScalarType) {
  return v;
}

// f(args with every tensor cast to float32...), whose result is a tuple of
// tensors, with each output cast to `out`.
template <typename F, typename... Args>
auto in_float32(ScalarType out, F&& f, const Args&... args) {
  auto result = std::forward<F>(f)(cast(args, ScalarType::Float)...);
  std::apply([&](auto&... o) { ((o = cast(o, out)), ...); }, result);
  return result;
}

}  // namespace low_precision
}  // namespace fused_ops
