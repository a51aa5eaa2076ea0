// \brief fused_ops::_matmul: the products the ops' kernels run on raw buffers
// (common/matmul.h), as an op, so that tests and sanitizer runs reach them
// directly at any size and layout.  Private (no Python function): on CUDA a
// float32 call goes through the "matmul" path table like the ops' products.
//
// a [m, k] and b [k, n] with any strides (a transposed view is read in
// place, as the ops read a^T for weight gradients); the result [m, n] is
// new, row-major, filled with NaN before the product so that an element the
// product leaves unwritten shows.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <torch/csrc/stable/accelerator.h>

#include <limits>
#include <optional>

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

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) { m.impl("_matmul", TORCH_BOX(&matmul_hook)); }
#if defined(FUSED_OPS_WITH_CUDA)
STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) { m.impl("_matmul", TORCH_BOX(&matmul_hook)); }
#endif

}  // namespace fused_ops
