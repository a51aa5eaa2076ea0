// CUDA implementation of fused_ops::flow_euler_backward (the step sequence
// and the memory cost: flow_euler_backward.h).
//
// The matrix products are cuBLAS calls through common/matmul.h (aten::mm.out
// on views of the workspace, torch's current stream).  Between them, small
// kernels on the same stream, all float32 and float64, grid-stride or tiled
// so no launch depends on one thread per element fitting the grid:
//
//   act_kernel          bias (+ t * w1[:, D]) + SiLU, and SiLU' for the backward
//   update_kernel       x_{k+1} = x_k + dt * (v + b3)   (trajectory recompute)
//   colsum_kernel       kScale: g = g_in (+ pending g_x), g_v = dt * g
//                       kMul:   g_a = g_h * silu'(a), in place
//                       fused with the column sums of g_v / g_a over a chunk of
//                       kChunkRows rows per block (partials [P, N], P chunks)
//   accumulate_kernel   streaming mode: weight gradients += this step's products; bias
//                       gradients (and w1's time column) += the partials,
//                       summed over chunks in chunk order
//   finalize_biases_kernel   resident mode: bias gradients (and w1's time
//                       column) from all steps' partials, in step order
//   add_kernel          grad_x0 = g + pending g_x
//
// Resident mode (small problems, flow_euler_backward.h): per step 3 launches
// + 3 products in the trajectory pass and 3 launches + 3 products in the
// adjoint, then 3 products + 1 launch for the weight and bias gradients.
// Streaming: per step 3 + 3 in the trajectory pass, 6 launches + 8 products
// in the adjoint.  No atomics: every sum has a fixed order, so
// results are bitwise reproducible (cuBLAS is deterministic on one device
// and stream).

#include <cuda_runtime.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <climits>
#include <optional>

#include "cuda/runtime.cuh"
#include "flow_euler_backward.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
// Column-sum tiles: 32 columns (one warp wide, coalesced) x 8 row lanes; a
// block sums kChunkRows rows.
constexpr int kColTile = 32;
constexpr int kRowLanes = kThreads / kColTile;
constexpr int64_t kChunkRows = 256;

unsigned grid_for(int64_t n) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 4096)));
}

// z = a + (bias[j] + t * w_time[j * ld_w]) (time term if w_time);  h = z / (1 + exp(-z));
// s = sig * (1 + z * (1 - sig)), sig = 1 / (1 + exp(-z))  (if want_s; s may alias a).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    act_kernel(const T* a, T* __restrict__ h, T* s, const T* __restrict__ bias,
               const T* __restrict__ w_time, int64_t ld_w, T t, int64_t rows, int64_t cols,
               bool want_s) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = i % cols;
    // The combined column offset first, as the CPU kernels round it.
    const T c = w_time != nullptr ? bias[j] + t * w_time[j * ld_w] : bias[j];
    const T z = a[i] + c;
    const T den = T(1) + exp(-z);
    h[i] = z / den;
    if (want_s) {
      const T sig = T(1) / den;
      s[i] = sig * (T(1) + z * (T(1) - sig));
    }
  }
}

__device__ __forceinline__ float euler_step(float x, float dt, float v) {
  return __fadd_rn(x, __fmul_rn(dt, v));
}
__device__ __forceinline__ double euler_step(double x, double dt, double v) {
  return __dadd_rn(x, __dmul_rn(dt, v));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    update_kernel(T* __restrict__ xn, const T* __restrict__ x, const T* __restrict__ v,
                  const T* __restrict__ bias, T dt, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    xn[i] = euler_step(x[i], dt, v[i] + bias[i % cols]);
  }
}

enum ColsumMode { kScale = 0, kMul = 1 };

// Block (kColTile, kRowLanes); grid (P chunks, ceil(cols / kColTile) tiles).
// kScale: g = g_in + add (add may be null), g_out = g, out = dt * g (summed).
// kMul:   out = g_in * add, written to out (= g_in, in place) and summed.
// partial[p * cols + j] = sum over the chunk's rows, in a fixed order: each
// row lane sums its rows in row order, then lane 0 adds the lanes in order.
template <typename T, int MODE>
__global__ void __launch_bounds__(kThreads)
    colsum_kernel(const T* g_in, const T* __restrict__ add, T* g_out, T* out, T dt, int64_t rows,
                  int64_t cols, T* __restrict__ partial) {
  __shared__ T lanes[kRowLanes][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j = int64_t(blockIdx.y) * kColTile + tx;
  const int64_t r0 = int64_t(blockIdx.x) * kChunkRows;
  const int64_t r1 = rows < r0 + kChunkRows ? rows : r0 + kChunkRows;
  T acc = 0;
  if (j < cols) {
    for (int64_t r = r0 + ty; r < r1; r += kRowLanes) {
      const int64_t i = r * cols + j;
      T v;
      if (MODE == kScale) {
        T g = g_in[i];
        if (add != nullptr) g += add[i];
        g_out[i] = g;
        v = dt * g;
      } else {
        v = g_in[i] * add[i];
      }
      out[i] = v;
      acc += v;
    }
  }
  lanes[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && j < cols) {
    T sum = lanes[0][tx];
    for (int l = 1; l < kRowLanes; ++l) sum += lanes[l][tx];
    partial[int64_t(blockIdx.x) * cols + j] = sum;
  }
}

// One thread per accumulator element, grid-stride over the concatenation
// [gw3 (D*H) | gw2 (H*H) | gw1 (H*(D+1)) | gb2 (H) | gb3 (D) | gb1 (H)].
template <typename T>
struct AccumulateArgs {
  T *gw1, *gb1, *gw2, *gb2, *gw3, *gb3;
  const T *GW1s, *GW2s, *GW3s, *P1, *P2, *P3;
  int64_t D, H, P;
  T t;
};

template <typename T>
__device__ __forceinline__ T sum_partials(const T* p, int64_t P, int64_t stride, int64_t j) {
  T s = p[j];
  for (int64_t q = 1; q < P; ++q) s += p[q * stride + j];
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) accumulate_kernel(AccumulateArgs<T> a) {
  const int64_t D = a.D, H = a.H;
  const int64_t n3 = D * H, n2 = H * H, n1 = H * (D + 1);
  const int64_t total = n3 + n2 + n1 + H + D + H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t e = i;
    if (e < n3) {
      a.gw3[e] += a.GW3s[e];
      continue;
    }
    e -= n3;
    if (e < n2) {
      a.gw2[e] += a.GW2s[e];
      continue;
    }
    e -= n2;
    if (e < n1) {
      const int64_t row = e / (D + 1), col = e - row * (D + 1);
      if (col < D) {
        a.gw1[e] += a.GW1s[row * D + col];
      } else {
        a.gw1[e] += a.t * sum_partials(a.P1, a.P, H, row);
      }
      continue;
    }
    e -= n1;
    if (e < H) {
      a.gb2[e] += sum_partials(a.P2, a.P, H, e);
      continue;
    }
    e -= H;
    if (e < D) {
      a.gb3[e] += sum_partials(a.P3, a.P, D, e);
      continue;
    }
    e -= D;
    a.gb1[e] += sum_partials(a.P1, a.P, H, e);
  }
}

// Resident mode: the bias gradients (and w1's time column) from the per-step
// partials [n, P, N], summed over steps, then chunks, in a fixed order.  One
// thread per output over [gb1 (H) | gw1[:, D] (H) | gb2 (H) | gb3 (D)].
template <typename T>
__global__ void __launch_bounds__(kThreads) finalize_biases_kernel(AccumulateArgs<T> a,
                                                                  int64_t num_steps) {
  const int64_t D = a.D, H = a.H, P = a.P;
  const int64_t total = 3 * H + D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const T* part = a.P1;
    int64_t N = H, j = i;
    bool time_column = false;
    if (i < H) {
    } else if (i < 2 * H) {
      j = i - H, time_column = true;
    } else if (i < 3 * H) {
      part = a.P2, j = i - 2 * H;
    } else {
      part = a.P3, j = i - 3 * H, N = D;
    }
    T s = 0;
    for (int64_t k = 0; k < num_steps; ++k) {
      T sk = sum_partials(part + k * P * N, P, N, j);
      if (time_column) sk *= T((double(k) + 0.5) / double(num_steps));  // t_k as the host rounds it
      s += sk;
    }
    if (i < H) {
      a.gb1[j] = s;
    } else if (i < 2 * H) {
      a.gw1[j * (D + 1) + D] = s;
    } else if (i < 3 * H) {
      a.gb2[j] = s;
    } else {
      a.gb3[j] = s;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    add_kernel(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = a[i] + b[i];
  }
}

template <typename T>
struct CudaOps {
  int64_t B, D, H, P;
  cudaStream_t stream;

  void zero_grads(const FlowBackwardArgs<T>& a) const {
    FUSED_OPS_CUDA_CHECK(cudaMemsetAsync(a.gw1, 0, sizeof(T) * H * (D + 1), stream));
    FUSED_OPS_CUDA_CHECK(cudaMemsetAsync(a.gb1, 0, sizeof(T) * H, stream));
    FUSED_OPS_CUDA_CHECK(cudaMemsetAsync(a.gw2, 0, sizeof(T) * H * H, stream));
    FUSED_OPS_CUDA_CHECK(cudaMemsetAsync(a.gb2, 0, sizeof(T) * H, stream));
    FUSED_OPS_CUDA_CHECK(cudaMemsetAsync(a.gw3, 0, sizeof(T) * D * H, stream));
    FUSED_OPS_CUDA_CHECK(cudaMemsetAsync(a.gb3, 0, sizeof(T) * D, stream));
  }

  void copy(T* dst, const T* src, int64_t n) const {
    FUSED_OPS_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, sizeof(T) * n, cudaMemcpyDeviceToDevice, stream));
  }

  void act(const T* A, T* Hout, T* S, const T* bias, const T* w_time, int64_t ld_w, T t,
           bool want_s) const {
    act_kernel<T><<<grid_for(B * H), kThreads, 0, stream>>>(A, Hout, S, bias, w_time, ld_w, t, B,
                                                            H, want_s);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }

  void update(T* xn, const T* x, const T* V, const T* b3, T dt) const {
    update_kernel<T><<<grid_for(B * D), kThreads, 0, stream>>>(xn, x, V, b3, dt, B, D);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }

  dim3 colsum_grid(int64_t cols) const {
    return dim3(unsigned(P), unsigned((cols + kColTile - 1) / kColTile));
  }

  void scale_colsum(const T* g_in, const T* gx_add, T* g_out, T* gv, T dt, T* partial) const {
    colsum_kernel<T, kScale><<<colsum_grid(D), dim3(kColTile, kRowLanes), 0, stream>>>(
        g_in, gx_add, g_out, gv, dt, B, D, partial);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }

  void mul_colsum(T* gh, const T* s, T* partial) const {
    colsum_kernel<T, kMul><<<colsum_grid(H), dim3(kColTile, kRowLanes), 0, stream>>>(
        gh, s, gh, gh, T(0), B, H, partial);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }

  void accumulate(const FlowBackwardArgs<T>& a, T t) const {
    AccumulateArgs<T> k{a.gw1, a.gb1, a.gw2, a.gb2, a.gw3, a.gb3, a.GW1s, a.GW2s,
                        a.GW3s, a.P1, a.P2, a.P3, D, H, P, t};
    const int64_t total = D * H + H * H + H * (D + 1) + H + D + H;
    accumulate_kernel<T><<<grid_for(total), kThreads, 0, stream>>>(k);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }

  void finalize_biases(const FlowBackwardArgs<T>& a) const {
    AccumulateArgs<T> k{a.gw1, a.gb1, a.gw2, a.gb2, a.gw3, a.gb3, nullptr, nullptr,
                        nullptr, a.P1, a.P2, a.P3, D, H, P, T(0)};
    finalize_biases_kernel<T><<<grid_for(3 * H + D), kThreads, 0, stream>>>(k, a.num_steps);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }

  void finish(const FlowBackwardArgs<T>& a) const {
    add_kernel<T><<<grid_for(B * D), kThreads, 0, stream>>>(a.gx0, a.G, a.GX, B * D);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
};

FlowEulerBackwardCall::Grads flow_euler_backward_cuda(const Tensor& grad_x, const Tensor& x0,
                                                      const Tensor& w1, const Tensor& b1,
                                                      const Tensor& w2, const Tensor& b2,
                                                      const Tensor& w3, const Tensor& b3,
                                                      int64_t num_steps) {
  // x0 may be the CPU tensor of a CPU/CUDA mix: the checks then name it.
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  if (x0.is_cuda()) guard.emplace(x0.get_device_index());
  FlowEulerBackwardCall c(grad_x, x0, w1, b1, w2, b2, w3, b3, num_steps);
  FUSED_OPS_CHECK(x0.is_cuda(), "x0 must be a CUDA tensor, got ", device_str(x0));
  const int64_t P = (c.B + kChunkRows - 1) / kChunkRows;
  FUSED_OPS_CHECK(P <= INT_MAX && (std::max(c.D, c.H) + kColTile - 1) / kColTile <= 65535,
                  "flow_euler backward: sizes too large for the CUDA kernels (B=", c.B, ", D=", c.D,
                  ", H=", c.H, ")");
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  dispatch_float(c.x0.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const CudaOps<T> ops{c.B, c.D, c.H, P, stream};
    FlowBackwardArgs<T> a{};
    if (c.B == 0) {
      // No rows: every gradient is zero (and grad_x0 is empty).
      set_weight_grads(c, a);
      ops.zero_grads(a);
      return;
    }
    // The workspace is freed (returned to torch's caching allocator, stream
    // ordered) when this call returns, after all its work was queued.
    Tensor workspace = flow_backward_args<T>(c, P, a);
    run_flow_euler_backward<T>(a, x0.device(), ops);
  });
  return c.grads();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("flow_euler_backward", TORCH_BOX(&flow_euler_backward_cuda));
}

}  // namespace fused_ops
