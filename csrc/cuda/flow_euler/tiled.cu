// \brief fused_ops::flow_euler, tiled path: float32, any B, on sm_80+
// tensor cores in 3xTF32 (float32 accuracy), one block per 32 rows.
//
// Chosen for float32 on compute capability >= 8.0 when a 32-row tile's
// activations and three weight chunks fit shared memory (H <= 512 and, at
// D = 64, H <= 384), after the split, row, cluster and wgmma paths (on an
// H200 at the default sizes: the wgmma path takes large batches).
//
// Design.  A packing kernel, then one launch: one block of 256 threads per
// 32 rows, running its rows through all steps with x and h in shared
// memory.  Each layer is a [32 x K] x [K x N] product on tensor cores in
// 3xTF32 (cuda/primitives/tf32x3.cuh).  The weights are packed once per
// call into the order and fragment layout the products consume
// (cuda::pack_b_fragments), so they stream from L2 through shared memory in
// 32 KB chunks by cp.async (cuda/primitives/cp_async.cuh: 16 bytes per
// instruction, three chunks in flight) and a lane reads its B fragment with
// one 8-byte load; output columns go in passes of 256 spread over the 8
// warps (n-tiles warp, warp+8, ... so small N still uses every warp).  The
// activations are stored split into TF32 big and small parts (read by
// ldmatrix), so each is split once, not by every warp that reads it.
// B = 4096 is 128 blocks: one wave on an H200's 132 SMs.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "cuda/flow_euler/paths.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/tf32x3.cuh"
#include "cuda/primitives/tiled_mlp.cuh"

namespace fused_ops {
namespace {

// The layer core and its constants (32-row tiles, 32-column weight chunks
// of 32 KB, passes of 256 output columns, three chunks in flight) are
// cuda/primitives/tiled_mlp.cuh's; the weights are packed for it once per
// call (launch_tiled).
namespace tm = cuda::tiled_mlp;
using tm::kChunkSteps;
using tm::kKChunk;
using tm::kPassCols;
using tm::kPassTiles;
using tm::kStages;
using tm::kTileRows;
static_assert(tm::kThreads == kThreads, "the core's block is the flow kernels' block");

struct TiledArgs : FlowParams {
  int KpD, KpH;                   // D, H rounded up to kKChunk
  const float *pw1, *pw2, *pw3;   // packed weights (w1 without its time column)
};

// The hidden layer h is the A operand of the next product only, so it lives
// in shared memory split (cuda::SplitRows: TF32 big and small planes, read
// by ldmatrix), split once when written instead of by each of the 8 warps
// at every read (splitting per read left only a small fraction of the
// issued instructions tensor-core products).  x is kept in float32 for the
// Euler update and split beside it for the first layer.  One h buffer serves both
// hidden layers: the second layer keeps its whole output in registers (at
// most kMaxKeptPasses passes of 256 columns, so H <= 512) until every warp
// has read its input, then overwrites it -- two split buffers would not fit
// next to the weight stages at H = 256.
constexpr int kMaxKeptPasses = 2;

// Shared memory of one tile block, in floats.  Activation rows are K padded
// to kKChunk plus 4 (an odd multiple of 16 bytes: conflict-free ldmatrix);
// kStages chunk buffers.
struct TiledLayout {
  int ldD, ldH, X, XS, H, W, B1, WT, B2, B3, total;
  __host__ __device__ TiledLayout(int KpD, int KpH, int D, int H_) {
    ldD = KpD + 4;
    ldH = KpH + 4;
    X = 0;
    XS = X + kTileRows * ldD;       // x split: two planes
    H = XS + 2 * kTileRows * ldD;   // h split: two planes
    W = H + 2 * kTileRows * ldH;
    B1 = W + kStages * tm::kChunkFloats;
    WT = B1 + H_;
    B2 = WT + H_;
    B3 = B2 + H_;
    total = B3 + D;
  }
};

// One layer of the tile kernel (tm::tiled_layer), its epilogue by MODE:
//   kHidden: hs <- silu(acc + t * w_time + bias)     (w_time may be null)
//   kUpdate: x  <- x + dt * (acc + bias), x32 and its split copy xs
// KEEP > 0: the layer overwrites its own input (the second hidden layer).
template <int MODE, int KEEP>
__device__ __forceinline__ void tiled_layer(const cuda::SplitRows in, int Kp, const float* __restrict__ Wp,
                                            int N, const cuda::SplitRows out, float* x32, const float* bias,
                                            const float* w_time, float t, float dt, float* wbuf) {
  if (MODE == kHidden) {
    tm::tiled_layer<KEEP>(in, Kp, Wp, N, wbuf, [&](int row, int col, float s) {
      out.store(row, col, silu(s + (w_time != nullptr ? t * w_time[col] : 0.f) + bias[col]));
    });
  } else {
    tm::tiled_layer<KEEP>(in, Kp, Wp, N, wbuf, [&](int row, int col, float s) {
      float* o = x32 + row * out.ld + col;
      *o = euler_step(*o, dt, s + bias[col]);
      out.store(row, col, *o);
    });
  }
}

template <int KEEP>
__global__ void __launch_bounds__(kThreads, 1) flow_tiled_kernel(TiledArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ float4 tiled_smem4[];
  float* smem = reinterpret_cast<float*>(tiled_smem4);
  const TiledLayout L(a.KpD, a.KpH, a.D, a.H);
  const int D = a.D, H = a.H, tid = threadIdx.x;
  const int64_t row0 = int64_t(blockIdx.x) * kTileRows;
  const int64_t remaining = a.B - row0;
  const int rows = remaining < kTileRows ? int(remaining) : kTileRows;
  const cuda::SplitRows xs{smem + L.XS, L.ldD, kTileRows * L.ldD};
  const cuda::SplitRows hs{smem + L.H, L.ldH, kTileRows * L.ldH};

  // Rows past B and columns past D / H are zero and stay zero in the
  // columns (never written); the extra rows evolve harmlessly and are not
  // stored.
  stage_rows(smem + L.X, kTileRows, L.ldD, a.x0 + row0 * D, D, rows, D);
  for (int i = tid; i < 2 * kTileRows * L.ldH; i += kThreads) smem[L.H + i] = 0.f;
  for (int j = tid; j < H; j += kThreads) {
    smem[L.B1 + j] = a.b1[j];
    smem[L.WT + j] = a.w1[int64_t(j) * (D + 1) + D];
    smem[L.B2 + j] = a.b2[j];
  }
  for (int d = tid; d < D; d += kThreads) smem[L.B3 + d] = a.b3[d];
  __syncthreads();
  for (int i = tid; i < kTileRows * L.ldD; i += kThreads) xs.store(i / L.ldD, i % L.ldD, smem[L.X + i]);
  // (tiled_layer begins with a barrier.)

  float* wbuf = smem + L.W;
  for (int k = 0; k < a.num_steps; ++k) {
    const float t = flow_step_time<float>(k, a.num_steps);
    tiled_layer<kHidden, 0>(xs, a.KpD, a.pw1, H, hs, nullptr, smem + L.B1, smem + L.WT, t, a.dt, wbuf);
    tiled_layer<kHidden, KEEP>(hs, a.KpH, a.pw2, H, hs, nullptr, smem + L.B2, nullptr, t, a.dt, wbuf);
    tiled_layer<kUpdate, 0>(hs, a.KpH, a.pw3, D, xs, smem + L.X, smem + L.B3, nullptr, t, a.dt, wbuf);
  }
  __syncthreads();
  for (int i = tid; i < rows * D; i += kThreads) {
    const int r = i / D, d = i - r * D;
    a.x[(row0 + r) * D + d] = smem[L.X + r * L.ldD + d];
  }
#else
  __trap();  // launched only on compute capability >= 8.0
#endif
}

TiledArgs tiled_args(const FlowEulerCall& c) {
  TiledArgs a{};
  static_cast<FlowParams&>(a) = flow_params(c);
  a.KpD = round_up(a.D, kKChunk);
  a.KpH = round_up(a.H, kKChunk);
  return a;
}

size_t tiled_smem(const TiledArgs& a) {
  return sizeof(float) * size_t(TiledLayout(a.KpD, a.KpH, a.D, a.H).total);
}

}  // namespace

namespace flow_euler_paths {

bool tiled_applies(const FlowEulerCall& c) {
  if (c.x.scalar_type() != ScalarType::Float) return false;
  if (cuda::compute_capability_major() < 8) return false;
  if (c.D > (1 << 16) || c.B > int64_t(INT_MAX) - kTileRows) return false;
  if (c.H > kMaxKeptPasses * kPassCols) return false;  // the second layer's output in registers
  return tiled_smem(tiled_args(c)) <= cuda::max_shared_memory_per_block();
}

void launch_tiled(const FlowEulerCall& c) {
  TiledArgs a = tiled_args(c);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  // Pack the three weights (w1 without its time column) into one workspace;
  // each layer's size is a multiple of 64 floats, so every chunk stays
  // 16-byte aligned for cp.async.
  const int kD = a.KpD / kKChunk * kChunkSteps, kH = a.KpH / kKChunk * kChunkSteps;  // k-steps
  const int64_t s1 = cuda::b_fragment_size(a.H, kD), s2 = cuda::b_fragment_size(a.H, kH),
                s3 = cuda::b_fragment_size(a.D, kH);
  Tensor packed = empty_like_device(c.x, {s1 + s2 + s3});
  float* pw = mdata<float>(packed);
  cuda::BFragmentsBatch batch{};
  batch.m[0] = tm::packed_layer(a.w1, a.D + 1, a.H, a.D, a.KpD, pw);
  batch.m[1] = tm::packed_layer(a.w2, a.H, a.H, a.H, a.KpH, pw + s1);
  batch.m[2] = tm::packed_layer(a.w3, a.H, a.D, a.H, a.KpH, pw + s1 + s2);
  cuda::pack_b_fragments(stream, batch, 3);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  a.pw1 = pw, a.pw2 = pw + s1, a.pw3 = pw + s1 + s2;

  const size_t smem = tiled_smem(a);
  static_assert(kMaxKeptPasses == 2, "one kernel per number of kept passes below");
  void (*kernel)(TiledArgs) = a.H <= kPassCols ? flow_tiled_kernel<1> : flow_tiled_kernel<2>;
  cuda::allow_dynamic_smem(kernel, smem);
  const unsigned grid = unsigned((c.B + kTileRows - 1) / kTileRows);
  kernel<<<grid, kThreads, smem, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace flow_euler_paths
}  // namespace fused_ops
