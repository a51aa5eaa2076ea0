// \brief The elementwise passes of ode_mlp's step sequence on the CPU
// (the `Ops` of csrc/ode_mlp_core.h): plain loops over contiguous buffers,
// each one pass, run on the calling thread (the forward calls them inside its
// parallel region, one row block at a time).  Column sums run over rows in
// a fixed order (64-row chunks, then the chunk sums), so results do not
// depend on the number of threads.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/vec_math.h"
#include "ode_mlp.h"

namespace fused_ops {
namespace cpu {

// h[j] = act(a[j]) for float32 SiLU, ELU, SELU and Sigmoid in 4-lane
// vectors (cpu/vec_math.h's exp, <= 1.4 ulp, instead of libm's per
// element): the same expressions as common/activations.h's activate.  A
// vector holding a value outside [-87, 87] (the polynomial's range), an
// infinity or a NaN is left to the scalar loop, as is the tail; returns
// where the scalar loop resumes (0 for the other activations).  Stops at
// the first such vector: rare (saturated pre-activations).
template <int64_t Code>
inline int64_t activate_lanes(float* h, const float* a, int64_t n, float p) {
  if constexpr (Code != kActSiLU && Code != kActELU && Code != kActSELU && Code != kActSigmoid) {
    return 0;
  } else {
    using V = Lanes<float, 16>;
    constexpr int NL = kLanes<float, 16>;
    int64_t j = 0;
    for (; j + NL <= n; j += NL) {
      const V v = load_lanes<V>(a + j);
      bool in_range = true;
      for (int k = 0; k < NL; ++k) in_range &= v[k] >= -87.0f && v[k] <= 87.0f;
      if (!in_range) break;
      V r;
      if constexpr (Code == kActSiLU) {
        r = v / (1.0f + cpu::exp(V{} - v));
      } else if constexpr (Code == kActSigmoid) {
        r = 1.0f / (1.0f + cpu::exp(V{} - v));
      } else if constexpr (Code == kActELU) {
        r = v > 0.0f ? v : p * (cpu::exp(v) - 1.0f);
      } else {
        r = float(act_detail::kSeluScale) * (v > 0.0f ? v : float(act_detail::kSeluAlpha) * (cpu::exp(v) - 1.0f));
      }
      store_lanes<V>(h + j, r);
    }
    return j;
  }
}

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
        int64_t j = 0;
        if constexpr (std::is_same_v<T, float>) j = activate_lanes<decltype(code)::value>(h, a, cols, p);
        for (; j < cols; ++j) h[j] = activate(code.value, p, a[j]);
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
