// CPU kernel of fused_ops::flow_euler.
//
// Rows of x are cut into blocks of kRowBlock rows (fixed, never derived from
// the thread count), and each block runs through all num_steps Euler steps on
// its own before the next block starts on that thread: its activations
// (2 x kRowBlock x H values) stay in L2 next to the weights, instead of every
// layer streaming a [B, H] tensor through memory as the reference does.
// Per step and block: three BLAS products (common/matmul.h: torch's BLAS,
// single-threaded inside the parallel region) and, between them, one fused pass that adds the
// bias and applies SiLU (layers 1, 2) or adds the bias and does the Euler
// update x += dt * v (layer 3).  The time feature t is folded into layer 1's
// bias, c1 = b1 + t * w1[:, D], so the product reads x in place and no [B, D+1]
// input is built.
//
// Determinism: a row's result depends only on its block's products, and a
// block's size depends only on B, so results are bitwise reproducible for
// any number of threads once B > kRowBlock.  With a single block (B <=
// kRowBlock) the products run outside the parallel region and the BLAS may
// use several threads; results are then reproducible run to run at a given
// thread count.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <vector>

#include "common/matmul.h"
#include "cpu/vec_math.h"
#include "flow_euler.h"

namespace fused_ops {
namespace {

// 128 rows: the two hidden activations of a block (2 x 128 x 256 floats,
// 256 KB at the default size) and the weights (396 KB) still fit a 1 MB L2,
// and the products are twice as tall as with 64 rows (half the BLAS calls,
// each repacking the weights; docs/flow_euler.md, variants).
constexpr int64_t kRowBlock = 128;

// h[r, j] = silu(h[r, j] + bias[j]) for r < rows, j < cols (row stride cols).
template <typename T, int B>
FUSED_OPS_INLINE void bias_silu_impl(T* h, const T* bias, int64_t rows, int64_t cols) {
  using V = cpu::Lanes<T, B>;
  constexpr int L = cpu::kLanes<T, B>;
  for (int64_t r = 0; r < rows; ++r) {
    T* row = h + r * cols;
    int64_t j = 0;
    for (; j + L <= cols; j += L) {
      const V z = cpu::load_lanes<V>(row + j) + cpu::load_lanes<V>(bias + j);
      // silu(z) = z / (1 + exp(-z)): exp overflows to inf for z < -88 and the
      // quotient is -0, as in PyTorch.
      cpu::store_lanes(row + j, z / (T(1) + cpu::exp(-z)));
    }
    for (; j < cols; ++j) {
      const T z = row[j] + bias[j];
      row[j] = z / (T(1) + std::exp(-z));
    }
  }
}

// x[r, d] += dt * (v[r, d] + bias[d]).
template <typename T, int B>
FUSED_OPS_INLINE void euler_update_impl(T* x, const T* v, const T* bias, T dt, int64_t rows,
                                        int64_t cols) {
  using V = cpu::Lanes<T, B>;
  constexpr int L = cpu::kLanes<T, B>;
  const int64_t n = rows * cols;
  if (cols % L == 0) {
    for (int64_t i = 0; i < n; i += L) {
      const V vel = cpu::load_lanes<V>(v + i) + cpu::load_lanes<V>(bias + i % cols);
      // Rounded as the reference rounds it: dt * v first, then the sum.
      const V step = vel * dt;
      cpu::store_lanes(x + i, cpu::load_lanes<V>(x + i) + step);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const T step = (v[i] + bias[i % cols]) * dt;
      x[i] = x[i] + step;
    }
  }
}

template <typename T>
void bias_silu_baseline(T* h, const T* bias, int64_t rows, int64_t cols) {
  bias_silu_impl<T, 16>(h, bias, rows, cols);
}
template <typename T>
void euler_update_baseline(T* x, const T* v, const T* bias, T dt, int64_t rows, int64_t cols) {
  euler_update_impl<T, 16>(x, v, bias, dt, rows, cols);
}
#if FUSED_OPS_HAVE_AVX2_CLONE
template <typename T>
FUSED_OPS_TARGET_AVX2 void bias_silu_avx2(T* h, const T* bias, int64_t rows, int64_t cols) {
  bias_silu_impl<T, 32>(h, bias, rows, cols);
}
template <typename T>
FUSED_OPS_TARGET_AVX2 void euler_update_avx2(T* x, const T* v, const T* bias, T dt, int64_t rows,
                                             int64_t cols) {
  euler_update_impl<T, 32>(x, v, bias, dt, rows, cols);
}
#endif

template <typename T>
struct FlowArgs {
  const T *x0, *w1, *b1, *w2, *b2, *w3, *b3;
  T* x;
  int64_t B, D, H, num_steps;
};

// Rows [r0, r1) through all steps.  The products work on views of raw memory
// (no copies); the weight views are the transposes the products need, which
// the BLAS reads in place.
template <typename T>
void run_rows(const FlowArgs<T>& a, int64_t r0, int64_t r1) {
  const int64_t R = r1 - r0, D = a.D, H = a.H;
  std::vector<T> buffer(2 * R * H + R * D + H);
  T* h1 = buffer.data();
  T* h2 = h1 + R * H;
  T* v = h2 + R * H;
  T* c1 = v + R * D;
  T* x = a.x + r0 * D;
  std::copy(a.x0 + r0 * D, a.x0 + r1 * D, x);

  // Layer 1 reads only w1[:, :D] (row stride D + 1): the time column is in c1.
  const LinearNT<T> layer1(x, D, a.w1, D + 1, h1, H, R, H, D);
  const LinearNT<T> layer2(h1, H, a.w2, H, h2, H, R, H, H);
  const LinearNT<T> layer3(h2, H, a.w3, H, v, D, R, D, H);

  auto bias_silu = &bias_silu_baseline<T>;
  auto euler_update = &euler_update_baseline<T>;
#if FUSED_OPS_HAVE_AVX2_CLONE
  if (cpu::cpu_has_avx2()) {
    bias_silu = &bias_silu_avx2<T>;
    euler_update = &euler_update_avx2<T>;
  }
#endif
  const T dt = flow_step_size<T>(a.num_steps);
  for (int64_t k = 0; k < a.num_steps; ++k) {
    const T t = flow_step_time<T>(k, a.num_steps);
    for (int64_t j = 0; j < H; ++j) c1[j] = a.b1[j] + t * a.w1[j * (D + 1) + D];
    layer1.run();
    bias_silu(h1, c1, R, H);
    layer2.run();
    bias_silu(h2, a.b2, R, H);
    layer3.run();
    euler_update(x, v, a.b3, dt, R, D);
  }
}

template <typename T>
void flow_euler_kernel(const FlowArgs<T>& a) {
  const int64_t num_blocks = (a.B + kRowBlock - 1) / kRowBlock;
  if (num_blocks == 1) {
    // One block: let the BLAS thread the products itself.
    run_rows(a, 0, a.B);
    return;
  }
  torch::stable::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) run_rows(a, b * kRowBlock, std::min(a.B, (b + 1) * kRowBlock));
  });
}

}  // namespace

Tensor flow_euler_cpu(const Tensor& x0, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                      const Tensor& b2, const Tensor& w3, const Tensor& b3, int64_t num_steps) {
  FlowEulerCall c(x0, w1, b1, w2, b2, w3, b3, num_steps);
  if (c.B == 0) return c.x;
  dispatch_float(c.x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    flow_euler_kernel<T>({cdata<T>(c.x0), cdata<T>(c.w1),
                          cdata<T>(c.b1), cdata<T>(c.w2),
                          cdata<T>(c.b2), cdata<T>(c.w3),
                          cdata<T>(c.b3), mdata<T>(c.x), c.B, c.D, c.H,
                          c.num_steps});
  });
  return c.x;
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) { m.impl("flow_euler", TORCH_BOX(&flow_euler_cpu)); }

}  // namespace fused_ops
