// \brief ode_mlp's fused CUDA kernel: every step, stage and layer of the
// integration in one launch, for the "shared" and "general" paths.
//
// What: a block of 256 threads owns a tile of kTileRows = 16 rows of the
// batch (grid: ceil(B / 16) blocks) and runs them through all steps and
// stages on its own; rows never interact, so no block waits for another.
// When chosen: "shared" when the tile's working set fits the opt-in shared
// memory (D = 2, H = 512, rk4: 16 * (6 * 2 + 2 * 512) * 4 B = 66 KB), else
// "general" (the same kernel with the working set in a global workspace,
// L1/L2-cached: any width).
// Design:
// - Memory layout of a tile's working set (row-major, rows of the tile):
//   y [R, D] (the state), K [stages, R, D] (the stage velocities), Y [R, D]
//   (the stage input), H [2, R, Hmax] (hidden activations, ping-pong between
//   layers).  Elements: R (D (stages + 2) + 2 Hmax).
// - Launch geometry: each layer's R x H_l outputs are spread over the 256
//   threads (consecutive threads: consecutive output units of one row, so the
//   input row is a broadcast read); each output is one dot product over the
//   layer's input width, weights read from global memory (L1/L2), then the
//   bias (the per-evaluation time_bias row and the per-row sample_bias for
//   the first layer) and the activation; __syncthreads between layers and
//   between the Runge-Kutta combinations.
// - Numerics: the products sum in input order in the working precision
//   (float32 FMA or float64, never TF32); the step is
//   y + dt * sum_i b_i K_i with dt = t[k+1] - t[k] read from device memory,
//   as the CPU kernel computes it (csrc/ode_mlp.h).
#include <cuda_runtime.h>

#include "cuda/ode_mlp/paths.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

constexpr int kTileRows = 16;
constexpr int kBlockThreads = 256;

template <typename T>
struct OdeKernelArgs {
  const T* x0;
  const T* t;
  const T* time_bias;
  const T* sample_bias;
  const T* w[kOdeMaxLayers];
  const T* b[kOdeMaxLayers];
  int width[kOdeMaxLayers];
  int64_t B, S;
  int D, L, Hmax, method, act;
  T act_param;
  T* states;
  bool all_states;
  T* work;  // nullptr: the working set is in shared memory
};

template <typename T>
__host__ __device__ inline int64_t tile_elements(int D, int Hmax, int stages) {
  return int64_t(kTileRows) * (int64_t(D) * (stages + 2) + 2 * int64_t(Hmax));
}

template <typename T>
__global__ void __launch_bounds__(kBlockThreads) ode_mlp_tile_kernel(OdeKernelArgs<T> a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const OdeTableau tab = ode_tableau(a.method);
  const int s = tab.stages, D = a.D, tid = threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.x) * kTileRows;
  const int rows = int(min(int64_t(kTileRows), a.B - r0));
  T* base = a.work ? a.work + int64_t(blockIdx.x) * tile_elements<T>(D, a.Hmax, s)
                   : reinterpret_cast<T*>(smem_raw);
  T* y = base;
  T* K = y + kTileRows * D;
  T* Y = K + s * kTileRows * D;
  T* Hb[2] = {Y + kTileRows * D, Y + kTileRows * D + kTileRows * a.Hmax};
  const int n = rows * D;
  const int64_t BD = a.B * D;
  for (int x = tid; x < n; x += blockDim.x) {
    y[x] = a.x0[r0 * D + x];
    if (a.all_states) a.states[r0 * D + x] = y[x];
  }
  __syncthreads();
  for (int64_t k = 0; k < a.S; ++k) {
    const T dt = a.t[k + 1] - a.t[k];
    for (int i = 0; i < s; ++i) {
      const T* in0 = y;
      if (i > 0) {
        for (int x = tid; x < n; x += blockDim.x) {
          T acc = T(0);
          for (int j = 0; j < i; ++j) {
            if (tab.a[i][j] != 0.0) acc += T(tab.a[i][j]) * K[j * kTileRows * D + x];
          }
          Y[x] = y[x] + dt * acc;
        }
        __syncthreads();
        in0 = Y;
      }
      const int64_t e = k * s + i;
      for (int l = 0; l < a.L; ++l) {
        const int in_w = l ? a.width[l - 1] : D, out_w = a.width[l];
        const bool last = l == a.L - 1;
        const T* src = l ? Hb[(l - 1) & 1] : in0;
        T* dst = last ? K + i * kTileRows * D : Hb[l & 1];
        const T* W = a.w[l];
        const T* cb = l ? a.b[l] : a.time_bias + e * out_w;
        for (int x = tid; x < rows * out_w; x += blockDim.x) {
          const int r = x / out_w, j = x - r * out_w;
          const T* wr = W + int64_t(j) * in_w;
          const T* sr = src + r * in_w;
          T acc = T(0);
          for (int q = 0; q < in_w; ++q) acc += sr[q] * wr[q];
          T z = acc + cb[j];
          if (l == 0 && a.sample_bias) z += a.sample_bias[(r0 + r) * out_w + j];
          dst[x] = last ? z : activate(int64_t(a.act), a.act_param, z);
        }
        __syncthreads();
      }
    }
    T* out = a.all_states ? a.states + (k + 1) * BD + r0 * D : nullptr;
    for (int x = tid; x < n; x += blockDim.x) {
      T acc = T(0);
      for (int i = 0; i < s; ++i) {
        if (tab.b[i] != 0.0) acc += T(tab.b[i]) * K[i * kTileRows * D + x];
      }
      y[x] = y[x] + dt * acc;
      if (out) out[x] = y[x];
    }
    __syncthreads();
  }
  if (!a.all_states) {
    for (int x = tid; x < n; x += blockDim.x) a.states[r0 * D + x] = y[x];
  }
}

template <typename T>
size_t tile_bytes(const OdeMlpCall& c) {
  return size_t(tile_elements<T>(int(c.D), int(c.Hmax), int(c.stages))) * sizeof(T);
}

size_t call_tile_bytes(const OdeMlpCall& c) {
  return dispatch_float(c.x0.scalar_type(), [&](auto zero) { return tile_bytes<decltype(zero)>(c); });
}

template <typename T>
void launch(const OdeMlpCall& c, bool in_shared) {
  OdeKernelArgs<T> a{};
  const OdeMlpPtrs<T> p(c);
  a.x0 = p.x0, a.t = p.t, a.time_bias = p.time_bias, a.sample_bias = p.sample_bias;
  for (int l = 0; l < c.L; ++l) {
    a.w[l] = p.w[l], a.b[l] = p.b[l], a.width[l] = int(c.widths[l]);
  }
  a.B = c.B, a.S = c.S, a.D = int(c.D), a.L = int(c.L), a.Hmax = int(c.Hmax);
  a.method = int(c.method), a.act = int(c.act), a.act_param = T(c.act_param);
  a.states = mdata<T>(c.states), a.all_states = c.all_states;
  const int64_t blocks = (c.B + kTileRows - 1) / kTileRows;
  FUSED_OPS_CHECK(blocks <= INT32_MAX, "ode_mlp: B too large for the CUDA kernel, got ", c.B);
  const size_t bytes = tile_bytes<T>(c);
  Tensor work;
  if (!in_shared) {
    work = empty_like_device(c.x0, {blocks * tile_elements<T>(a.D, a.Hmax, int(c.stages))});
    a.work = mdata<T>(work);
  }
  const size_t smem = in_shared ? bytes : 0;
  cuda::allow_dynamic_smem(ode_mlp_tile_kernel<T>, smem);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  ode_mlp_tile_kernel<T><<<unsigned(blocks), kBlockThreads, smem, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

namespace ode_mlp_paths {

bool shared_applies(const OdeMlpCall& c) {
  return c.D <= INT32_MAX && c.Hmax <= INT32_MAX && call_tile_bytes(c) <= cuda::max_shared_memory_per_block();
}

void launch_shared(const OdeMlpCall& c) {
  dispatch_float(c.x0.scalar_type(), [&](auto zero) { launch<decltype(zero)>(c, true); });
}

void launch_general(const OdeMlpCall& c) {
  FUSED_OPS_CHECK(c.D * kTileRows <= INT32_MAX && c.Hmax * kTileRows <= INT32_MAX,
                  "ode_mlp: widths too large for the CUDA kernel (D=", c.D, ", widest layer ", c.Hmax, ")");
  dispatch_float(c.x0.scalar_type(), [&](auto zero) { launch<decltype(zero)>(c, false); });
}

}  // namespace ode_mlp_paths
}  // namespace fused_ops
