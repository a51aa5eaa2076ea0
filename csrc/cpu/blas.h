// Matrix products for the CPU kernels, through torch's own BLAS (MKL or
// OpenBLAS, whatever this torch was built with) via the LibTorch stable ABI.
//
// The kernels work on raw row-major buffers; a product wraps them in
// non-owning tensors (from_blob, no copy) and calls aten::mm.out through the
// stable dispatcher, so the result lands straight in the caller's buffer.
// Called inside torch::stable::parallel_for, ATen runs the product on the
// calling thread (it does not nest parallelism), so per-block products over
// disjoint rows are race-free and their results do not depend on the number
// of threads.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/stableivalue_conversions.h>

#include <array>
#include <type_traits>

#include "common/checks.h"

namespace fused_ops {
namespace cpu {

template <typename T>
Tensor cpu_view(const T* data, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  constexpr ScalarType dtype = std::is_same_v<T, double> ? ScalarType::Double : ScalarType::Float;
  return torch::stable::from_blob(const_cast<T*>(data), {rows, cols}, {row_stride, col_stride},
                                  torch::stable::Device(torch::headeronly::DeviceType::CPU), dtype);
}

// out[m, n] = a[m, k] @ w[n, k]^T: an nn.Linear without its bias.  Each
// matrix is row-major with the given row stride (lda >= k, ldw >= k, ldo >= n),
// so a row block of a larger matrix or the first k columns of a weight work
// without copies.  The views are built once; run() can repeat the product
// on whatever the buffers hold (an integrator's steps reuse them).
template <typename T>
class LinearNT {
 public:
  LinearNT(const T* a, int64_t lda, const T* w, int64_t ldw, T* out, int64_t ldo, int64_t m,
           int64_t n, int64_t k)
      : a_(cpu_view(a, m, k, lda, 1)),
        wt_(cpu_view(w, k, n, 1, ldw)),  // w^T as a strided view, read in place
        out_(cpu_view(out, m, n, ldo, 1)) {}

  void run() const {
    using torch::stable::detail::from;
    using torch::stable::detail::to;
    std::array<StableIValue, 3> stack{from(a_), from(wt_), from(out_)};
    STABLE_TORCH_ERROR_CODE_CHECK(
        torch_call_dispatcher("aten::mm", "out", stack.data(), TORCH_ABI_VERSION));
    (void)to<Tensor>(stack[0]);  // the returned alias of `out`: release its handle
  }

 private:
  Tensor a_, wt_, out_;
};

template <typename T>
void linear_nt(const T* a, int64_t lda, const T* w, int64_t ldw, T* out, int64_t ldo, int64_t m,
               int64_t n, int64_t k) {
  LinearNT<T>(a, lda, w, ldw, out, ldo, m, n, k).run();
}

}  // namespace cpu
}  // namespace fused_ops
