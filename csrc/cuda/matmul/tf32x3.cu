// \brief tf32x3 path of fused_ops::matmul: float32 products on Hopper's
// warpgroup tensor cores at float32 accuracy, for the large products of the
// ops' cuBLAS paths (weight gradients over a batch, batch x weight products).
//
// Why: at torch's default float32 matmul precision ("highest") cuBLAS runs
// a float32 product on the CUDA cores (SIMT sgemm, at most 128 FMA per clock
// per SM).  Three TF32 wgmma products per tile on operands split into TF32
// big and small parts (tf32x3.cuh: the error stays of the order of float32
// FMA's) have a tensor-core bound of about 300 float32-accurate
// multiply-adds per clock per SM.  Measured (bench/results/
// nvidia-h200-matmul-sweep.md) it is 1.04-1.67x cuBLAS's float32 products;
// under ncu the tensor pipes are busy about 37% of the time and shared
// memory up to 74%: every k-tile ends in a wgmma wait and a CTA barrier,
// and each operand plane is read three times (docs/matmul.md).
//
// Tile: a CTA of two warpgroups computes a 128 x 128 block of out
// (warpgroup w rows 64 w .. 64 w + 63, wgmma m64n128k8) and steps k by 32.
// The operands pass through registers: each thread loads 16 floats of A's
// and 16 of B's [128 x 32] tile with float4 loads along whichever axis is
// contiguous in memory, splits them and stores both planes in the
// core-matrix layout of wgmma.cuh.  Two shared-memory stages and two
// register sets: the loads of k-tile t + 2 and the split and stores of
// k-tile t + 1 overlap the products of k-tile t.  Lane maps (load_tile):
// a quarter-warp's 16-byte stores fall in distinct bank groups, and a
// warp's loads use whole 32-byte sectors.
//
// Split-K: when the output has fewer 128 x 128 tiles than half the SMs (a
// weight gradient over a batch: [784, 256] is 14 tiles), the k-tiles are
// split over blockIdx.z; each split stores its partial product to a
// workspace and a second kernel adds the partials in split order
// (deterministic, no atomics).  Shared memory: 2 stages x 4 planes x 16 KB.
//
// Epilogue (common/matmul.h's Epilogue: a hidden layer's bias, row bias and
// activation): under split-K the partials' add finishes each element
// (epilogue.cuh); an unsplit product is stored as it is and finished by one
// pass (epilogue.cu).  Finishing the tile in this kernel measured slower
// than that pass at short k (docs/matmul.md): with one CTA of 8 warps per
// SM, the activation's latency is not hidden.

#include <algorithm>

#include "cuda/matmul/epilogue.cuh"
#include "cuda/matmul/paths.cuh"
#include "cuda/primitives/tf32x3.cuh"
#include "cuda/primitives/wgmma.cuh"
#include "cuda/primitives/wgmma_stream.cuh"  // device_runs_sm90a

namespace fused_ops {
namespace cuda_matmul {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 128;                       // rows of A's and B's tiles (out's tile is kTile^2)
constexpr int kKTile = 32;                       // k per stage: four wgmma k-steps
constexpr int kPlane = kTile * kKTile;           // floats of one operand plane
constexpr int kStage = 4 * kPlane;               // A big, A small, B big, B small
constexpr size_t kSmemBytes = 2 * kStage * sizeof(float);

// An operand as the kernel reads it: element (r, k) at p[r * rs + k * ks],
// r < rows (m for A, n for B), k < K.
struct Operand {
  const float* p;
  int64_t rs, ks;
  int rows;
};

// Which axis is contiguous (the float4 loads' direction).
enum Layout { kKContig = 0, kRContig = 1 };

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Whether an operand of `rows` x K at (rs, ks) can be read by float4 loads
// along `layout`'s axis: unit stride there, the other stride and that axis's
// extent multiples of 4 (every float4 lies wholly in or out of the matrix),
// 16-byte alignment.
bool readable(const float* p, int64_t rs, int64_t ks, int64_t rows, int64_t K, Layout layout) {
  if (!aligned16(p)) return false;
  if (layout == kKContig) return ks == 1 && (rs % 4 == 0 || rows == 1) && K % 4 == 0;
  return rs == 1 && (ks % 4 == 0 || K == 1) && rows % 4 == 0;
}

#if defined(FUSED_OPS_WGMMA)

// Loads this thread's 16 floats of the [kTile x kKTile] tile at (r0, k0)
// into v (zero outside the matrix).  kKContig: float4 j of the thread is
// row (i & 7) + 8 (i >> 6), k-quad (i >> 3) & 7 for i = 256 j + tid -- a
// warp reads 8 rows x 64 bytes.  kRContig: the thread owns rows 4 rq ..
// 4 rq + 3 and k-quad kq, rq = lane % 8 + 8 (warp % 4), kq = lane / 8 + 4
// (warp / 4); v[kk] is the four rows at k = 4 kq + kk -- a warp reads 4 x
// 128 contiguous bytes per k.
template <int L>
__device__ __forceinline__ void load_tile(const Operand& op, int r0, int k0, int K, float4 (&v)[4]) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  if (L == kKContig) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 256 * j + tid;
      const int r = r0 + (i & 7) + 8 * (i >> 6), k = k0 + 4 * ((i >> 3) & 7);
      v[j] = (r < op.rows && k < K) ? __ldg(reinterpret_cast<const float4*>(op.p + r * op.rs + k)) : zero;
    }
  } else {
    const int r = r0 + 4 * (lane % 8 + 8 * (warp % 4));
    const int k = k0 + 4 * (lane / 8 + 4 * (warp / 4));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      v[kk] = (r < op.rows && k + kk < K)
                  ? __ldg(reinterpret_cast<const float4*>(op.p + (k + kk) * op.ks + r))
                  : zero;
  }
}

__device__ __forceinline__ void store_split(float* big, float* small, int off, float4 x) {
  const cuda::SplitTf32 a = cuda::split_tf32(x.x), b = cuda::split_tf32(x.y), c = cuda::split_tf32(x.z),
                        d = cuda::split_tf32(x.w);
  *reinterpret_cast<uint4*>(big + off) = make_uint4(a.big, b.big, c.big, d.big);
  *reinterpret_cast<uint4*>(small + off) = make_uint4(a.small, b.small, c.small, d.small);
}

// Offset of (row r, k) of a [kTile x kKTile] plane: k-step k / 8's block of
// kTile x 8, core-matrix layout within it; r, k with k % 4 == 0.
__device__ __forceinline__ int plane_offset(int r, int k) {
  return (k / 8) * (kTile * 8) + cuda::core_offset(r, k % 8);
}

// Splits the loaded tile into the stage's big and small planes, with
// load_tile's lane map.  kRContig: the thread transposes its 4 x 4 block
// in registers and stores one row's four k per 16-byte store; lane pair p
// (lane % 8 / 2) starts at row (p + i) % 4 in store i, which puts a
// quarter-warp's eight stores in distinct bank groups.
template <int L>
__device__ __forceinline__ void store_tile(const float4 (&v)[4], float* big, float* small) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (L == kKContig) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 256 * j + tid;
      store_split(big, small, plane_offset((i & 7) + 8 * (i >> 6), 4 * ((i >> 3) & 7)), v[j]);
    }
  } else {
    const int rq = lane % 8 + 8 * (warp % 4), kq = lane / 8 + 4 * (warp / 4);
    const int rot = (lane % 8) / 2;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int ii = (i + rot) & 3;
      float4 row;
      row.x = ii == 0 ? v[0].x : ii == 1 ? v[0].y : ii == 2 ? v[0].z : v[0].w;
      row.y = ii == 0 ? v[1].x : ii == 1 ? v[1].y : ii == 2 ? v[1].z : v[1].w;
      row.z = ii == 0 ? v[2].x : ii == 1 ? v[2].y : ii == 2 ? v[2].z : v[2].w;
      row.w = ii == 0 ? v[3].x : ii == 1 ? v[3].y : ii == 2 ? v[3].z : v[3].w;
      store_split(big, small, plane_offset(4 * rq + ii, 4 * kq), row);
    }
  }
}

#endif  // FUSED_OPS_WGMMA

// out (or split z's partial in ws, [M, N] row-major) = A[M, K] B[K, N] over
// k-tiles [z kt_per, (z + 1) kt_per).  Grid (ceil(N / 128), ceil(M / 128),
// splits), kThreads threads, kSmemBytes of dynamic shared memory.
template <int LA, int LB>
__global__ void __launch_bounds__(kThreads, 1)
    matmul_tf32x3_kernel(const Operand a, const Operand b, float* out, int64_t ldo, int K, int kt_per,
                         float* ws) {
#if defined(FUSED_OPS_WGMMA)
  extern __shared__ __align__(128) float smem[];
  const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32 % 4, lane = tid % 32;
  const int m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;
  const int nk = (K + kKTile - 1) / kKTile;
  const int kt0 = blockIdx.z * kt_per, kt1 = min(nk, kt0 + kt_per);

  // Two-level accumulation: the tensor core adds into its float32
  // accumulator without rounding to nearest (it truncates the aligned sum),
  // an error that grows with the number of k-steps summed into one
  // accumulator and leans one way.  Each k-tile's 12 products go into a
  // fresh `part` (the first with scale-d 0, so nothing zeroes it), which is
  // then added to `acc` by round-to-nearest FADDs.
  float acc[64], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;

  // Register sets of raw tiles: while stage s computes k-tile t, set s
  // receives k-tile t + 2 and set s ^ 1 (k-tile t + 1, loaded one step
  // earlier) is split into the other stage -- a whole step of products
  // hides each load's latency.
  float4 va[2][4], vb[2][4];
  load_tile<LA>(a, m0, kt0 * kKTile, K, va[0]);
  load_tile<LB>(b, n0, kt0 * kKTile, K, vb[0]);
  if (kt0 + 1 < kt1) {
    load_tile<LA>(a, m0, (kt0 + 1) * kKTile, K, va[1]);
    load_tile<LB>(b, n0, (kt0 + 1) * kKTile, K, vb[1]);
  }
  store_tile<LA>(va[0], smem, smem + kPlane);
  store_tile<LB>(vb[0], smem + 2 * kPlane, smem + 3 * kPlane);
  cuda::fence_proxy_async();
  __syncthreads();

  for (int kt2 = kt0; kt2 < kt1; kt2 += 2) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {  // s: the stage (and register set) of k-tile kt
      const int kt = kt2 + s;
      if (kt >= kt1) break;  // uniform over the CTA
      float* const cur = smem + s * kStage;
      float* const nxt = smem + (s ^ 1) * kStage;
      cuda::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kKTile / 8; ++ks) {
        const float* ap = cur + ks * kTile * 8 + cuda::core_offset(64 * wg, 0);
        const float* bp = cur + 2 * kPlane + ks * kTile * 8;
        cuda::wgmma_3xtf32<kTile>(part, cuda::wgmma_desc(ap), cuda::wgmma_desc(ap + kPlane),
                                  cuda::wgmma_desc(bp), cuda::wgmma_desc(bp + kPlane), ks > 0);
      }
      cuda::wgmma_commit();
      if (kt + 2 < kt1) {  // set s was stored to this stage one step ago
        load_tile<LA>(a, m0, (kt + 2) * kKTile, K, va[s]);
        load_tile<LB>(b, n0, (kt + 2) * kKTile, K, vb[s]);
      }
      if (kt + 1 < kt1) {  // the other stage: its products finished before the last barrier
        store_tile<LA>(va[s ^ 1], nxt, nxt + kPlane);
        store_tile<LB>(vb[s ^ 1], nxt + 2 * kPlane, nxt + 3 * kPlane);
      }
      cuda::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] += part[i];
      cuda::fence_proxy_async();
      __syncthreads();
    }
  }

  // Accumulator (wgmma.cuh): d[4 j + i] is row 16 warp + lane / 4 + 8 (i >= 2),
  // column 8 j + 2 (lane % 4) + (i & 1) of the warpgroup's 64 x 128 block.
  const int M = a.rows, N = b.rows;
  float* dst = out;
  int64_t ld = ldo;
  if (ws) {
    dst = ws + int64_t(blockIdx.z) * M * N;
    ld = N;
  }
  const bool pairs = (ld % 2 == 0) && ((reinterpret_cast<uintptr_t>(dst) & 7) == 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = m0 + 64 * wg + 16 * warp + lane / 4 + 8 * h;
    if (r >= M) continue;
    float* row = dst + r * ld;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = n0 + 8 * j + 2 * (lane % 4);
      const float x = acc[4 * j + 2 * h], y = acc[4 * j + 2 * h + 1];
      if (pairs && c + 1 < N) {
        *reinterpret_cast<float2*>(row + c) = make_float2(x, y);
      } else {
        if (c < N) row[c] = x;
        if (c + 1 < N) row[c + 1] = y;
      }
    }
  }
#else
  __trap();  // launched only where the sm_90a code was built (FUSED_OPS_SM90A)
#endif
}

// out[r, c] = sum over z of ws[z][r, c], z in order, then the epilogue e.
__global__ void add_splits_kernel(const float* ws, int splits, float* out, int64_t ldo, int M, int N,
                                  const Epilogue e) {
  const int64_t n = int64_t(M) * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float s = ws[i];
    for (int z = 1; z < splits; ++z) s += ws[z * n + i];
    const int c = int(i % N);
    const int64_t o = (i / N) * ldo + c;
    if (e.on) {
      finish(e, s, column_bias(e, c), o, out);
    } else {
      out[o] = s;
    }
  }
}

// A and B as the kernel reads them: A (m x k) as rows m, B (k x n) as rows n.
Operand operand_a(const Call& c) { return {c.a, c.a_rs, c.a_cs, int(c.m)}; }
Operand operand_b(const Call& c) { return {c.b, c.b_cs, c.b_rs, int(c.n)}; }

bool layout_of(const Operand& o, int64_t K, Layout* out) {
  for (Layout l : {kKContig, kRContig}) {
    if (readable(o.p, o.rs, o.ks, o.rows, K, l)) {
      *out = l;
      return true;
    }
  }
  return false;
}

template <int LA, int LB>
void launch(const Call& c, const Operand& a, const Operand& b) {
  const auto kernel = matmul_tf32x3_kernel<LA, LB>;
  cuda::allow_dynamic_smem(kernel, kSmemBytes);
  const cudaStream_t stream = cuda::current_stream(c.device);
  const int64_t tiles_m = (c.m + kTile - 1) / kTile, tiles_n = (c.n + kTile - 1) / kTile;
  const int64_t nk = (c.k + kKTile - 1) / kKTile;
  // Split K when the tiles fill less than half the SMs: as many splits as
  // fill one wave, each of at least 4 k-tiles.
  const int64_t sms = cuda::multiprocessor_count(c.device);
  int64_t splits = 1;
  if (2 * tiles_m * tiles_n <= sms) splits = std::max<int64_t>(1, std::min(sms / (tiles_m * tiles_n), nk / 4));
  const int64_t per = (nk + splits - 1) / splits;
  splits = (nk + per - 1) / per;  // no empty split
  Tensor ws;
  float* wsp = nullptr;
  if (splits > 1) {
    ws = cuda_workspace(c.device, splits * c.m * c.n);
    wsp = mdata<float>(ws);
  }
  kernel<<<dim3(unsigned(tiles_n), unsigned(tiles_m), unsigned(splits)), kThreads, kSmemBytes, stream>>>(
      a, b, c.out, c.ldo, int(c.k), int(per), wsp);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  if (splits > 1) {
    const int64_t blocks = std::min<int64_t>((c.m * c.n + 255) / 256, 4 * sms);
    add_splits_kernel<<<unsigned(blocks), 256, 0, stream>>>(wsp, int(splits), c.out, c.ldo, int(c.m), int(c.n),
                                                            c.epilogue);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  } else if (c.epilogue.on) {
    launch_epilogue(c);
  }
}

}  // namespace

bool tf32x3_can_run(const Call& c) {
#if defined(FUSED_OPS_SM90A)
  Layout la, lb;
  return c.m >= 1 && c.n >= 1 && c.k >= 1 && c.m < (1 << 30) && c.n < (1 << 30) && c.k < (1 << 30) &&
         c.m * c.n < (int64_t(1) << 31) && layout_of(operand_a(c), c.k, &la) && layout_of(operand_b(c), c.k, &lb) &&
         cuda::wgs::device_runs_sm90a() && kSmemBytes <= cuda::max_shared_memory_per_block();
#else
  (void)c;
  return false;
#endif
}

void launch_tf32x3(const Call& c) {
  const Operand a = operand_a(c), b = operand_b(c);
  Layout la = kKContig, lb = kKContig;
  layout_of(a, c.k, &la);
  layout_of(b, c.k, &lb);
  if (la == kKContig && lb == kKContig) launch<kKContig, kKContig>(c, a, b);
  else if (la == kKContig) launch<kKContig, kRContig>(c, a, b);
  else if (lb == kKContig) launch<kRContig, kKContig>(c, a, b);
  else launch<kRContig, kRContig>(c, a, b);
}

}  // namespace cuda_matmul
}  // namespace fused_ops
