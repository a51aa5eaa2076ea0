// CUDA implementation of fused_ops::flow_euler_backward (the step sequence
// and the memory cost: flow_euler_backward.h).
//
// Resident mode (small problems, flow_euler_backward.h; the default B=8,
// 32 steps): ONE cooperative launch, flow_backward_resident_kernel below,
// that runs the trajectory, the adjoint and the weight gradients as 6 n + 1
// grid-synchronised phases of 32 x 32 product tiles (cuda/tile_gemm.cuh).
// The shared step sequence took ~12 host calls per Euler step there (cuBLAS
// products through the dispatcher and small kernels) and was host-bound.
//
// Streaming mode (large batches): the shared step sequence, its matrix
// products as cuBLAS calls through common/matmul.h (aten::mm.out on views of
// the workspace, torch's current stream), between them small kernels on the
// same stream, all float32 and float64, grid-stride or tiled so no launch
// depends on one thread per element fitting the grid:
//
//   ActEpilogue         bias (+ t * w1[:, D]) + SiLU, and SiLU' for the backward
//   UpdateEpilogue      x_{k+1} = x_k + dt * (v + b3)   (trajectory recompute)
//                       (both applied after cuBLAS by cuda::apply_epilogue, and
//                       in the resident kernel's tile epilogues)
//   colsum_kernel       kScale: g = g_in (+ pending g_x), g_v = dt * g
//                       kMul:   g_a = g_h * silu'(a), in place
//                       fused with the column sums of g_v / g_a over a chunk of
//                       kChunkRows rows per block (partials [P, N], P chunks)
//   accumulate_kernel   weight gradients += this step's products; bias
//                       gradients (and w1's time column) += the partials,
//                       summed over chunks in chunk order
//   add_kernel          grad_x0 = g + pending g_x
//
// per step 3 + 3 in the trajectory pass, 6 launches + 8 products in the
// adjoint.  No atomics in either mode: every sum has a fixed order, so
// results are bitwise reproducible (cuBLAS is deterministic on one device
// and stream).

#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <climits>

#include "cuda/primitives/cooperative.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/tile_gemm.cuh"
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

__device__ __forceinline__ float euler_step(float x, float dt, float v) {
  return __fadd_rn(x, __fmul_rn(dt, v));
}
__device__ __forceinline__ double euler_step(double x, double dt, double v) {
  return __dadd_rn(x, __dmul_rn(dt, v));
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

// ---------------------------------------------------------------------------
// resident mode: one cooperative launch
// ---------------------------------------------------------------------------
//
// The resident step sequence of flow_euler_backward.h as 6 n + 1 phases of
// one persistent kernel, grid barriers between them (cuda/tile_gemm.cuh):
//   0        traj[0] = x0;  G = grad_x, GV[n-1] = dt G
//   forward, k = 0 .. n-1:
//     F1     S1 = x_k w1[:, :D]^T -> act (bias + t_k w1[:, D], SiLU, SiLU') -> H1[k], S1[k]
//     F2     S2 = H1[k] w2^T      -> act (b2)                                -> H2[k], S2[k]
//     F3     (k < n-1) x_{k+1} = x_k + dt (H2[k] w3^T + b3)
//   reverse, k = n-1 .. 0:
//     R1     GA2[k] = (GV[k] w3) * S2[k]
//     R2     GA1[k] = (GA2[k] w2) * S1[k]
//     R3     g = G + GA1[k] w1[:, :D];  k > 0: G = g, GV[k-1] = dt g;  k = 0: grad_x0 = g
//   last     gw3 = GV^T H2, gw2 = GA2^T H1, gw1[:, :D] = GA1^T X over all n B rows;
//            gb3, gb2, gb1 and gw1[:, D] = sum_k t_k colsum(GA1[k]) as column sums
// The elementwise arithmetic is the streaming mode's (the same ActEpilogue
// and UpdateEpilogue, colsum_kernel's g = g_in + add, dt * g), so
// both modes round the same way; only the sums' order differs (tiles sum k
// in order, column sums in double).  At B = 8 every phase is a handful of
// tiles: the step is bound by the barriers and the products' latency, not
// by the FLOPs, and it no longer pays ~12 host calls per Euler step.

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

template <typename T>
struct MulEpilogue {  // out = v * s (ReLU/SiLU-style backward through a saved derivative)
  T* out;
  const T* s;
  int64_t ld;
  __device__ void operator()(int64_t r, int64_t j, T v) const { out[r * ld + j] = v * s[r * ld + j]; }
};

template <typename T>
struct AdjointEpilogue {  // g = G + v, as colsum_kernel<kScale> adds the pending g_x
  T *G, *GV_prev, *gx0;  // GV_prev: the next (earlier) step's GV, nullptr at k = 0
  int64_t D;
  T dt;
  __device__ void operator()(int64_t r, int64_t d, T v) const {
    const T g = G[r * D + d] + v;
    if (GV_prev != nullptr) {
      G[r * D + d] = g;
      GV_prev[r * D + d] = dt * g;
    } else {
      gx0[r * D + d] = g;
    }
  }
};

// Row weight of w1's time column over the n B stacked rows: t_{r / B}, as
// the host rounds it.
template <typename T>
struct StepTimeWeight {
  int64_t B, num_steps;
  __device__ double operator()(int64_t r) const { return double(flow_step_time<T>(r / B, num_steps)); }
};

template <typename T>
__global__ void __launch_bounds__(cuda::kTileThreads)
    flow_backward_resident_kernel(const FlowBackwardArgs<T> a) {
  using cuda::ColumnSumJob;
  using cuda::gemm_job;
  using cuda::run_phase;
  using V = cuda::MatView<T>;
  const auto [smem, grid, tid, nthreads] = cuda::phase_context<T>();
  const int64_t B = a.B, D = a.D, H = a.H, n = a.num_steps, BD = B * D, BH = B * H;
  const T dt = flow_step_size<T>(n);

  for (int64_t i = tid; i < BD; i += nthreads) {
    a.traj[i] = a.x0[i];
    const T g = a.grad_x[i];
    a.G[i] = g;
    a.GV[(n - 1) * BD + i] = dt * g;
  }
  grid.sync();

  for (int64_t k = 0; k < n; ++k) {
    const T t = flow_step_time<T>(k, n);
    const T* x = a.traj + k * BD;
    run_phase(smem, gemm_job(V{x, D, 1}, V{a.w1, 1, D + 1}, B, H, D,
                             ActEpilogue<T>{a.H1 + k * BH, a.S1 + k * BH, a.b1, a.w1 + D, H, D + 1, t}));
    grid.sync();
    run_phase(smem, gemm_job(V{a.H1 + k * BH, H, 1}, V{a.w2, 1, H}, B, H, H,
                             ActEpilogue<T>{a.H2 + k * BH, a.S2 + k * BH, a.b2, nullptr, H, 0, t}));
    grid.sync();
    if (k + 1 < n) {
      run_phase(smem, gemm_job(V{a.H2 + k * BH, H, 1}, V{a.w3, 1, H}, B, D, H,
                               UpdateEpilogue<T>{a.traj + (k + 1) * BD, x, a.b3, D, dt}));
      grid.sync();
    }
  }

  for (int64_t k = n - 1; k >= 0; --k) {
    run_phase(smem, gemm_job(V{a.GV + k * BD, D, 1}, V{a.w3, H, 1}, B, H, D,
                             MulEpilogue<T>{a.GA2 + k * BH, a.S2 + k * BH, H}));
    grid.sync();
    run_phase(smem, gemm_job(V{a.GA2 + k * BH, H, 1}, V{a.w2, H, 1}, B, H, H,
                             MulEpilogue<T>{a.GA1 + k * BH, a.S1 + k * BH, H}));
    grid.sync();
    run_phase(smem, gemm_job(V{a.GA1 + k * BH, H, 1}, V{a.w1, D + 1, 1}, B, D, H,
                             AdjointEpilogue<T>{a.G, k > 0 ? a.GV + (k - 1) * BD : nullptr, a.gx0, D, dt}));
    grid.sync();
  }

  const int64_t R = n * B;
  run_phase(smem, gemm_job(V{a.GV, 1, D}, V{a.H2, H, 1}, D, H, R, cuda::StoreEpilogue<T>{a.gw3, H}),
            gemm_job(V{a.GA2, 1, H}, V{a.H1, H, 1}, H, H, R, cuda::StoreEpilogue<T>{a.gw2, H}),
            gemm_job(V{a.GA1, 1, H}, V{a.traj, D, 1}, H, D, R, cuda::StoreEpilogue<T>{a.gw1, D + 1}),
            ColumnSumJob<T>{a.GV, D, D, R, a.gb3}, ColumnSumJob<T>{a.GA2, H, H, R, a.gb2},
            ColumnSumJob<T>{a.GA1, H, H, R, a.gb1},
            cuda::ColumnSumJob<T, StepTimeWeight<T>>{a.GA1, H, H, R, a.gw1 + D, D + 1, {B, n}});
}

template <typename T>
void flow_backward_resident_launch(const FlowBackwardArgs<T>& a) {
  using cuda::tile_count;
  auto strips = [](int64_t c) { return (c + cuda::kTile - 1) / cuda::kTile; };
  const int64_t B = a.B, D = a.D, H = a.H;
  // Units of the busiest phase (the last one, unless B is large).
  const int64_t units = std::max({tile_count(B, H), tile_count(B, D),
                                  tile_count(D, H) + tile_count(H, H) + tile_count(H, D) +
                                      strips(D) + 3 * strips(H)});
  auto kernel = flow_backward_resident_kernel<T>;
  const int64_t sms = cuda::multiprocessor_count(cuda::current_device());
  int64_t grid = std::min(cuda::max_resident_blocks(kernel, cuda::kTileThreads, 0), sms);
  grid = std::max<int64_t>(1, std::min(grid, units));
  FlowBackwardArgs<T> args = a;
  cuda::launch_cooperative(kernel, grid, cuda::kTileThreads, 0, args);
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

FlowEulerBackwardCall::Grads flow_euler_backward_cuda(const Tensor& grad_x, const Tensor& x0,
                                                      const Tensor& w1, const Tensor& b1,
                                                      const Tensor& w2, const Tensor& b2,
                                                      const Tensor& w3, const Tensor& b3,
                                                      int64_t num_steps) {
  const cuda::TensorDeviceGuard guard(x0);
  FlowEulerBackwardCall c(grad_x, x0, w1, b1, w2, b2, w3, b3, num_steps);
  FUSED_OPS_CHECK(x0.is_cuda(), "x0 must be a CUDA tensor, got ", device_str(x0));
  // Column-sum partials are for the streaming kernels only: the resident
  // kernel sums the bias gradients in its last phase.
  const int64_t P =
      flow_backward_resident(c.B, c.H, c.num_steps) ? 0 : (c.B + kChunkRows - 1) / kChunkRows;
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
    if (a.resident) {
      flow_backward_resident_launch<T>(a);
    } else {
      run_flow_euler_backward<T>(a, x0.device(), ops);
    }
  });
  return c.grads();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("flow_euler_backward", TORCH_BOX(&flow_euler_backward_cuda));
}

}  // namespace fused_ops
