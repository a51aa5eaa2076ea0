// \brief fused_ops::flow_euler, general path: any float dtype, any sizes,
// any GPU.
//
// Chosen when no fast path applies (float64, sizes beyond the tiled path's
// shared memory, GPUs older than sm_80) and always correct.  Design: one
// simple kernel per layer and Euler step (3 * num_steps launches), one
// thread per output element, each a sequential dot product in the working
// precision, so the result rounds like a straightforward loop.  Two [B, H]
// hidden buffers are allocated per call; x is updated in place in the
// output.  Correctness first, not speed.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/flow_euler/paths.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

// out[b, j] for one layer, one thread per (b, j):
//   kHidden  out = silu(sum_k in[b, k] W[j, k] + t * w_time[j] + bias[j])  (w_time may be null)
//   kUpdate  out[b, j] = out[b, j] + dt * (sum_k in[b, k] W[j, k] + bias[j])

template <typename T, int MODE>
__global__ void __launch_bounds__(kThreads)
    general_layer_kernel(const T* __restrict__ in, int64_t B, int64_t K, const T* __restrict__ W,
                         int64_t ld_w, const T* __restrict__ w_time, const T* __restrict__ bias,
                         int64_t N, T t, T dt, T* __restrict__ out) {
  const int64_t total = B * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / N, j = i - b * N;
    const T* row = in + b * K;
    const T* w = W + j * ld_w;
    T acc = 0;
    for (int64_t k = 0; k < K; ++k) acc += row[k] * w[k];
    if (MODE == kHidden) {
      if (w_time != nullptr) acc += t * w_time[j * ld_w];
      out[i] = silu(acc + bias[j]);
    } else {
      out[i] = euler_step(out[i], dt, acc + bias[j]);
    }
  }
}

template <typename T>
void general_layers(const FlowEulerCall& c) {
  const int64_t B = c.B, D = c.D, H = c.H;
  const auto stream = cuda::current_stream(cuda::current_device());
  T* x = mdata<T>(c.x);
  const T* w1 = cdata<T>(c.w1);
  Tensor h1 = empty_like_device(c.x, {B, H});
  Tensor h2 = empty_like_device(c.x, {B, H});
  FUSED_OPS_CUDA_CHECK(cudaMemcpyAsync(x, cdata<T>(c.x0), sizeof(T) * B * D, cudaMemcpyDeviceToDevice, stream));
  auto grid = [](int64_t n) { return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 8192)); };
  const T dt = flow_step_size<T>(c.num_steps);
  for (int64_t k = 0; k < c.num_steps; ++k) {
    const T t = flow_step_time<T>(k, c.num_steps);
    general_layer_kernel<T, kHidden><<<grid(B * H), kThreads, 0, stream>>>(
        x, B, D, w1, D + 1, w1 + D, cdata<T>(c.b1), H, t, dt, mdata<T>(h1));
    FUSED_OPS_CUDA_LAUNCH_CHECK();
    general_layer_kernel<T, kHidden><<<grid(B * H), kThreads, 0, stream>>>(
        mdata<T>(h1), B, H, cdata<T>(c.w2), H, nullptr, cdata<T>(c.b2), H, t, dt,
        mdata<T>(h2));
    FUSED_OPS_CUDA_LAUNCH_CHECK();
    general_layer_kernel<T, kUpdate><<<grid(B * D), kThreads, 0, stream>>>(
        mdata<T>(h2), B, H, cdata<T>(c.w3), H, nullptr, cdata<T>(c.b3), D, t, dt, x);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace

namespace flow_euler_paths {

void launch_general(const FlowEulerCall& c) {
  dispatch_float(c.x.scalar_type(), [&](auto zero) { general_layers<decltype(zero)>(c); });
}

}  // namespace flow_euler_paths
}  // namespace fused_ops
