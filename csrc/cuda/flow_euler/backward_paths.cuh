// \brief fused_ops::flow_euler_backward CUDA paths: the launcher of each
// mode (backward_dispatch.cu holds the table), the sizes of the column-sum
// tiles, and the epilogues both modes apply (so both round the same way).
//
// The step sequence, its math and the memory of each mode are in
// flow_euler_backward.h; docs/flow_euler.md describes the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/flow_euler/paths.cuh"
#include "flow_euler_backward.h"

namespace fused_ops {
namespace flow_euler_backward_paths {

// Column-sum tiles of the streaming kernels: 32 columns (one warp wide,
// coalesced) x 8 row lanes; a block sums kChunkRows rows, so the streaming
// mode keeps P = ceil(B / kChunkRows) partials per column and step.
constexpr int kColTile = 32;
constexpr int64_t kChunkRows = 256;

// The sizes' choice (flow_backward_resident): every step's activations kept.
bool resident_applies(const FlowEulerBackwardCall& c);
void launch_resident(const FlowEulerBackwardCall& c);
void launch_streaming(const FlowEulerBackwardCall& c);  // any sizes
// A call without rows (B == 0): every weight and bias gradient is zero.
void zero_weight_grads(const FlowEulerBackwardCall& c);

}  // namespace flow_euler_backward_paths

namespace {


// Hidden layer, both modes: z = v + (bias[j] + t * w_time[j * ld_w]) (the
// time term if w_time; the combined column offset first, as the CPU kernels
// round it), h = SiLU(z) = z / (1 + exp(-z)) and, if s, SiLU'(z) =
// sig (1 + z (1 - sig)).  s may be the product's own buffer (written after
// the element is read).
template <typename T>
struct ActEpilogue {
  T *h, *s;
  const T *bias, *w_time;
  int64_t ld, ld_w;  // ld: row stride of h and s; w_time column stride (w1's row stride)
  T t;
  __device__ void operator()(int64_t r, int64_t j, T v) const {
    const T c = w_time != nullptr ? bias[j] + t * w_time[j * ld_w] : bias[j];
    const T z = v + c;
    const T den = T(1) + exp(-z);
    h[r * ld + j] = z / den;
    if (s != nullptr) {
      const T sig = T(1) / den;
      s[r * ld + j] = sig * (T(1) + z * (T(1) - sig));
    }
  }
};

template <typename T>
struct UpdateEpilogue {  // x_{k+1} = x_k + dt (v + b3), rounded like the reference (no FMA)
  T* xn;
  const T *x, *b3;
  int64_t D;
  T dt;
  __device__ void operator()(int64_t r, int64_t d, T v) const {
    xn[r * D + d] = euler_step(x[r * D + d], dt, v + b3[d]);
  }
};

}  // namespace
}  // namespace fused_ops
