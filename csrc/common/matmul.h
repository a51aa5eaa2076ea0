// \brief Matrix products on raw row-major buffers through torch's own matmul
// (MKL/OpenBLAS on CPU, cuBLAS on CUDA), via the LibTorch stable ABI.
//
// A product wraps the buffers in non-owning tensors (from_blob, no copy) and
// calls aten::mm.out through the stable dispatcher, so the result lands
// straight in the caller's buffer; on CUDA it runs on torch's current stream,
// the stream our kernels use.  Called inside torch::stable::parallel_for,
// ATen runs a CPU product on the calling thread (it does not nest
// parallelism), so per-block products over disjoint rows are race-free and
// their results do not depend on the number of threads.
//
// CUDA float32 products go through the "matmul" kernel-path table
// (cuda/matmul/dispatch.cu): large ones run on the tensor cores at float32
// accuracy (the tf32x3 path), the others on cuBLAS as above.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/stableivalue_conversions.h>

#include <array>
#include <type_traits>

#include "common/checks.h"

namespace fused_ops {

template <typename T>
Tensor matrix_view(const T* data, int64_t rows, int64_t cols, int64_t row_stride,
                   int64_t col_stride, const torch::stable::Device& device) {
  constexpr ScalarType dtype = std::is_same_v<T, double> ? ScalarType::Double : ScalarType::Float;
  return torch::stable::from_blob(const_cast<T*>(data), {rows, cols}, {row_stride, col_stride},
                                  device, dtype);
}

inline torch::stable::Device cpu_device() {
  return torch::stable::Device(torch::headeronly::DeviceType::CPU);
}

#if defined(FUSED_OPS_WITH_CUDA)
namespace cuda_matmul {
// What a product does with its sums before they are stored (none when
// `on` is false): v = sum + cb[c] (+ rb[r, c]), stored to out; h[r, c] =
// act(v) (common/activations.h's codes; h == out: only act(v) is stored,
// in place; h null: no activation).  rb and h have out's row stride.  The
// same float operations in the same order as the ops' own bias_act passes.
struct Epilogue {
  bool on = false;
  const float* cb = nullptr;
  const float* rb = nullptr;
  float* h = nullptr;
  int64_t act = 0;
  float act_param = 0.f;
};

// A float32 product on CUDA: out[m, n] (row stride ldo) = a @ b, a [m, k]
// with strides (a_rs, a_cs), b [k, n] with strides (b_rs, b_cs), then the
// epilogue.
struct Call {
  const float* a;
  int64_t a_rs, a_cs;
  const float* b;
  int64_t b_rs, b_cs;
  float* out;
  int64_t ldo, m, n, k;
  int device;
  Epilogue epilogue = {};
};
void run(const Call& c);  // cuda/matmul/dispatch.cu
}  // namespace cuda_matmul
#endif

// Whether a product of T on `device` goes through the CUDA matmul table.
template <typename T>
bool on_cuda_table(const torch::stable::Device& device) {
#if defined(FUSED_OPS_WITH_CUDA)
  return std::is_same_v<T, float> && device.is_cuda();
#else
  (void)device;
  return false;
#endif
}

// out = a @ b through the CUDA table (on_cuda_table<T> holds).
template <typename T>
void cuda_table_matmul(const T* a, int64_t a_rs, int64_t a_cs, const T* b, int64_t b_rs, int64_t b_cs, T* out,
                       int64_t ldo, int64_t m, int64_t n, int64_t k, const torch::stable::Device& device) {
#if defined(FUSED_OPS_WITH_CUDA)
  if constexpr (std::is_same_v<T, float>) {
    cuda_matmul::run({a, a_rs, a_cs, b, b_rs, b_cs, out, ldo, m, n, k, int(device.index())});
    return;
  }
#endif
  (void)a, (void)a_rs, (void)a_cs, (void)b, (void)b_rs, (void)b_cs, (void)out, (void)ldo, (void)m, (void)n,
      (void)k, (void)device;
  FUSED_OPS_CHECK(false, "fused_ops: no CUDA matmul table for this dtype or build");
}

// out = a @ b for any 2-D views (their strides may express transposes).
inline void mm_out(const Tensor& a, const Tensor& b, const Tensor& out) {
  using torch::stable::detail::from;
  using torch::stable::detail::to;
  std::array<StableIValue, 3> stack{from(a), from(b), from(out)};
  // Our own check, not STABLE_TORCH_ERROR_CODE_CHECK: that macro is newer
  // than torch 2.11's headers, and the extension must build against them.
  FUSED_OPS_CHECK(torch_call_dispatcher("aten::mm", "out", stack.data(), TORCH_ABI_VERSION) ==
                      AOTI_TORCH_SUCCESS,
                  "fused_ops: aten::mm.out failed for [", a.size(0), ", ", a.size(1), "] @ [",
                  b.size(0), ", ", b.size(1), "]");
  (void)to<Tensor>(stack[0]);  // the returned alias of `out`: release its handle
}

// out[m, n] = a[m, k] @ w[n, k]^T: an nn.Linear without its bias.  Each
// matrix is row-major with the given row stride (lda >= k, ldw >= k, ldo >= n),
// so a row block of a larger matrix or the first k columns of a weight work
// without copies.  The views are built once; run() can repeat the product
// on whatever the buffers hold (an integrator's steps reuse them).  For
// other layouts (a^T @ b for weight gradients, ...) use Matmul below.
template <typename T>
class LinearNT {
 public:
  LinearNT(const T* a, int64_t lda, const T* w, int64_t ldw, T* out, int64_t ldo, int64_t m,
           int64_t n, int64_t k, const torch::stable::Device& device = cpu_device())
      : a_(matrix_view(a, m, k, lda, 1, device)),
        wt_(matrix_view(w, k, n, 1, ldw, device)),  // w^T as a strided view, read in place
        out_(matrix_view(out, m, n, ldo, 1, device)),
        cuda_(on_cuda_table<T>(device)),
        raw_{a, lda, w, ldw, out, ldo, m, n, k},
        device_(device) {}

  void run() const {
    if (cuda_) {
      cuda_table_matmul(raw_.a, raw_.lda, 1, raw_.w, 1, raw_.ldw, raw_.out, raw_.ldo, raw_.m, raw_.n, raw_.k,
                        device_);
    } else {
      mm_out(a_, wt_, out_);
    }
  }

 private:
  struct Raw {
    const T* a;
    int64_t lda;
    const T* w;
    int64_t ldw;
    T* out;
    int64_t ldo, m, n, k;
  };
  Tensor a_, wt_, out_;
  bool cuda_;
  Raw raw_;
  torch::stable::Device device_;
};

template <typename T>
void linear_nt(const T* a, int64_t lda, const T* w, int64_t ldw, T* out, int64_t ldo, int64_t m,
               int64_t n, int64_t k, const torch::stable::Device& device = cpu_device()) {
  if (on_cuda_table<T>(device)) {
    cuda_table_matmul(a, lda, int64_t(1), w, int64_t(1), ldw, out, ldo, m, n, k, device);
    return;
  }
  LinearNT<T>(a, lda, w, ldw, out, ldo, m, n, k, device).run();
}

// A hidden layer: out[m, n] = a[m, k] @ w[n, k]^T + cb (+ rb [m, n]), then
// h = act(out) (h == out: in place; h null: none); out, rb and h
// contiguous.  On CUDA in float32 the bias and activation are the matmul
// table's epilogue (in the tf32x3 path's split-K add, else one pass after
// the product); elsewhere the product, then ops.bias_act (the op's own
// pass, the same arithmetic).
template <typename T, typename Ops>
void linear_nt_bias_act(const Ops& ops, const T* a, int64_t lda, const T* w, int64_t ldw, T* out, int64_t m,
                        int64_t n, int64_t k, const T* cb, const T* rb, T* h, int64_t act, T act_param,
                        const torch::stable::Device& device) {
#if defined(FUSED_OPS_WITH_CUDA)
  if constexpr (std::is_same_v<T, float>) {
    if (device.is_cuda()) {
      cuda_matmul::Call c{a, lda, 1, w, 1, ldw, out, n, m, n, k, int(device.index())};
      c.epilogue = {true, cb, rb, h, act, act_param};
      cuda_matmul::run(c);
      return;
    }
  }
#endif
  linear_nt(a, lda, w, ldw, out, n, m, n, k, device);
  ops.bias_act(out, h, cb, rb, m, n, act, act_param);
}

// out[m, n] = a @ b where a is [m, k] and b is [k, n], each given as a view
// (data, row stride, column stride): a^T @ g (weight gradients) is
// matmul(a_data, 1, lda, ...) with no copy.
template <typename T>
void matmul(const T* a, int64_t a_rs, int64_t a_cs, const T* b, int64_t b_rs, int64_t b_cs,
            T* out, int64_t ldo, int64_t m, int64_t n, int64_t k,
            const torch::stable::Device& device = cpu_device()) {
  if (on_cuda_table<T>(device)) {
    cuda_table_matmul(a, a_rs, a_cs, b, b_rs, b_cs, out, ldo, m, n, k, device);
    return;
  }
  mm_out(matrix_view(a, m, k, a_rs, a_cs, device), matrix_view(b, k, n, b_rs, b_cs, device),
         matrix_view(out, m, n, ldo, 1, device));
}

}  // namespace fused_ops
