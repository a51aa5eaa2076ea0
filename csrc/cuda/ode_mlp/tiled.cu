// \brief ode_mlp's "tiled" CUDA path: float32, any B, on sm_80+ tensor cores
// in 3xTF32 (float32 accuracy), one launch: one block of 256 threads per
// 32 rows runs its rows through every step, stage and layer.
//
// When chosen: float32 on compute capability >= 8.0 when a 32-row tile's
// working set and two or three weight chunks fit shared memory and every hidden
// layer after the first is at most 512 wide (it is computed in place, its
// output held in registers); first in the table (dispatch.cu says why).
//
// Design.  A packing kernel, then one launch.  Each layer is a [32 x K] x
// [K x N] product by the fused-MLP layer core cuda/primitives/tiled_mlp.cuh
// (the one flow_euler's tiled path uses): split activations in shared
// memory read by ldmatrix, every layer's weights packed once per call into
// the core's fragment order (cuda::pack_b_fragments) and streamed from L2
// in 32 KB chunks by cp.async, three in flight.  The epilogues are this
// file's:
//   layer 0          z = acc + time_bias[e, n] (+ sample_bias[row, n])
//   hidden layers    z = acc + biases[l][n]
//   then             act(z) stored split (the next layer's A operand),
//   last layer       K_i[row, n] = z in float32 (no activation).
// The activation is a template argument of the kernel (ten activations x
// two chunk-stage counts: twenty kernels), so its switch folds away in the
// epilogue.
//
// Shared memory of a tile, in floats (ldD = round_up(D, 32) + 4, ldH =
// round_up(widest hidden width, 32) + 4: 16-byte rows, an odd number of
// 16-byte groups, so ldmatrix is conflict-free):
//   YS  [2][32][ldD]      the stage input Y_i split (big, small planes)
//   HS  [2][32][ldH]      the hidden activations split, one buffer for all
//                         hidden layers: layer 0 writes it from YS, layer
//                         l > 0 overwrites its own input (the core's KEEP
//                         mode), the last layer reads it
//   W   [3 or 2][8192]    the weight chunk stages (32 KB each): three
//                         where they fit, else two (the core's STAGES)
//   y   [32][D]           the state, float32
//   K   [stages][32][D]   the stage velocities, float32
// e.g. D = 64, hidden 256, rk4: 17 + 65 + 96 + 8 + 32 = 218 KiB (three
// stages); D = 2, hidden 512, midpoint: 9 + 129 + 64 + 0.75 = 203 KiB (two);
// the opt-in limit on sm_90 is 227 KiB.
// Columns of YS and HS past a layer's true width (to its 32-rounded width)
// are zero whenever a layer reads them: zeroed at the start and again
// after each hidden layer whose width is not a multiple of 32 (a wider
// layer before it may have left values there, and 0 * inf is NaN).
// Rows past B start at zero, evolve harmlessly (no sample_bias for them)
// and are never stored.
//
// Numerics: the products are 3xTF32 with float32 accumulation per 32-column
// chunk (tiled_mlp.cuh; of the order of float32 FMA against float64); the
// Runge-Kutta combinations are float32, written as general.cu writes them:
// Y_i = y + dt * sum_{j<i} a_ij K_j, y += dt * sum_i b_i K_i, with dt =
// t[k+1] - t[k] read from device memory.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "common/activations.h"
#include "cuda/ode_mlp/paths.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/tf32x3.cuh"
#include "cuda/primitives/tiled_mlp.cuh"

namespace fused_ops {
namespace {

namespace tm = cuda::tiled_mlp;
constexpr int kRows = tm::kTileRows;
constexpr int kMaxKeptPasses = 2;  // an in-place layer's output in registers: N <= 512

__host__ __device__ inline int round_up32(int64_t v) { return int((v + tm::kKChunk - 1) / tm::kKChunk * tm::kKChunk); }

struct TiledOdeArgs {
  const float *x0, *t, *time_bias, *sample_bias;  // sample_bias: nullptr when none
  const float* pw[kOdeMaxLayers];                 // packed weights of layer l
  const float* b[kOdeMaxLayers];                  // b[l], l >= 1
  int width[kOdeMaxLayers];                       // N of layer l
  int64_t B, S;
  int D, L, method, KpD, KpH;                     // KpH: the HS buffer's width (0 when L == 1)
  float act_param;
  float* states;
  bool all_states;
};

// Offsets of the shared-memory regions (see the file comment), in floats.
struct TiledOdeLayout {
  int ldD, ldH, YS, HS, W, Y, K, total;
  __host__ __device__ TiledOdeLayout(int KpD, int KpH, int D, int stages, int chunk_stages) {
    ldD = KpD + 4;
    ldH = KpH + 4;
    YS = 0;
    HS = YS + 2 * kRows * ldD;
    W = HS + (KpH ? 2 * kRows * ldH : 0);
    Y = W + chunk_stages * tm::kChunkFloats;
    K = Y + kRows * D;
    total = K + stages * kRows * D;
  }
};

template <int64_t ACT, int STAGES>
__global__ void __launch_bounds__(tm::kThreads, 1) ode_tiled_kernel(TiledOdeArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ float4 ode_tiled_smem4[];
  float* smem = reinterpret_cast<float*>(ode_tiled_smem4);
  const OdeTableau tab = ode_tableau(a.method);
  const int s = tab.stages, D = a.D, L = a.L, tid = threadIdx.x;
  const TiledOdeLayout lay(a.KpD, a.KpH, D, s, STAGES);
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const int rows = a.B - row0 < kRows ? int(a.B - row0) : kRows;
  const int n = kRows * D;  // the tile's state elements, rows past B included
  const cuda::SplitRows ys{smem + lay.YS, lay.ldD, kRows * lay.ldD};
  const cuda::SplitRows hs{smem + lay.HS, lay.ldH, kRows * lay.ldH};
  float* wbuf = smem + lay.W;
  float* y = smem + lay.Y;
  float* K = smem + lay.K;
  const int64_t BD = a.B * D;
  const float p = a.act_param;

  // Zero everything before W (YS, HS: their padding columns), load y.
  for (int i = tid; i < lay.W; i += tm::kThreads) smem[i] = 0.f;
  for (int x = tid; x < n; x += tm::kThreads) {
    const int r = x / D;
    y[x] = r < rows ? a.x0[row0 * D + x] : 0.f;
    if (a.all_states && r < rows) a.states[row0 * D + x] = y[x];
  }
  __syncthreads();  // the zeros before the stage input's stores (other threads' elements)

  for (int64_t k = 0; k < a.S; ++k) {
    const float dt = a.t[k + 1] - a.t[k];
    for (int i = 0; i < s; ++i) {
      // The stage input, split for the first layer.  Y_0 = y.  K_j and the
      // previous readers of YS are behind the barrier after the last layer.
      for (int x = tid; x < n; x += tm::kThreads) {
        float v = y[x];
        if (i > 0) {
          float acc = 0.f;
          for (int j = 0; j < i; ++j) {
            if (tab.a[i][j] != 0.0) acc += float(tab.a[i][j]) * K[j * n + x];
          }
          v = y[x] + dt * acc;
        }
        const int r = x / D;
        ys.store(r, x - r * D, v);
      }
      const int64_t e = k * s + i;
      const float* tb = a.time_bias + e * a.width[0];
      float* Ki = K + i * n;
      for (int l = 0; l < L; ++l) {
        const int N = a.width[l];
        if (l == L - 1) {
          // The velocity: K_i = acc + bias, float32, no activation.
          const cuda::SplitRows in = l ? hs : ys;
          const int Kp = l ? round_up32(a.width[l - 1]) : a.KpD;
          if (l == 0) {
            tm::tiled_layer<0, STAGES>(in, Kp, a.pw[0], N, wbuf, [&](int row, int col, float acc) {
              float z = acc + tb[col];
              if (a.sample_bias != nullptr && row < rows) z += a.sample_bias[(row0 + row) * N + col];
              Ki[row * D + col] = z;
            });
          } else {
            const float* bl = a.b[l];
            tm::tiled_layer<0, STAGES>(in, Kp, a.pw[l], N, wbuf,
                               [&](int row, int col, float acc) { Ki[row * D + col] = acc + bl[col]; });
          }
        } else {
          if (l == 0) {
            tm::tiled_layer<0, STAGES>(ys, a.KpD, a.pw[0], N, wbuf, [&](int row, int col, float acc) {
              float z = acc + tb[col];
              if (a.sample_bias != nullptr && row < rows) z += a.sample_bias[(row0 + row) * N + col];
              hs.store(row, col, activate(ACT, p, z));
            });
          } else {
            // In place: HS is this layer's input and output.
            const float* bl = a.b[l];
            const int Kp = round_up32(a.width[l - 1]);
            auto epi = [&](int row, int col, float acc) { hs.store(row, col, activate(ACT, p, acc + bl[col])); };
            if (N <= tm::kPassCols) {
              tm::tiled_layer<1, STAGES>(hs, Kp, a.pw[l], N, wbuf, epi);
            } else {
              tm::tiled_layer<2, STAGES>(hs, Kp, a.pw[l], N, wbuf, epi);
            }
          }
          // Columns N .. round_up(N, 32) of HS, which the next layer reads:
          // zero (a wider layer may have written them).  Nobody reads HS
          // until the next layer's opening barrier, and the epilogue writes
          // only columns < N.
          const int pad = round_up32(N) - N;
          for (int x = tid; x < kRows * pad; x += tm::kThreads) {
            const int r = x / pad, c = N + (x - r * pad);
            hs.big[r * hs.ld + c] = 0.f;
            hs.big[hs.plane_floats + r * hs.ld + c] = 0.f;
          }
        }
      }
      __syncthreads();  // K_i complete; every reader of YS and HS done
    }
    // The step: y += dt * sum_i b_i K_i (each thread its own elements).
    float* out = a.all_states ? a.states + (k + 1) * BD + row0 * D : nullptr;
    for (int x = tid; x < n; x += tm::kThreads) {
      float acc = 0.f;
      for (int i = 0; i < s; ++i) {
        if (tab.b[i] != 0.0) acc += float(tab.b[i]) * K[i * n + x];
      }
      y[x] = y[x] + dt * acc;
      if (out != nullptr && x < rows * D) out[x] = y[x];
    }
  }
  if (!a.all_states) {
    for (int x = tid; x < rows * D; x += tm::kThreads) a.states[row0 * D + x] = y[x];
  }
#else
  __trap();  // launched only on compute capability >= 8.0
#endif
}

// The widest hidden layer (the HS buffer's width), 0 when L == 1.
int64_t widest_hidden(const OdeMlpCall& c) {
  int64_t w = 0;
  for (int64_t l = 0; l + 1 < c.L; ++l) w = c.widths[l] > w ? c.widths[l] : w;
  return w;
}

size_t tiled_smem(const OdeMlpCall& c, int chunk_stages) {
  const TiledOdeLayout lay(round_up32(c.D), round_up32(widest_hidden(c)), int(c.D), int(c.stages), chunk_stages);
  return sizeof(float) * size_t(lay.total);
}

// Three weight chunks in flight where they fit, else two (the widest
// fields: D = 2 at width 512 needs 230 KB with three); 0: neither fits.
int chunk_stages(const OdeMlpCall& c) {
  const size_t limit = cuda::max_shared_memory_per_block();
  return tiled_smem(c, 3) <= limit ? 3 : tiled_smem(c, 2) <= limit ? 2 : 0;
}

}  // namespace

namespace ode_mlp_paths {

bool tiled_applies(const OdeMlpCall& c) {
  if (c.x0.scalar_type() != ScalarType::Float) return false;
  if (cuda::compute_capability_major() < 8) return false;
  // Sizes as int (the shared memory bound below keeps them far smaller).
  if (c.D > (1 << 16) || c.Hmax > (1 << 16) || c.B > int64_t(INT_MAX) - kRows) return false;
  for (int64_t l = 1; l + 1 < c.L; ++l) {
    if (c.widths[l] > kMaxKeptPasses * tm::kPassCols) return false;  // in place: output in registers
  }
  return chunk_stages(c) != 0;
}

void launch_tiled(const OdeMlpCall& c) {
  const OdeMlpPtrs<float> p(c);
  TiledOdeArgs a{};
  a.x0 = p.x0, a.t = p.t, a.time_bias = p.time_bias, a.sample_bias = p.sample_bias;
  a.B = c.B, a.S = c.S, a.D = int(c.D), a.L = int(c.L), a.method = int(c.method);
  a.KpD = round_up32(c.D), a.KpH = round_up32(widest_hidden(c));
  a.act_param = float(c.act_param);
  a.states = mdata<float>(c.states), a.all_states = c.all_states;

  // Pack every layer's weight (k padded to whole chunks) into one workspace,
  // at most kMaxBFragments per packing launch.
  int64_t offset[kOdeMaxLayers + 1] = {0};
  for (int l = 0; l < c.L; ++l) {
    a.width[l] = int(c.widths[l]);
    a.b[l] = p.b[l];
    offset[l + 1] = offset[l] + cuda::b_fragment_size(a.width[l], round_up32(p.in_width(l)) / 8);
  }
  Tensor packed = empty_like_device(c.x0, {offset[c.L]});
  float* pw = mdata<float>(packed);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  for (int l0 = 0; l0 < c.L; l0 += cuda::kMaxBFragments) {
    cuda::BFragmentsBatch batch{};
    const int count = int(c.L) - l0 < cuda::kMaxBFragments ? int(c.L) - l0 : cuda::kMaxBFragments;
    for (int j = 0; j < count; ++j) {
      const int l = l0 + j;
      const int K = int(p.in_width(l));
      batch.m[j] = tm::packed_layer(p.w[l], K, a.width[l], K, round_up32(K), pw + offset[l]);
    }
    cuda::pack_b_fragments(stream, batch, count);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  for (int l = 0; l < c.L; ++l) a.pw[l] = pw + offset[l];

  const int stages = chunk_stages(c);
  void (*kernel)(TiledOdeArgs) = nullptr;
  with_activation(c.act, [&](auto act) {
    constexpr int64_t kAct = decltype(act)::value;
    kernel = stages == 3 ? ode_tiled_kernel<kAct, 3> : ode_tiled_kernel<kAct, 2>;
  });
  const size_t smem = tiled_smem(c, stages);
  cuda::allow_dynamic_smem(kernel, smem);
  const unsigned grid = unsigned((c.B + kRows - 1) / kRows);
  kernel<<<grid, tm::kThreads, smem, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace ode_mlp_paths
}  // namespace fused_ops
