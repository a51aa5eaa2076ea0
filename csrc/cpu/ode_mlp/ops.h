// \brief The elementwise passes of ode_mlp's step sequence on the CPU
// (the `Ops` of csrc/ode_mlp_core.h): plain loops over contiguous buffers,
// each one pass, run on the calling thread (the forward calls them inside its
// parallel region, one row block at a time).  Column sums run over rows in
// a fixed order (64-row chunks, then the chunk sums), so results do not
// depend on the number of threads.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "ode_mlp.h"

namespace fused_ops {
namespace cpu {

template <typename T>
struct OdeCpuOps {
  static T dt(const T* t, int64_t k) { return t[k + 1] - t[k]; }

  void stage_input(T* Y, const T* y, const T* K, int64_t n, const T* t, int64_t k, int64_t method,
                   int i) const {
    const OdeTableau tab = ode_tableau(method);
    const T h = dt(t, k);
    T a[kOdeMaxStages];
    for (int j = 0; j < i; ++j) a[j] = T(tab.a[i][j]);
    for (int64_t x = 0; x < n; ++x) {
      T acc = T(0);
      for (int j = 0; j < i; ++j) {
        if (tab.a[i][j] != 0.0) acc += a[j] * K[j * n + x];
      }
      Y[x] = y[x] + h * acc;
    }
  }

  void step_update(T* y1, const T* y, const T* K, int64_t n, const T* t, int64_t k,
                   int64_t method) const {
    const OdeTableau tab = ode_tableau(method);
    const T h = dt(t, k);
    for (int64_t x = 0; x < n; ++x) {
      T acc = T(0);
      for (int i = 0; i < tab.stages; ++i) {
        if (tab.b[i] != 0.0) acc += T(tab.b[i]) * K[i * n + x];
      }
      y1[x] = y[x] + h * acc;
    }
  }

  void bias_act(T* A, T* H, const T* cb, const T* rb, int64_t rows, int64_t cols, int64_t act,
                T p) const {
    // The activation a constant and the row bias hoisted out of the element
    // loops, so that they vectorise where the activation allows.
    with_activation(act, [&](auto code) {
      for (int64_t r = 0; r < rows; ++r) {
        T* a = A + r * cols;
        if (rb) {
          const T* rr = rb + r * cols;
          for (int64_t j = 0; j < cols; ++j) a[j] = a[j] + cb[j] + rr[j];
        } else {
          for (int64_t j = 0; j < cols; ++j) a[j] = a[j] + cb[j];
        }
        if (!H) continue;
        T* h = H + r * cols;
        for (int64_t j = 0; j < cols; ++j) h[j] = activate(code.value, p, a[j]);
      }
    });
  }

  void kbar(T* G, const T* g, const T* Ybar, int64_t n, const T* t, int64_t k, int64_t method,
            int m) const {
    const OdeTableau tab = ode_tableau(method);
    const T h = dt(t, k), bm = T(tab.b[m]);
    for (int64_t x = 0; x < n; ++x) {
      T acc = bm * g[x];
      for (int i = m + 1; i < tab.stages; ++i) {
        if (tab.a[i][m] != 0.0) acc += T(tab.a[i][m]) * Ybar[i * n + x];
      }
      G[x] = h * acc;
    }
  }

  void act_grad(T* G, const T* A, int64_t n, int64_t act, T p) const {
    with_activation(act, [&](auto code) {
      for (int64_t x = 0; x < n; ++x) G[x] *= activate_grad(code.value, p, A[x]);
    });
  }

  void add(T* dst, const T* src, int64_t n) const {
    for (int64_t x = 0; x < n; ++x) dst[x] += src[x];
  }

  // Two levels, chunks of 64 rows summed in order and then the chunk sums in
  // order: rounding error ~(64 + rows / 64) ulps rather than ~rows.
  void colsum(T* dst, const T* src, int64_t rows, int64_t cols, bool accumulate) const {
    if (!accumulate) zero(dst, cols);
    std::vector<T> part(static_cast<size_t>(cols));
    for (int64_t r0 = 0; r0 < rows; r0 += 64) {
      std::fill(part.begin(), part.end(), T(0));
      for (int64_t r = r0; r < std::min(rows, r0 + 64); ++r) {
        for (int64_t j = 0; j < cols; ++j) part[j] += src[r * cols + j];
      }
      for (int64_t j = 0; j < cols; ++j) dst[j] += part[j];
    }
  }

  void combine(T* g, const T* Ybar, int stages, const T* up, int64_t n) const {
    for (int64_t x = 0; x < n; ++x) {
      T acc = g[x];
      for (int m = 0; m < stages; ++m) acc += Ybar[m * n + x];
      g[x] = acc + up[x];
    }
  }

  void stage_sum_add(T* dst, const T* G, int stages, int64_t n) const {
    for (int64_t x = 0; x < n; ++x) {
      T acc = dst[x];
      for (int m = 0; m < stages; ++m) acc += G[m * n + x];
      dst[x] = acc;
    }
  }

  void copy(T* dst, const T* src, int64_t n) const {
    if (n) std::memcpy(dst, src, size_t(n) * sizeof(T));
  }
  void zero(T* dst, int64_t n) const {
    for (int64_t x = 0; x < n; ++x) dst[x] = T(0);
  }
};

}  // namespace cpu
}  // namespace fused_ops
