// \brief ode_mlp's fused CUDA kernel: every step, stage and layer of the
// integration in one launch, for the "shared" and "general" paths.
//
// What: a block of 256 threads owns a tile of kTileRows = 16 rows of the
// batch and runs them through all steps and stages on its own, then takes the
// next tile (grid: ceil(B / 16) blocks on the shared path, at most 4 per SM
// on the general path, whose workspace is a tile's working set per block);
// rows never interact, so no block waits for another.
// When chosen: "shared" when the tile's working set fits the opt-in shared
// memory (D = 2, H = 512, rk4: 16 * (6 * 2 + 2 * 512) * 4 B = 66 KB), else
// "general" (the same kernel with the working set in a global workspace,
// L1/L2-cached: any width).
// Design:
// - Memory layout of a tile's working set (row-major, rows of the tile):
//   y [R, D] (the state), K [stages, R, D] (the stage velocities), Y [R, D]
//   (the stage input), H [2, R, Hmax] (hidden activations, ping-pong between
//   layers).  Elements: R (D (stages + 2) + 2 Hmax).
// - Launch geometry: each of the 8 warps computes one output unit j of a
//   layer for all 16 rows at a time (units j = warp, warp + 8, ...): its
//   lanes read row j of the weight coalesced from global memory (L1/L2),
//   once per tile, and keep 16 partial sums (one per row) in registers; a
//   butterfly reduction per row, then lane r adds the bias (the
//   per-evaluation time_bias row and, first layer, the row's sample_bias) and
//   applies the activation for row r.  __syncthreads between layers and
//   between the Runge-Kutta combinations.
// - Numerics: each dot product is 32 lane-strided partial sums added by a
//   fixed butterfly, in the working precision (float32 FMA or float64, never
//   TF32): deterministic; the step is
//   y + dt * sum_i b_i K_i with dt = t[k+1] - t[k] read from device memory,
//   as the CPU kernel computes it (csrc/ode_mlp.h).
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/ode_mlp/paths.cuh"
#include "cuda/primitives/reductions.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

constexpr int kTileRows = 16;
constexpr int kBlockThreads = 256;
constexpr int kGeneralBlocksPerSM = 4;

template <typename T>
struct OdeKernelArgs {
  const T* x0;
  const T* t;
  const T* time_bias;
  const T* sample_bias;
  const T* w[kOdeMaxLayers];
  const T* b[kOdeMaxLayers];
  int width[kOdeMaxLayers];
  int64_t B, S, tiles;
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
  const int warp = tid / 32, lane = tid % 32, nwarps = blockDim.x / 32;
  T* base = a.work ? a.work + int64_t(blockIdx.x) * tile_elements<T>(D, a.Hmax, s)
                   : reinterpret_cast<T*>(smem_raw);
  T* y = base;
  T* K = y + kTileRows * D;
  T* Y = K + s * kTileRows * D;
  T* Hb[2] = {Y + kTileRows * D, Y + kTileRows * D + kTileRows * a.Hmax};
  const int64_t BD = a.B * D;
  for (int64_t tile = blockIdx.x; tile < a.tiles; tile += gridDim.x) {
    const int64_t r0 = tile * kTileRows;
    const int rows = int(min(int64_t(kTileRows), a.B - r0));
    const int n = rows * D;
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
          // A warp per output unit j: the lanes split the input width (coalesced
          // reads of W's row j, read once for the whole tile), each lane keeps
          // a partial sum per tile row, then a butterfly reduction; lane r
          // finishes row r.
          for (int j = warp; j < out_w; j += nwarps) {
            const T* wr = W + int64_t(j) * in_w;
            T acc[kTileRows];
  #pragma unroll
            for (int r = 0; r < kTileRows; ++r) acc[r] = T(0);
            for (int q = lane; q < in_w; q += 32) {
              const T wq = wr[q];
  #pragma unroll
              for (int r = 0; r < kTileRows; ++r) {
                if (r < rows) acc[r] += src[r * in_w + q] * wq;
              }
            }
            T mine = T(0);
  #pragma unroll
            for (int r = 0; r < kTileRows; ++r) {
              const T v = cuda::group_allreduce(acc[r], 32);
              if (lane == r) mine = v;
            }
            if (lane < rows) {
              T z = mine + cb[j];
              if (l == 0 && a.sample_bias) z += a.sample_bias[(r0 + lane) * out_w + j];
              dst[lane * out_w + j] = last ? z : activate(int64_t(a.act), a.act_param, z);
            }
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
    __syncthreads();  // the next tile overwrites y
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
  a.tiles = (c.B + kTileRows - 1) / kTileRows;
  // Shared: a block per tile.  General: at most kGeneralBlocksPerSM blocks
  // per SM, each looping over tiles, so the workspace stays bounded.
  const int sms = cuda::multiprocessor_count(cuda::current_device());
  const int64_t blocks = std::min<int64_t>(a.tiles, in_shared ? int64_t(INT32_MAX) : int64_t(kGeneralBlocksPerSM) * sms);
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
