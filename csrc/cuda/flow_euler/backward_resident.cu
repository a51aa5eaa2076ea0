// \brief fused_ops::flow_euler_backward, resident path: the whole backward
// of a small problem as ONE cooperative launch.
//
// Chosen when flow_backward_resident(B, H, num_steps) holds
// (flow_euler_backward.h: num_steps * B <= 512 stacked rows and every
// step's activations within 4 Mi elements; the default B=8, 32 steps).
// Done as a step sequence of cuBLAS products and small kernels it would be
// ~12 host calls per Euler step, and host-bound.
//
// Design: the resident step sequence of flow_euler_backward.h as 6 n + 1
// phases of one persistent kernel, grid barriers between them
// (cuda/primitives/tile_gemm.cuh: 32 x 32 product tiles, shared by the
// blocks of each phase):
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
// The elementwise arithmetic is the streaming path's (the same ActEpilogue
// and UpdateEpilogue, colsum_kernel's g = g_in + add, dt * g), so both
// paths round the same way; only the sums' order differs (tiles sum k in
// order, column sums in double).  At B = 8 every phase is a handful of
// tiles: the step is bound by the barriers and the products' latency, not
// by the FLOPs.  The grid is at most one block per SM and never more than
// the busiest phase's work units.  No atomics: bitwise reproducible.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/flow_euler/backward_paths.cuh"
#include "cuda/primitives/cooperative.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/tile_gemm.cuh"
#include "flow_euler_backward.h"

namespace fused_ops {
namespace {

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

}  // namespace

namespace flow_euler_backward_paths {

bool resident_applies(const FlowEulerBackwardCall& c) {
  return flow_backward_resident(c.B, c.H, c.num_steps);
}

void launch_resident(const FlowEulerBackwardCall& c) {
  dispatch_float(c.x0.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    FlowBackwardArgs<T> a{};
    // No column-sum partials (P = 0): the kernel sums the bias gradients in
    // its last phase.  The workspace is freed (returned to torch's caching
    // allocator, stream ordered) when this call returns, after all its work
    // was queued.
    Tensor workspace = flow_backward_args<T>(c, 0, a, true);
    flow_backward_resident_launch<T>(a);
  });
}

}  // namespace flow_euler_backward_paths
}  // namespace fused_ops
