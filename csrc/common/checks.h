// Argument checks shared by the CPU and CUDA wrappers of every op.
//
// Every message names the argument and says what was expected, so a user who
// passes the wrong thing sees which one (DESIGN.md section 4).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <utility>

namespace fused_ops {

using NamedTensor = std::pair<const at::Tensor&, const char*>;

inline void check_rank(const at::Tensor& t, const char* name, int64_t rank, const char* layout) {
  TORCH_CHECK(t.dim() == rank, name, " must be a ", rank, "-D tensor ", layout, ", got shape ",
              t.sizes());
}

inline void check_size(const at::Tensor& t, const char* name, int64_t dim, int64_t expected,
                       const char* what) {
  TORCH_CHECK(t.size(dim) == expected, name, ".shape[", dim, "] must be ", expected, " (", what,
              "), got shape ", t.sizes());
}

// All tensors float32/float64, the same dtype as the first, on the first one's device.
inline void check_same_float_dtype_and_device(std::initializer_list<NamedTensor> tensors) {
  const auto& [first, first_name] = *tensors.begin();
  TORCH_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble, first_name,
              " must be float32 or float64, got ", first.scalar_type());
  for (const auto& [t, name] : tensors) {
    TORCH_CHECK(t.scalar_type() == first.scalar_type(), name, " must have the same dtype as ",
                first_name, " (", first.scalar_type(), "), got ", t.scalar_type());
    TORCH_CHECK(t.device() == first.device(), name, " must be on the same device as ", first_name,
                " (", first.device(), "), got ", t.device());
  }
}

}  // namespace fused_ops
