// \brief Fixed-width SIMD lanes and branch-free exp/log for the CPU kernels.
//
// Lanes<T, B> is a GCC/Clang vector of one B-byte register: 16 bytes (SSE2 /
// NEON, the baseline of every x86-64 and AArch64 CPU) or 32 (AVX2).  Use a
// width the code is compiled for: wider generic vectors are lowered element by
// element for comparisons and selects.  Everything here is force-inlined so a
// caller compiled for AVX2 (see FUSED_OPS_TARGET_AVX2) gets AVX2 code, and no
// out-of-line copy compiled for one ISA can be picked for another.  libm's expf/logf do not
// vectorise, and the ops spend most CPU time in them, so float gets Cephes-style
// polynomial versions (max error 1.4 ulp for exp, 1.3 for log; exp returns 0
// below -87 and inf above 88, where the true result is < 1.6e-38 or > 1.6e38).
// Other types fall back to std::exp/std::log per lane.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

// The vectors never cross a non-inline call, so GCC's note that passing them by
// value would depend on AVX-512 being enabled does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace fused_ops {
namespace cpu {

#define FUSED_OPS_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__)
#define FUSED_OPS_HAVE_AVX2_CLONE 1
#define FUSED_OPS_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define FUSED_OPS_HAVE_AVX2_CLONE 0
#define FUSED_OPS_TARGET_AVX2
#endif

// Whether to run the AVX2 + FMA versions of the kernels: the CPU has them and
// ATEN_CPU_CAPABILITY (torch's own switch) does not ask for "default".
inline bool cpu_has_avx2() {
#if FUSED_OPS_HAVE_AVX2_CLONE
  static const bool has = [] {
    const char* capability = std::getenv("ATEN_CPU_CAPABILITY");
    if (capability && std::strcmp(capability, "default") == 0) return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
#else
  return false;
#endif
}

template <typename T, int B>
struct LanesOf {
  typedef T type __attribute__((vector_size(B)));
};
template <typename T, int B>
using Lanes = typename LanesOf<T, B>::type;
template <typename T, int B>
constexpr int kLanes = B / int(sizeof(T));

// Element type of a Lanes vector (the functions below take the vector type V
// itself as template parameter: T cannot be deduced through the typedef).
template <typename V>
using elem_t = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<V>()[0])>>;

template <typename V>
FUSED_OPS_INLINE V load_lanes(const elem_t<V>* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
FUSED_OPS_INLINE void store_lanes(elem_t<V>* p, const V& v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

// max() that propagates NaN (see common/logsumexp.h), lane-wise.
template <typename V>
FUSED_OPS_INLINE V nan_max(const V& a, const V& b) {
  return (a > b || a != a) ? a : b;
}

template <typename V>
FUSED_OPS_INLINE V exp(const V& x) {
  using T = elem_t<V>;
  constexpr int B = sizeof(V);
  if constexpr (std::is_same_v<T, float>) {
    using I = Lanes<int32_t, B>;
    const V c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    // exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two).
    V n = c * 1.44269504088896341f + 0.5f;
    const V t = __builtin_convertvector(__builtin_convertvector(n, I), V);
    n = t > n ? t - 1.0f : t;  // floor
    const V r = c - n * 0.693359375f + n * 2.12194440e-4f;
    V p = V{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const I bits = (__builtin_convertvector(n, I) + 127) << 23;
    V y = p * (V)bits;
    y = x < -87.0f ? 0.0f : y;
    y = x > 88.0f ? std::numeric_limits<float>::infinity() : y;
    return x != x ? x : y;
  } else {
    V y;
    for (int i = 0; i < kLanes<T, B>; ++i) y[i] = std::exp(x[i]);
    return y;
  }
}

template <typename V>
FUSED_OPS_INLINE V log(const V& x) {
  using T = elem_t<V>;
  constexpr int B = sizeof(V);
  if constexpr (std::is_same_v<T, float>) {
    using I = Lanes<int32_t, B>;
    // x = m 2^e with m in [sqrt(1/2), sqrt(2)); log x = log1p(m - 1) + e ln 2.
    const I bits = (I)x;
    V e = __builtin_convertvector(((bits >> 23) & 0xff) - 126, V);
    V m = (V)((bits & 0x807fffff) | 0x3f000000);  // [0.5, 1)
    const auto small = m < 0.707106781186547524f;
    e = small ? e - 1.0f : e;
    m = small ? m + m - 1.0f : m - 1.0f;
    const V z = m * m;
    V p = V{} + 7.0376836292e-2f;
    p = p * m - 1.1514610310e-1f;
    p = p * m + 1.1676998740e-1f;
    p = p * m - 1.2420140846e-1f;
    p = p * m + 1.4249322787e-1f;
    p = p * m - 1.6668057665e-1f;
    p = p * m + 2.0000714765e-1f;
    p = p * m - 2.4999993993e-1f;
    p = p * m + 3.3333331174e-1f;
    V y = p * m * z + e * -2.12194440e-4f - 0.5f * z;
    y = m + y + e * 0.693359375f;
    constexpr float inf = std::numeric_limits<float>::infinity();
    y = x == 0.0f ? -inf : y;
    y = x == inf ? inf : y;
    return (x < 0.0f || x != x) ? std::numeric_limits<float>::quiet_NaN() : y;
  } else {
    V y;
    for (int i = 0; i < kLanes<T, B>; ++i) y[i] = std::log(x[i]);
    return y;
  }
}

// Transposes the L x L block held in rows[0..L) (L = lanes of V, a power of
// two) in registers: after the call rows[j][i] is the old rows[i][j].  log2(L)
// rounds of pairwise shuffles (Eklundh's algorithm) with compile-time masks,
// which compile to unpack / shuffle / permute instructions instead of L * L
// scalar moves.  Round W pairs rows r and r + W (r & W == 0):
//   new_r[j]     = (j & W) ? R[r + W][j - W] : R[r][j]
//   new_{r+W}[j] = (j & W) ? R[r + W][j]     : R[r][j + W]
// (__builtin_shuffle indexes a as 0..L-1 and b as L..2L-1).
template <typename I, int L, int W, size_t... J>
constexpr I transpose_mask_lo(std::index_sequence<J...>) {
  return I{((int(J) & W) ? L + int(J) - W : int(J))...};
}
template <typename I, int L, int W, size_t... J>
constexpr I transpose_mask_hi(std::index_sequence<J...>) {
  return I{((int(J) & W) ? L + int(J) : int(J) + W)...};
}

template <typename V, int W>
FUSED_OPS_INLINE void transpose_round(V* rows) {
  constexpr int L = int(sizeof(V) / sizeof(elem_t<V>));
  using I = std::conditional_t<sizeof(elem_t<V>) == 4, Lanes<int32_t, sizeof(V)>,
                               Lanes<int64_t, sizeof(V)>>;
  constexpr I lo = transpose_mask_lo<I, L, W>(std::make_index_sequence<L>{});
  constexpr I hi = transpose_mask_hi<I, L, W>(std::make_index_sequence<L>{});
#pragma GCC unroll 8
  for (int r = 0; r < L; ++r) {
    if (r & W) continue;
    const V a = rows[r], b = rows[r + W];
    rows[r] = __builtin_shuffle(a, b, lo);
    rows[r + W] = __builtin_shuffle(a, b, hi);
  }
  if constexpr (W > 1) transpose_round<V, W / 2>(rows);
}

template <typename V>
FUSED_OPS_INLINE void transpose_lanes(V* rows) {
  transpose_round<V, int(sizeof(V) / sizeof(elem_t<V>)) / 2>(rows);
}

// exp(v - max) with v == max giving exactly 1 (see rel_exp in common/logsumexp.h).
template <typename V>
FUSED_OPS_INLINE V rel_exp(const V& v, const V& max) {
  return v == max ? V{} + elem_t<V>(1) : cpu::exp(v - max);
}

}  // namespace cpu
}  // namespace fused_ops
