// \brief fused_ops::ode_mlp, cluster path: small float32 batches (B <= 32)
// on sm_90, every step, stage and layer in ONE launch of one thread-block
// cluster of 16 blocks (8 where 16 cannot be co-scheduled).
//
// When chosen: float32, compute capability >= 9.0, B <= 32, when every
// layer's weight slices (and the buffers below) fit one block's shared
// memory for a 16- or 8-block cluster that the GPU can co-schedule
// (cudaOccupancyMaxActiveClusters).  The seed flow (D = 64, three Linear
// layers of 256, 8 rows) needs 46 KB per block of 16; a W x W hidden layer
// alone takes W^2 / 16 floats per block (512 x 512: 64 KB).
//
// Design (the layer routine: cuda/primitives/cluster_mlp.cuh).  Block r owns
// the neurons [r*n_l, (r+1)*n_l) of every layer l (n_l = ceil(width_l / C));
// its weight rows and biases stay in its shared memory for the whole
// integration, so the weights are read from global memory once per call.
// Every block holds full copies of the current layer input (rows x padded
// width); a layer computes the block's slice and pushes it into every
// block's copy (distributed shared memory), one cluster barrier per layer.
// The last layer's epilogue does the Runge-Kutta arithmetic for the block's
// own state columns (the block keeps y and every stage velocity K_i of its
// columns locally): it forms K_i, then either the next stage input
// Y_{i+1} = y + dt sum_j a_{i+1,j} K_j or, after the last stage, the new
// state y + dt sum_i b_i K_i (written to states when all_states), and
// pushes that as the next evaluation's layer-0 input.  So a field
// evaluation of L layers costs L cluster barriers and nothing else.
//
// Buffers (floats; each array a multiple of 4 so each starts 16-byte aligned):
//   W_l   [n_l][weight_ld(ld_in_l)]   this block's weight rows of layer l
//   BIAS_l[n_l] (l >= 1)              its biases; layer 0's bias is TB (+ SB)
//   TB    [2][n_0]                    time_bias rows of evaluations e, e+1
//                                     (cp.async one evaluation ahead)
//   SB    [rows][n_0]                 its slice of sample_bias (if given)
//   X     [2][rows][ldD]              layer-0 input, ping-pong per evaluation
//                                     (with L = 1 the layer reads and pushes X)
//   HID   [2][rows][ldH]              hidden activations, ping-pong per layer
//   PART, STAGE                       the layer routine's partial sums, slice
//   Y     [rows][n_D], K [stages][rows][n_D]   this block's state columns
// Every buffer slot past a true width or past B is zero-initialised or
// written as 0, so whole-segment dot products read only zeros (finite)
// there.  Buffer reuse: a buffer is pushed into one barrier or more after
// its last reader (HID[l & 1] is read by layer l+1 and next written by
// layer l+2 or by the next evaluation's layer 0 or 1; X alternates per
// evaluation), so single barriers suffice.
//
// Numerics: float32 FMA dot products in a fixed order (bitwise
// reproducible; the order differs from general.cu's lane-strided sums, so
// the two agree to rounding, not bitwise); bias then sample_bias added as
// general.cu adds them; the activation is a compile-time code (10
// instantiations); the Runge-Kutta combinations are general.cu's
// expressions term by term (zero tableau entries skipped, dt = t[k+1] - t[k]
// in float32 read from device memory, one step ahead).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/ode_mlp/paths.cuh"
#include "cuda/primitives/cluster_mlp.cuh"
#include "cuda/primitives/cp_async.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

namespace cg = cooperative_groups;
using cuda::cluster_mlp::ClusterLayer;
using cuda::cluster_mlp::kClusterThreads;
using cuda::cluster_mlp::round_up;
using cuda::cluster_mlp::weight_ld;

__host__ __device__ inline int round4(int v) { return (v + 3) / 4 * 4; }

struct OdeClusterArgs {
  const float* x0;
  const float* t;
  const float* time_bias;
  const float* sample_bias;  // nullptr: none
  const float* w[kOdeMaxLayers];
  const float* b[kOdeMaxLayers];  // b[l] for l >= 1
  float* states;
  int width[kOdeMaxLayers];  // true output widths (width[L-1] = D)
  int nb[kOdeMaxLayers];     // neurons per block
  // ldD: X's row length; ldH: HID's widest row length (each layer's own: geo[l + 1].ld_in).
  int B, D, L, S, stages, rows, ldD, ldH, all_states;
  float act_param;
  float A[kOdeMaxStages][kOdeMaxStages], Bw[kOdeMaxStages];  // the tableau in float32
  ClusterLayer geo[kOdeMaxLayers];
  // Shared-memory offsets (floats) and the total.
  int off_w[kOdeMaxLayers], off_bias[kOdeMaxLayers];
  int off_tb, off_sb, off_x, off_h, off_part, off_stage, off_y, off_k;
  int x_size, h_size, k_size, total;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Issues this thread's cp.async copies of evaluation e's time_bias slice
// into tb (n0 floats of the block's neurons j0 ..), then commits (an empty
// group when there is nothing to copy, keeping the group count uniform).
__device__ __forceinline__ void prefetch_time_bias(const OdeClusterArgs& a, int64_t e, int j0, int nj, float* tb) {
  const float* src = a.time_bias + e * a.width[0] + j0;
  for (int j = int(threadIdx.x); j < nj; j += kClusterThreads) cuda::cp_async_4(tb + j, src + j);
  cuda::cp_async_commit();
}
#endif

template <int64_t ACT>
__global__ void __launch_bounds__(kClusterThreads, 1) ode_cluster_kernel(const __grid_constant__ OdeClusterArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ float4 ode_cluster_smem4[];
  float* smem = reinterpret_cast<float*>(ode_cluster_smem4);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), num_blocks = int(cluster.num_blocks());
  const int tid = int(threadIdx.x), L = a.L, D = a.D, rows = a.rows, s = a.stages;
  const int n0 = a.nb[0], j00 = rank * n0, nj0 = max(0, min(n0, a.width[0] - j00));
  const int nD = a.nb[L - 1], d0 = rank * nD, nd = max(0, min(nD, D - d0));
  const int64_t num_evals = int64_t(a.S) * s;

  // Weight slices, biases, sample_bias, x0; zeroed hidden buffers.  Blocks
  // without neurons of a layer (a slice past its width) stage zeros and never
  // form their out-of-range source addresses.
  for (int l = 0; l < L; ++l) {
    const int in_w = l ? a.width[l - 1] : D, n = a.nb[l], j0 = rank * n;
    const int nj = max(0, min(n, a.width[l] - j0));
    cuda::cluster_mlp::stage_rows(smem + a.off_w[l], n, weight_ld(a.geo[l].ld_in),
                                  a.w[l] + int64_t(min(j0, a.width[l])) * in_w, in_w, nj, in_w);
    if (l) {
      for (int j = tid; j < n; j += kClusterThreads) smem[a.off_bias[l] + j] = j < nj ? a.b[l][j0 + j] : 0.f;
    }
  }
  if (a.sample_bias) {
    cuda::cluster_mlp::stage_rows(smem + a.off_sb, rows, n0, a.sample_bias + min(j00, a.width[0]), a.width[0],
                                  a.B, nj0);
  }
  cuda::cluster_mlp::stage_rows(smem + a.off_x, rows, a.ldD, a.x0, D, a.B, D);
  for (int i = tid; i < a.x_size; i += kClusterThreads) smem[a.off_x + rows * a.ldD + i] = 0.f;
  for (int i = tid; i < a.h_size; i += kClusterThreads) smem[a.off_h + i] = 0.f;
  float* const y = smem + a.off_y;
  float* const K = smem + a.off_k;
  for (int o = tid; o < rows * nD; o += kClusterThreads) {
    const int row = o / nD, j = o - row * nD;
    const float v = (row < a.B && j < nd) ? a.x0[int64_t(row) * D + d0 + j] : 0.f;
    y[o] = v;
    if (a.all_states && row < a.B && j < nd) a.states[int64_t(row) * D + d0 + j] = v;
  }
  float* const tb_buf = smem + a.off_tb;
  // TB's slots past the layer's width are never copied into: zero them once.
  for (int j = nj0 + tid; j < round4(n0); j += kClusterThreads) tb_buf[j] = tb_buf[round4(n0) + j] = 0.f;
  if (num_evals > 0) prefetch_time_bias(a, 0, j00, nj0, tb_buf);
  // All blocks initialised (and running) before anyone stores into them.
  cluster.sync();

  float* const partial = smem + a.off_part;
  float* const stage = smem + a.off_stage;
  const float* const sb = a.sample_bias ? smem + a.off_sb : nullptr;
  const int ldH = a.ldH;
  float t0 = a.S > 0 ? a.t[0] : 0.f, t1 = a.S > 0 ? a.t[1] : 0.f;
  int cur = 0;  // X[cur] is the current evaluation's layer-0 input
  for (int k = 0; k < a.S; ++k) {
    const float dt = t1 - t0;
    // Loaded now, used at the end of the step: its latency hides behind the step.
    const float t2 = k + 2 <= a.S ? a.t[k + 2] : 0.f;
    for (int i = 0; i < s; ++i) {
      const int64_t e = int64_t(k) * s + i;
      const float* tb = tb_buf + (e & 1) * round4(n0);
      // Evaluation e's copy was issued an evaluation ago; the block barrier
      // inside layer 0 (after its dot products) publishes all threads' copies.
      cuda::cp_async_wait<0>();
      if (e + 1 < num_evals) {
        prefetch_time_bias(a, e + 1, j00, nj0, tb_buf + ((e + 1) & 1) * round4(n0));
      }
      for (int l = 0; l < L; ++l) {
        const ClusterLayer& g = a.geo[l];
        // Input rows are g.ld_in long (HID's capacity is rows * ldH, the widest).
        const float* in = l ? smem + a.off_h + ((l - 1) & 1) * rows * ldH : smem + a.off_x + cur * rows * a.ldD;
        const int width = a.width[l], first = rank * g.n;
        const float* bias = l ? smem + a.off_bias[l] : tb;
        const bool first_layer = l == 0;
        if (l < L - 1) {
          auto hidden = [&](unsigned, unsigned row, unsigned j, float sum) {
            float z = sum + bias[j];
            if (first_layer && sb) z += sb[row * n0 + j];
            return first + int(j) < width ? activate<float>(ACT, a.act_param, z) : 0.f;
          };
          cuda::cluster_mlp::cluster_layer(cluster, num_blocks, g, in, smem + a.off_w[l], first,
                                           smem + a.off_h + (l & 1) * rows * ldH, a.geo[l + 1].ld_in, rows,
                                           partial, stage, hidden);
        } else {
          // The velocity of the block's own state columns, then the
          // Runge-Kutta combination of those columns (general.cu's order).
          auto velocity = [&](unsigned o, unsigned row, unsigned j, float sum) {
            float v = sum + bias[j];
            if (first_layer && sb) v += sb[row * n0 + j];
            if (first + int(j) >= D) return 0.f;
            const int plane = rows * nD;
            K[i * plane + o] = v;
            float acc = 0.f;
            if (i + 1 < s) {
              for (int m = 0; m <= i; ++m) {
                if (a.A[i + 1][m] != 0.f) acc += a.A[i + 1][m] * K[m * plane + o];
              }
              return y[o] + dt * acc;
            }
            for (int m = 0; m < s; ++m) {
              if (a.Bw[m] != 0.f) acc += a.Bw[m] * K[m * plane + o];
            }
            const float y1 = y[o] + dt * acc;
            y[o] = y1;
            if (a.all_states && int(row) < a.B) {
              a.states[(int64_t(k) + 1) * a.B * D + int64_t(row) * D + first + j] = y1;
            }
            return y1;
          };
          cuda::cluster_mlp::cluster_layer(cluster, num_blocks, g, in, smem + a.off_w[l], first,
                                           smem + a.off_x + (cur ^ 1) * rows * a.ldD, a.ldD, rows, partial,
                                           stage, velocity);
        }
        cluster.sync();
      }
      cur ^= 1;
    }
    t0 = t1;
    t1 = t2;
  }
  cuda::cp_async_wait<0>();  // nothing may be in flight into shared memory at exit
  if (!a.all_states) {
    for (int o = tid; o < rows * nD; o += kClusterThreads) {
      const int row = o / nD, j = o - row * nD;
      if (row < a.B && j < nd) a.states[int64_t(row) * D + d0 + j] = y[o];
    }
  }
#else
  __trap();  // launched only on compute capability >= 9.0
#endif
}

using OdeClusterKernel = void (*)(const OdeClusterArgs);

OdeClusterKernel cluster_kernel_for(int64_t act) {
  OdeClusterKernel kernel = nullptr;
  with_activation(act, [&](auto code) { kernel = ode_cluster_kernel<decltype(code)::value>; });
  return kernel;
}

// The launch plan for a cluster of num_blocks blocks: the work split and the
// shared-memory layout (the pointers are filled by launch_cluster).
OdeClusterArgs cluster_plan(const OdeMlpCall& c, int num_blocks) {
  OdeClusterArgs a{};
  a.B = int(c.B), a.D = int(c.D), a.L = int(c.L), a.S = int(c.S), a.stages = int(c.stages);
  a.rows = round_up(a.B, 8);
  // Row lengths: exactly the columns the C pushes of a layer write, so that
  // every push rewrites all of a buffer's [rows][ld] (HID holds layers of
  // different widths in turn: nothing stale is left past a width).
  const auto ld = [&](int w) { return num_blocks * ((w + num_blocks - 1) / num_blocks); };
  a.ldD = ld(a.D);
  int ldH = 0, max_n = 0, partials = 0;
  for (int l = 0; l < a.L; ++l) {
    a.width[l] = int(c.widths[l]);
    a.nb[l] = (a.width[l] + num_blocks - 1) / num_blocks;
    const int in_w = l ? a.width[l - 1] : a.D;
    a.geo[l] = cuda::cluster_mlp::cluster_layer_geometry(a.nb[l], ld(in_w), a.rows);
    if (l < a.L - 1) ldH = std::max(ldH, ld(a.width[l]));
    max_n = std::max(max_n, a.nb[l]);
    partials = std::max(partials, a.geo[l].partial_floats());
  }
  const OdeTableau tab = ode_tableau(c.method);
  for (int i = 0; i < kOdeMaxStages; ++i) {
    a.Bw[i] = float(tab.b[i]);
    for (int j = 0; j < kOdeMaxStages; ++j) a.A[i][j] = float(tab.a[i][j]);
  }
  int off = 0;
  auto take = [&](int floats) {
    const int at = off;
    off += round4(floats);
    return at;
  };
  for (int l = 0; l < a.L; ++l) a.off_w[l] = take(a.nb[l] * weight_ld(a.geo[l].ld_in));
  for (int l = 1; l < a.L; ++l) a.off_bias[l] = take(a.nb[l]);
  a.off_tb = take(2 * round4(a.nb[0]));
  a.off_sb = take(c.sample_bias ? a.rows * a.nb[0] : 0);
  a.x_size = a.rows * a.ldD;  // one of the two X buffers
  a.off_x = take(2 * a.x_size);
  a.ldH = ldH;
  a.h_size = 2 * a.rows * ldH;
  a.off_h = take(a.h_size);
  a.off_part = take(partials);
  a.off_stage = take(a.rows * max_n);
  a.off_y = take(a.rows * a.nb[a.L - 1]);
  a.k_size = a.rows * a.nb[a.L - 1];
  a.off_k = take(a.stages * a.k_size);
  a.total = off;
  return a;
}

size_t plan_bytes(const OdeClusterArgs& a) { return sizeof(float) * size_t(a.total); }

// The cluster size to use for this call, or 0 when the path does not apply.
int cluster_blocks_for(const OdeMlpCall& c) {
  if (c.B > cuda::cluster_mlp::kClusterMaxRows || c.x0.scalar_type() != ScalarType::Float) return 0;
  if (cuda::compute_capability_major() < 9) return 0;
  // int indexing throughout; the sizes are far below these bounds wherever
  // the weight slices fit shared memory.
  if (c.Hmax > (1 << 20) || c.S > (int64_t(1) << 28)) return 0;
  const OdeClusterKernel kernel = cluster_kernel_for(c.act);
  for (int num_blocks : {16, 8}) {
    const size_t bytes = plan_bytes(cluster_plan(c, num_blocks));
    if (bytes > cuda::max_shared_memory_per_block()) continue;
    if (cuda::cluster_fits(kernel, num_blocks, kClusterThreads, bytes)) return num_blocks;
  }
  return 0;
}

}  // namespace

namespace ode_mlp_paths {

bool cluster_applies(const OdeMlpCall& c) { return cluster_blocks_for(c) != 0; }

void launch_cluster(const OdeMlpCall& c) {
  const int num_blocks = cluster_blocks_for(c);
  OdeClusterArgs a = cluster_plan(c, num_blocks);
  const OdeMlpPtrs<float> p(c);
  a.x0 = p.x0, a.t = p.t, a.time_bias = p.time_bias, a.sample_bias = p.sample_bias;
  for (int l = 0; l < a.L; ++l) a.w[l] = p.w[l], a.b[l] = p.b[l];
  a.states = mdata<float>(c.states);
  a.all_states = c.all_states ? 1 : 0;
  a.act_param = float(c.act_param);
  const size_t smem = plan_bytes(a);
  const OdeClusterKernel kernel = cluster_kernel_for(c.act);
  cuda::allow_dynamic_smem(kernel, smem);  // cached: a no-op after the first call
  const cuda::ClusterLaunch launch(num_blocks, num_blocks, kClusterThreads, smem,
                                   cuda::current_stream(cuda::current_device()));
  FUSED_OPS_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, kernel, a));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace ode_mlp_paths
}  // namespace fused_ops
