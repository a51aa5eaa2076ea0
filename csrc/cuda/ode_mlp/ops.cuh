// \brief The elementwise passes of ode_mlp's step sequence on CUDA (the
// `Ops` of csrc/ode_mlp_core.h), each one small kernel on torch's current
// stream: a grid-stride loop over the elements, the step size dt_k read from
// the device grid t (no host synchronisation, so the sequence can be
// captured in a CUDA graph).  Column sums: a block per 32 columns, 8 row
// lanes each summing rows lane, lane + 8, ... in order, then the 8 lane sums
// added in lane order: deterministic.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/primitives/runtime.cuh"
#include "ode_mlp.h"

namespace fused_ops {
namespace ode_cuda {

constexpr int kThreads = 256;
constexpr int kColTile = 32, kRowLanes = 8;

inline unsigned grid_for(int64_t n) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 4)));
}

#define ODE_FOR(x, n) \
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < (n); x += int64_t(gridDim.x) * blockDim.x)

template <typename T>
__global__ void stage_input_kernel(T* Y, const T* y, const T* K, int64_t n, const T* t, int64_t k,
                                   int64_t method, int i) {
  const OdeTableau tab = ode_tableau(method);
  const T h = t[k + 1] - t[k];
  ODE_FOR(x, n) {
    T acc = T(0);
    for (int j = 0; j < i; ++j) {
      if (tab.a[i][j] != 0.0) acc += T(tab.a[i][j]) * K[j * n + x];
    }
    Y[x] = y[x] + h * acc;
  }
}

template <typename T>
__global__ void step_update_kernel(T* y1, const T* y, const T* K, int64_t n, const T* t, int64_t k,
                                   int64_t method) {
  const OdeTableau tab = ode_tableau(method);
  const T h = t[k + 1] - t[k];
  ODE_FOR(x, n) {
    T acc = T(0);
    for (int i = 0; i < tab.stages; ++i) {
      if (tab.b[i] != 0.0) acc += T(tab.b[i]) * K[i * n + x];
    }
    y1[x] = y[x] + h * acc;
  }
}

template <typename T>
__global__ void bias_act_kernel(T* A, T* H, const T* cb, const T* rb, int64_t rows, int64_t cols,
                                int64_t act, T p) {
  ODE_FOR(x, rows * cols) {
    const int64_t j = x % cols;
    const T z = rb ? A[x] + cb[j] + rb[x] : A[x] + cb[j];
    A[x] = z;
    if (H) H[x] = activate(act, p, z);
  }
}

template <typename T>
__global__ void kbar_kernel(T* G, const T* g, const T* Ybar, int64_t n, const T* t, int64_t k,
                            int64_t method, int m) {
  const OdeTableau tab = ode_tableau(method);
  const T h = t[k + 1] - t[k], bm = T(tab.b[m]);
  ODE_FOR(x, n) {
    T acc = bm * g[x];
    for (int i = m + 1; i < tab.stages; ++i) {
      if (tab.a[i][m] != 0.0) acc += T(tab.a[i][m]) * Ybar[i * n + x];
    }
    G[x] = h * acc;
  }
}

template <typename T>
__global__ void act_grad_kernel(T* G, const T* A, int64_t n, int64_t act, T p) {
  ODE_FOR(x, n) G[x] *= activate_grad(act, p, A[x]);
}

template <typename T>
__global__ void add_kernel(T* dst, const T* src, int64_t n) {
  ODE_FOR(x, n) dst[x] += src[x];
}

template <typename T>
__global__ void zero_kernel(T* dst, int64_t n) {
  ODE_FOR(x, n) dst[x] = T(0);
}

template <typename T>
__global__ void combine_kernel(T* g, const T* Ybar, int stages, const T* up, int64_t n) {
  ODE_FOR(x, n) {
    T acc = g[x];
    for (int m = 0; m < stages; ++m) acc += Ybar[m * n + x];
    g[x] = acc + up[x];
  }
}

template <typename T>
__global__ void stage_sum_add_kernel(T* dst, const T* G, int stages, int64_t n) {
  ODE_FOR(x, n) {
    T acc = dst[x];
    for (int m = 0; m < stages; ++m) acc += G[m * n + x];
    dst[x] = acc;
  }
}

template <typename T>
__global__ void colsum_kernel(T* dst, const T* src, int64_t rows, int64_t cols, bool accumulate) {
  __shared__ T part[kRowLanes][kColTile];
  const int64_t j = int64_t(blockIdx.x) * kColTile + threadIdx.x;
  T acc = T(0);
  if (j < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += kRowLanes) acc += src[r * cols + j];
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    T s = part[0][threadIdx.x];
    for (int l = 1; l < kRowLanes; ++l) s += part[l][threadIdx.x];
    dst[j] = accumulate ? dst[j] + s : s;
  }
}

#undef ODE_FOR

template <typename T>
struct OdeCudaOps {
  cudaStream_t stream;

  void stage_input(T* Y, const T* y, const T* K, int64_t n, const T* t, int64_t k, int64_t method,
                   int i) const {
    stage_input_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(Y, y, K, n, t, k, method, i);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void step_update(T* y1, const T* y, const T* K, int64_t n, const T* t, int64_t k,
                   int64_t method) const {
    step_update_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(y1, y, K, n, t, k, method);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void bias_act(T* A, T* H, const T* cb, const T* rb, int64_t rows, int64_t cols, int64_t act,
                T p) const {
    bias_act_kernel<T><<<grid_for(rows * cols), kThreads, 0, stream>>>(A, H, cb, rb, rows, cols, act, p);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void kbar(T* G, const T* g, const T* Ybar, int64_t n, const T* t, int64_t k, int64_t method,
            int m) const {
    kbar_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(G, g, Ybar, n, t, k, method, m);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void act_grad(T* G, const T* A, int64_t n, int64_t act, T p) const {
    act_grad_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(G, A, n, act, p);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void add(T* dst, const T* src, int64_t n) const {
    add_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void colsum(T* dst, const T* src, int64_t rows, int64_t cols, bool accumulate) const {
    const unsigned blocks = unsigned((cols + kColTile - 1) / kColTile);
    colsum_kernel<T><<<blocks, dim3(kColTile, kRowLanes), 0, stream>>>(dst, src, rows, cols, accumulate);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void combine(T* g, const T* Ybar, int stages, const T* up, int64_t n) const {
    combine_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(g, Ybar, stages, up, n);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void stage_sum_add(T* dst, const T* G, int stages, int64_t n) const {
    stage_sum_add_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(dst, G, stages, n);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void copy(T* dst, const T* src, int64_t n) const {
    if (n) FUSED_OPS_CUDA_CHECK(cudaMemcpyAsync(dst, src, sizeof(T) * n, cudaMemcpyDeviceToDevice, stream));
  }
  void zero(T* dst, int64_t n) const {
    if (n) {
      zero_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(dst, n);
      FUSED_OPS_CUDA_LAUNCH_CHECK();
    }
  }
};

}  // namespace ode_cuda
}  // namespace fused_ops
