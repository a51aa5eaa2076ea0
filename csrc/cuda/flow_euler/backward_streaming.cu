// \brief fused_ops::flow_euler_backward, streaming path: the shared step
// sequence of flow_euler_backward.h with cuBLAS products and small kernels,
// for problems too large to keep every step's activations.
//
// Chosen when the resident path does not apply (num_steps * B > 512 stacked
// rows, or 6 num_steps B H > 4 Mi elements); correct for any sizes, float32
// and float64.  Only the trajectory x_1 .. x_{n-1} is kept; each reverse
// step recomputes its hidden layers from x_k.  The matrix products are
// cuBLAS calls through common/matmul.h (aten::mm.out on views of the
// workspace, torch's current stream); between them small kernels on the
// same stream, grid-stride or tiled so no launch depends on one thread per
// element fitting the grid:
//
//   ActEpilogue         bias (+ t * w1[:, D]) + SiLU, and SiLU' for the backward
//   UpdateEpilogue      x_{k+1} = x_k + dt * (v + b3)   (trajectory recompute)
//                       (both applied after cuBLAS by cuda::apply_epilogue;
//                       the resident kernel applies them in its tile epilogues)
//   colsum_kernel       kScale: g = g_in (+ pending g_x), g_v = dt * g
//                       kMul:   g_a = g_h * silu'(a), in place
//                       fused with the column sums of g_v / g_a over a chunk of
//                       kChunkRows rows per block (partials [P, N], P chunks)
//   accumulate_kernel   weight gradients += this step's products; bias
//                       gradients (and w1's time column) += the partials,
//                       summed over chunks in chunk order
//   add_kernel          grad_x0 = g + pending g_x
//
// Per step 3 + 3 launches in the trajectory pass, 6 launches + 8 products
// in the adjoint.  No atomics: every sum has a fixed order, so results are
// bitwise reproducible (cuBLAS is deterministic on one device and stream).
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/flow_euler/backward_paths.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/tile_gemm.cuh"
#include "flow_euler_backward.h"

namespace fused_ops {
namespace {

using flow_euler_backward_paths::kChunkRows;
using flow_euler_backward_paths::kColTile;
constexpr int kRowLanes = kThreads / kColTile;

unsigned grid_for(int64_t n) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 4096)));
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
    cuda::apply_epilogue(stream, A, H, B, H,
                         ActEpilogue<T>{Hout, want_s ? S : nullptr, bias, w_time, H, ld_w, t});
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }

  void update(T* xn, const T* x, const T* V, const T* b3, T dt) const {
    cuda::apply_epilogue(stream, V, D, B, D, UpdateEpilogue<T>{xn, x, b3, D, dt});
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

  void finish(const FlowBackwardArgs<T>& a) const {
    add_kernel<T><<<grid_for(B * D), kThreads, 0, stream>>>(a.gx0, a.G, a.GX, B * D);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
};


}  // namespace

namespace flow_euler_backward_paths {

void launch_streaming(const FlowEulerBackwardCall& c) {
  const int64_t P = (c.B + kChunkRows - 1) / kChunkRows;
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  dispatch_float(c.x0.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const CudaOps<T> ops{c.B, c.D, c.H, P, stream};
    FlowBackwardArgs<T> a{};
    // The workspace is freed (returned to torch's caching allocator, stream
    // ordered) when this call returns, after all its work was queued.
    Tensor workspace = flow_backward_args<T>(c, P, a, false);
    run_flow_euler_backward<T>(a, c.x0.device(), ops);
  });
}

void zero_weight_grads(const FlowEulerBackwardCall& c) {
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  dispatch_float(c.x0.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const CudaOps<T> ops{c.B, c.D, c.H, 0, stream};
    FlowBackwardArgs<T> a{};
    set_weight_grads(c, a);
    ops.zero_grads(a);
  });
}

}  // namespace flow_euler_backward_paths
}  // namespace fused_ops
