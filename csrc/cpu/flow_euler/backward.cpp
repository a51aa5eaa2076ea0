// CPU implementation of fused_ops::flow_euler_backward (the step sequence and
// the memory cost: flow_euler_backward.h).
//
// Each product is one BLAS call over all B rows (all num_steps * B rows for
// the weight gradients in resident mode; torch's BLAS threads it); between them, fused single-pass epilogues: bias + SiLU + SiLU' of
// the recomputed hidden layers (SIMD exp, AVX2 when available), the Euler
// update of the trajectory, and the gradient scalings/products fused with
// their column sums.  Elementwise passes are split over rows and column sums
// over column blocks with torch::stable::parallel_for; every column is summed
// over its rows in row order by one task, so these passes do not depend on
// the number of threads; the BLAS products may (MKL's AVX-512 kernels split
// long sums by thread count), so the gradients are bitwise repeatable at a
// fixed thread count.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/vec_math.h"
#include "flow_euler_backward.h"

namespace fused_ops {
namespace {

// Rows per elementwise task and columns per column-sum task: large enough
// that a task is worth scheduling, fixed so tasks never depend on threads.
constexpr int64_t kGrainElements = 16384;
constexpr int64_t kColumnBlock = 64;

// z = a[r, j] + t * w_time[j * ld_w] + bias[j] (time term only with w_time);
// h = silu(z) = z / (1 + exp(-z)) (as the forward kernel and PyTorch round it);
// s = silu'(z) = sig (1 + z (1 - sig)), sig = 1 / (1 + exp(-z)), if want_s.
// `c` is the combined per-column offset, computed once per call.
template <typename T, int B>
FUSED_OPS_INLINE void act_rows_impl(const T* a, T* h, T* s, const T* c, int64_t r0, int64_t r1,
                                    int64_t cols, bool want_s) {
  using V = cpu::Lanes<T, B>;
  constexpr int L = cpu::kLanes<T, B>;
  for (int64_t r = r0; r < r1; ++r) {
    const T* ar = a + r * cols;
    T* hr = h + r * cols;
    T* sr = s + r * cols;
    int64_t j = 0;
    for (; j + L <= cols; j += L) {
      const V z = cpu::load_lanes<V>(ar + j) + cpu::load_lanes<V>(c + j);
      const V den = T(1) + cpu::exp(-z);
      cpu::store_lanes(hr + j, z / den);
      if (want_s) {
        const V sig = T(1) / den;
        cpu::store_lanes(sr + j, sig * (T(1) + z * (T(1) - sig)));
      }
    }
    for (; j < cols; ++j) {
      const T z = ar[j] + c[j];
      const T den = T(1) + std::exp(-z);
      hr[j] = z / den;
      if (want_s) {
        const T sig = T(1) / den;
        sr[j] = sig * (T(1) + z * (T(1) - sig));
      }
    }
  }
}

template <typename T>
void act_rows_baseline(const T* a, T* h, T* s, const T* c, int64_t r0, int64_t r1, int64_t cols,
                       bool want_s) {
  act_rows_impl<T, 16>(a, h, s, c, r0, r1, cols, want_s);
}
#if FUSED_OPS_HAVE_AVX2_CLONE
template <typename T>
FUSED_OPS_TARGET_AVX2 void act_rows_avx2(const T* a, T* h, T* s, const T* c, int64_t r0,
                                         int64_t r1, int64_t cols, bool want_s) {
  act_rows_impl<T, 32>(a, h, s, c, r0, r1, cols, want_s);
}
#endif

// parallel_for over [0, n) in tasks of about kGrainElements / per elements.
template <typename F>
void parallel_rows(int64_t n, int64_t per, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(per, 1));
  if (n <= grain) {
    f(int64_t(0), n);
    return;
  }
  torch::stable::parallel_for(0, n, grain, [&](int64_t b, int64_t e) { f(b, e); });
}

// Column blocks of kColumnBlock columns; f(j0, j1) sums its columns over all rows.
template <typename F>
void parallel_columns(int64_t rows, int64_t cols, const F& f) {
  const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) f(b * kColumnBlock, std::min(cols, (b + 1) * kColumnBlock));
  };
  if (blocks == 1 || rows * cols <= kGrainElements) {
    run(0, blocks);
    return;
  }
  torch::stable::parallel_for(0, blocks, 1, run);
}

// Column sums of up to kColumnBlock columns in three levels: rows in chunks
// of kSumChunk, chunk sums in groups of kSumChunk, group sums in row order,
// so the rounding error grows with about 3 * 16 additions at B = 4096
// rather than with B (the CUDA kernels sum in a similar tree).
constexpr int64_t kSumChunk = 16;
template <typename T>
struct ChunkedColumnSums {
  int64_t n;
  T chunk[kColumnBlock] = {};
  T group[kColumnBlock] = {};
  T total[kColumnBlock] = {};
  explicit ChunkedColumnSums(int64_t n_) : n(n_) {}
  void end_row(int64_t r) {
    if ((r + 1) % kSumChunk != 0) return;
    flush_chunk();
    if ((r + 1) % (kSumChunk * kSumChunk) == 0) flush_group();
  }
  void flush_chunk() {
    for (int64_t j = 0; j < n; ++j) group[j] += chunk[j], chunk[j] = T(0);
  }
  void flush_group() {
    for (int64_t j = 0; j < n; ++j) total[j] += group[j], group[j] = T(0);
  }
  void store(T* out) {
    flush_chunk();
    flush_group();
    for (int64_t j = 0; j < n; ++j) out[j] = total[j];
  }
};

template <typename T>
struct CpuOps {
  int64_t B, D, H;
  T* c;  // [H] combined bias of act (scratch)

  void zero_grads(const FlowBackwardArgs<T>& a) const {
    std::fill(a.gw1, a.gw1 + H * (D + 1), T(0));
    std::fill(a.gb1, a.gb1 + H, T(0));
    std::fill(a.gw2, a.gw2 + H * H, T(0));
    std::fill(a.gb2, a.gb2 + H, T(0));
    std::fill(a.gw3, a.gw3 + D * H, T(0));
    std::fill(a.gb3, a.gb3 + D, T(0));
  }

  void copy(T* dst, const T* src, int64_t n) const { std::copy(src, src + n, dst); }

  void act(const T* A, T* Hout, T* S, const T* bias, const T* w_time, int64_t ld_w, T t,
           bool want_s) const {
    for (int64_t j = 0; j < H; ++j) c[j] = w_time ? bias[j] + t * w_time[j * ld_w] : bias[j];
    auto f = &act_rows_baseline<T>;
#if FUSED_OPS_HAVE_AVX2_CLONE
    if (cpu::cpu_has_avx2()) f = &act_rows_avx2<T>;
#endif
    const T* cc = c;
    const int64_t cols = H;
    parallel_rows(B, H, [&](int64_t r0, int64_t r1) { f(A, Hout, S, cc, r0, r1, cols, want_s); });
  }

  void update(T* xn, const T* x, const T* V, const T* b3, T dt) const {
    const int64_t d = D;
    parallel_rows(B, D, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j = 0; j < d; ++j) {
          const T step = (V[r * d + j] + b3[j]) * dt;  // dt * v first, as the reference
          xn[r * d + j] = x[r * d + j] + step;
        }
      }
    });
  }

  void scale_colsum(const T* g_in, const T* gx_add, T* g_out, T* gv, T dt, T* partial) const {
    const int64_t rows = B, cols = D;
    parallel_columns(rows, cols, [&](int64_t j0, int64_t j1) {
      ChunkedColumnSums<T> sums(j1 - j0);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t i = r * cols + j;
          const T g = gx_add ? g_in[i] + gx_add[i] : g_in[i];
          g_out[i] = g;
          const T v = dt * g;
          gv[i] = v;
          sums.chunk[j - j0] += v;
        }
        sums.end_row(r);
      }
      sums.store(partial + j0);
    });
  }

  void mul_colsum(T* gh, const T* s, T* partial) const {
    const int64_t rows = B, cols = H;
    parallel_columns(rows, cols, [&](int64_t j0, int64_t j1) {
      ChunkedColumnSums<T> sums(j1 - j0);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t i = r * cols + j;
          const T g = gh[i] * s[i];
          gh[i] = g;
          sums.chunk[j - j0] += g;
        }
        sums.end_row(r);
      }
      sums.store(partial + j0);
    });
  }

  void accumulate(const FlowBackwardArgs<T>& a, T t) const {
    for (int64_t i = 0; i < D * H; ++i) a.gw3[i] += a.GW3s[i];
    for (int64_t i = 0; i < H * H; ++i) a.gw2[i] += a.GW2s[i];
    for (int64_t j = 0; j < H; ++j) {
      for (int64_t d = 0; d < D; ++d) a.gw1[j * (D + 1) + d] += a.GW1s[j * D + d];
      a.gw1[j * (D + 1) + D] += t * a.P1[j];
      a.gb1[j] += a.P1[j];
      a.gb2[j] += a.P2[j];
    }
    for (int64_t d = 0; d < D; ++d) a.gb3[d] += a.P3[d];
  }

  // Resident mode: the bias gradients and gw1[:, D] from every step's
  // partials, after run_flow_euler_backward (which leaves them to the caller).
  void finalize_biases(const FlowBackwardArgs<T>& a) const {
    const int64_t n = a.num_steps;  // (P = 1 on CPU)
    for (int64_t j = 0; j < H; ++j) {
      T s1 = 0, st1 = 0, s2 = 0;
      for (int64_t k = 0; k < n; ++k) {
        const T p1 = a.P1[k * H + j];
        s1 += p1;
        st1 += flow_step_time<T>(k, n) * p1;
        s2 += a.P2[k * H + j];
      }
      a.gb1[j] = s1;
      a.gw1[j * (D + 1) + D] = st1;
      a.gb2[j] = s2;
    }
    for (int64_t d = 0; d < D; ++d) {
      T s3 = 0;
      for (int64_t k = 0; k < n; ++k) s3 += a.P3[k * D + d];
      a.gb3[d] = s3;
    }
  }

  void finish(const FlowBackwardArgs<T>& a) const {
    for (int64_t i = 0; i < B * D; ++i) a.gx0[i] = a.G[i] + a.GX[i];
  }
};

FlowEulerBackwardCall::Grads flow_euler_backward_cpu(const Tensor& grad_x, const Tensor& x0,
                                                     const Tensor& w1, const Tensor& b1,
                                                     const Tensor& w2, const Tensor& b2,
                                                     const Tensor& w3, const Tensor& b3,
                                                     int64_t num_steps) {
  FlowEulerBackwardCall c(grad_x, x0, w1, b1, w2, b2, w3, b3, num_steps);
  dispatch_float(c.x0.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    FlowBackwardArgs<T> a{};
    if (c.B == 0) {
      // No rows: every gradient is zero (and grad_x0 is empty).
      set_weight_grads(c, a);
      CpuOps<T>{c.B, c.D, c.H, nullptr}.zero_grads(a);
      return;
    }
    Tensor workspace = flow_backward_args<T>(c, 1, a);
    std::vector<T> bias(c.H);
    const CpuOps<T> ops{c.B, c.D, c.H, bias.data()};
    run_flow_euler_backward<T>(a, cpu_device(), ops);
    if (a.resident) ops.finalize_biases(a);
  });
  return c.grads();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("flow_euler_backward", TORCH_BOX(&flow_euler_backward_cpu));
}

}  // namespace fused_ops
