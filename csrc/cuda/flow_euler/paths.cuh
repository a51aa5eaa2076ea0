// \brief fused_ops::flow_euler CUDA paths: the launcher and predicate of
// every path (dispatch.cu holds the table that orders them), and what the
// path files share: the float32 parameter struct, SiLU, the Euler update,
// row staging into shared memory.
//
// Each path file (split.cu, row.cu, cluster.cu, wgmma.cu, tiled.cu,
// general.cu) defines `<path>_applies` (the complete condition under which
// its launcher is correct: a forced path runs whenever it holds; the
// general path always applies) and `launch_<path>` in namespace
// fused_ops::flow_euler_paths; its kernels live in fused_ops' anonymous
// namespace.  docs/flow_euler.md describes every path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/primitives/reductions.cuh"
#include "flow_euler.h"

namespace fused_ops {
namespace flow_euler_paths {

bool split_applies(const FlowEulerCall& c);
void launch_split(const FlowEulerCall& c);
bool row_applies(const FlowEulerCall& c);
void launch_row(const FlowEulerCall& c);
bool cluster_applies(const FlowEulerCall& c);
void launch_cluster(const FlowEulerCall& c);
bool wgmma_applies(const FlowEulerCall& c);
void launch_wgmma(const FlowEulerCall& c);
bool tiled_applies(const FlowEulerCall& c);
void launch_tiled(const FlowEulerCall& c);
void launch_general(const FlowEulerCall& c);  // float32 and float64, any sizes

}  // namespace flow_euler_paths

namespace {

using cuda::kFullMask;
using cuda::kWarpSize;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;

// The sizes the row, split and wgmma kernels are written for (the default
// model: D = 64 features, H = 256 hidden units).
constexpr int kRowD = 64, kRowH = 256;

template <typename T>
__device__ __forceinline__ T silu(T z) {
  // z / (1 + exp(-z)): exp overflows to inf for very negative z and the
  // quotient is -0, as PyTorch's SiLU gives.
  return z / (T(1) + exp(-z));
}

// silu with the hardware's exponential and division (MUFU.EX2, MUFU.RCP):
// __expf's documented error is 2 + 1.16 |z| ulp (so ~1.5e-6 relative at
// |z| = 20, a few ulp for the usual |z| < 4), __fdividef's 2 ulp, against
// ~1 ulp for silu(), at a third of the instructions.  Only in the wgmma
// kernel, whose epilogues (SiLU of 64 values per thread per step) sit
// between its products on every step's critical path; its error against
// float64 stays that of eager PyTorch (docs/flow_euler.md, Numerics).
// -inf..inf map as silu() maps them (exp overflows to inf, the quotient is
// -0).
[[maybe_unused]] __device__ __forceinline__ float silu_fast(float z) { return __fdividef(z, 1.0f + __expf(-z)); }

// x + dt * v rounded like the reference (dt * v first, no fused multiply-add).
__device__ __forceinline__ float euler_step(float x, float dt, float v) {
  return __fadd_rn(x, __fmul_rn(dt, v));
}
__device__ __forceinline__ double euler_step(double x, double dt, double v) {
  return __dadd_rn(x, __dmul_rn(dt, v));
}

// dst[r, k] (row stride ld, total_rows rows) = src[r, k] (row stride src_ld)
// for r < nrows and k < ncols, else 0; all threads of the block cooperate.
// Eight loads in flight per thread: the one-off staging of a persistent
// kernel is otherwise a chain of dependent L2 round trips.
[[maybe_unused]] __device__ __forceinline__ void stage_rows(float* dst, int total_rows, int ld, const float* src,
                                                            int64_t src_ld, int nrows, int ncols) {
  constexpr int kUnroll = 8;
  const int n = total_rows * ld;
  for (int base = 0; base < n; base += kThreads * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + int(threadIdx.x);
      const int r = i / ld, k = i - r * ld;
      v[u] = (i < n && r < nrows && k < ncols) ? src[r * src_ld + k] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + int(threadIdx.x);
      if (i < n) dst[i] = v[u];
    }
  }
}

// What a layer's epilogue does with its sums:
//   kHidden  out = silu(sum + t * w_time[j] + bias[j])  (w_time may be null)
//   kUpdate  x[b, j] = x[b, j] + dt * (sum + bias[j])
enum LayerMode { kHidden = 0, kUpdate = 1 };

// What every float32 fast path reads: the op's tensors as raw pointers, the
// sizes as int (the paths apply only where they fit) and the step size.
struct FlowParams {
  const float *x0, *w1, *b1, *w2, *b2, *w3, *b3;
  float* x;
  int B, D, H, num_steps;
  float dt;
};

inline FlowParams flow_params(const FlowEulerCall& c) {
  FlowParams p{};
  p.x0 = cdata<float>(c.x0);
  p.w1 = cdata<float>(c.w1);
  p.b1 = cdata<float>(c.b1);
  p.w2 = cdata<float>(c.w2);
  p.b2 = cdata<float>(c.b2);
  p.w3 = cdata<float>(c.w3);
  p.b3 = cdata<float>(c.b3);
  p.x = mdata<float>(c.x);
  p.B = int(c.B), p.D = int(c.D), p.H = int(c.H), p.num_steps = int(c.num_steps);
  p.dt = flow_step_size<float>(c.num_steps);
  return p;
}

inline int round_up(int v, int m) { return (v + m - 1) / m * m; }

// float32 at exactly the default D and H: the sizes the row, split and
// wgmma kernels are written for.
inline bool row_sizes(const FlowEulerCall& c) {
  return c.x.scalar_type() == ScalarType::Float && c.D == kRowD && c.H == kRowH;
}

}  // namespace
}  // namespace fused_ops
