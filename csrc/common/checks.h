// \brief Argument checks shared by the CPU and CUDA wrappers of every op, and
// the small stable-ABI helpers they use (data pointers, contiguous views,
// output allocation, float dtype dispatch).
//
// Every message names the argument and says what was expected, so a user who
// passes the wrong thing sees which one (DESIGN.md section 4).
//
// Written against the LibTorch stable ABI (torch/csrc/stable): the wrappers
// see torch::stable::Tensor only, so one build of the extension loads into
// every torch release from TORCH_TARGET_VERSION (setup.py) on.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <sstream>
#include <string>
#include <utility>

namespace fused_ops {
namespace detail {
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}
}  // namespace detail

// Like STD_TORCH_CHECK, but the message is only what the caller wrote (no
// function/file/line prefix): these errors are for users, not for us.  The
// stable ABI turns the std::runtime_error into a Python RuntimeError.
#define FUSED_OPS_CHECK(cond, ...)                                   \
  do {                                                               \
    if (!(cond)) {                                                   \
      throw std::runtime_error(::fused_ops::detail::cat(__VA_ARGS__)); \
    }                                                                \
  } while (0)

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

// "[4, 16]": the stable ABI's size arrays have no stream operator.
inline std::string shape_str(const Tensor& t) {
  std::ostringstream s;
  s << "[";
  for (int64_t i = 0; i < t.dim(); ++i) s << (i ? ", " : "") << t.size(i);
  s << "]";
  return s.str();
}

inline std::string device_str(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  if (t.is_cuda()) return "cuda:" + std::to_string(int(t.get_device_index()));
  return "device type " + std::to_string(int(t.device().type()));
}

inline const char* dtype_str(ScalarType dtype) {
  switch (dtype) {
    case ScalarType::Float: return "float32";
    case ScalarType::Double: return "float64";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Long: return "int64";
    case ScalarType::Int: return "int32";
    case ScalarType::Bool: return "bool";
    default: return "a non-float32/float64 dtype";
  }
}

// Every op checks each tensor's rank first, so this is also where a missing
// tensor (None from Python: an undefined tensor here, which would otherwise
// read as shape [0]) is reported, by name.
inline void check_rank(const Tensor& t, const char* name, int64_t rank, const char* layout) {
  FUSED_OPS_CHECK(t.defined(), name, " must be a ", rank, "-D tensor ", layout, ", got None");
  FUSED_OPS_CHECK(t.dim() == rank, name, " must be a ", rank, "-D tensor ", layout, ", got shape ",
                  shape_str(t));
}

inline void check_size(const Tensor& t, const char* name, int64_t dim, int64_t expected,
                       const char* what) {
  FUSED_OPS_CHECK(t.size(dim) == expected, name, ".shape[", dim, "] must be ", expected, " (",
                  what, "), got shape ", shape_str(t));
}

using NamedTensor = std::pair<const Tensor&, const char*>;

// A tensor's dtype and device as the C shim's raw codes: one call into
// libtorch each.  Tensor::scalar_type() and Tensor::device() also translate
// the codes through a chain of calls (one per known dtype: seven for
// float32), which a 12-tensor op would pay dozens of times per call.
struct ShimTensorInfo {
  int32_t dtype = 0, device_type = 0, device_index = 0;

  explicit ShimTensorInfo(const Tensor& t) {
    const bool ok = aoti_torch_get_dtype(t.get(), &dtype) == AOTI_TORCH_SUCCESS &&
                    aoti_torch_get_device_type(t.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                    aoti_torch_get_device_index(t.get(), &device_index) == AOTI_TORCH_SUCCESS;
    FUSED_OPS_CHECK(ok, "fused_ops: could not read a tensor's dtype and device");
  }
  bool same_device(const ShimTensorInfo& o) const {
    return device_type == o.device_type && device_index == o.device_index;
  }
};

// All tensors float32/float64, the same dtype as the first, on the first one's device.
// With allow_bfloat16, all-bfloat16 tensors pass too (ops that take them:
// a bfloat16 kernel path or common/low_precision.h's float32 fallback); the
// message stays the float32/float64 one, which every op and fake shares.
inline void check_same_float_dtype_and_device(std::initializer_list<NamedTensor> tensors,
                                              bool allow_bfloat16 = false) {
  const auto& [first, first_name] = *tensors.begin();
  const ScalarType dtype = first.scalar_type();
  FUSED_OPS_CHECK(dtype == ScalarType::Float || dtype == ScalarType::Double ||
                      (allow_bfloat16 && dtype == ScalarType::BFloat16),
                  first_name, " must be float32 or float64, got ", dtype_str(dtype));
  const ShimTensorInfo want(first);
  for (auto it = tensors.begin() + 1; it != tensors.end(); ++it) {
    const auto& [t, name] = *it;
    const ShimTensorInfo got(t);
    FUSED_OPS_CHECK(got.dtype == want.dtype, name, " must have the same dtype as ", first_name,
                    " (", dtype_str(dtype), "), got ", dtype_str(t.scalar_type()));
    FUSED_OPS_CHECK(got.same_device(want), name, " must be on the same device as ", first_name,
                    " (", device_str(first), "), got ", device_str(t));
  }
}

// Typed data pointers without Tensor::const_data_ptr<T>()'s dtype check
// (the translation above, per pointer): the wrappers check every tensor's
// dtype once, up front (check_same_float_dtype_and_device), then dispatch.
template <typename T>
const T* cdata(const Tensor& t) {
  return static_cast<const T*>(t.const_data_ptr());
}
template <typename T>
T* mdata(const Tensor& t) {
  return static_cast<T*>(t.mutable_data_ptr());
}
// An optional tensor's data (an upstream gradient that may be None), or
// nullptr when it is absent: the backward kernels read that as zero.
template <typename T>
const T* cdata_or_null(const std::optional<Tensor>& t) {
  return t ? cdata<T>(*t) : nullptr;
}

// A contiguous view of t: no call into torch when it already is (the common
// case; each stable-ABI op call is a boxed dispatcher call).
inline Tensor as_contiguous(const Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

// A new contiguous tensor of `sizes` with the dtype and device of `like`.
// Straight through the C shim's empty_strided rather than
// torch::stable::empty, which looks the op up by name and boxes its arguments
// on every call: that costs several microseconds per output, a sizeable share
// of a small call.
inline Tensor empty_like_device(const Tensor& like, std::initializer_list<int64_t> sizes) {
  int64_t shape[8], strides[8];
  const int64_t ndim = int64_t(sizes.size());
  int64_t stride = 1;
  for (int64_t i = ndim - 1; i >= 0; --i) {
    shape[i] = sizes.begin()[i];
    strides[i] = stride;
    stride *= shape[i] > 1 ? shape[i] : 1;
  }
  int32_t dtype = 0, device_type = 0;
  AtenTensorHandle out = nullptr;
  const bool ok = aoti_torch_get_dtype(like.get(), &dtype) == AOTI_TORCH_SUCCESS &&
                  aoti_torch_get_device_type(like.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                  aoti_torch_empty_strided(ndim, shape, strides, dtype, device_type,
                                           like.get_device_index(), &out) == AOTI_TORCH_SUCCESS;
  if (!ok) {
    std::ostringstream shape;
    shape << "[";
    for (int64_t i = 0; i < ndim; ++i) shape << (i ? ", " : "") << sizes.begin()[i];
    shape << "]";
    FUSED_OPS_CHECK(false, "fused_ops: could not allocate a tensor of shape ", shape.str(), " (",
                    dtype_str(like.scalar_type()), ", ", device_str(like), ")");
  }
  return Tensor(out);
}

// A float64 workspace of n (at least 1) elements on `like`'s device, whatever
// `like`'s dtype (the kernels' double partial sums); `op` names the op in the
// error.
inline Tensor float64_workspace(const Tensor& like, int64_t n, const char* op) {
  int64_t size = n > 0 ? n : 1, stride = 1;
  int32_t device_type = 0;
  AtenTensorHandle out = nullptr;
  const bool ok = aoti_torch_get_device_type(like.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                  aoti_torch_empty_strided(1, &size, &stride, aoti_torch_dtype_float64(), device_type,
                                           like.get_device_index(), &out) == AOTI_TORCH_SUCCESS;
  FUSED_OPS_CHECK(ok, "fused_ops: could not allocate the ", op, " workspace (", size, " doubles)");
  return Tensor(out);
}

// Float dispatch without ATen's AT_DISPATCH macros: calls f(T{}) with the
// element type of a float32/float64 tensor (the checks above ran first).
template <typename F>
decltype(auto) dispatch_float(ScalarType dtype, F&& f) {
  if (dtype == ScalarType::Double) return f(double{});
  FUSED_OPS_CHECK(dtype == ScalarType::Float, "expected float32 or float64, got ", dtype_str(dtype));
  return f(float{});
}

}  // namespace fused_ops
