// \brief Block-level building blocks for persistent (grid-synchronised) kernels that
// run a chain of small matrix products in ONE launch: a block computes one
// 32 x 32 tile of C = A @ B and hands every element to an epilogue functor,
// or one 32-column strip of a column sum.  A phase is a list of such jobs; its
// units (tiles, strips) are dealt to the blocks round-robin.
//
// Why not cuBLAS: at training batch sizes of a few hundred rows the products
// are tens of microseconds of GPU work, and each one costs a host-side call
// through the dispatcher plus a launch; the whole chain in one cooperative
// launch removes both (vae_elbo's backward, csrc/cuda/vae_elbo/).
//
// Numerics: plain FMA in T (float32 or float64), no tensor cores, each output
// summed over k in increasing order: results do not depend on the grid size
// and are bitwise reproducible.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/primitives/int_divider.cuh"

namespace fused_ops {
namespace cuda {

constexpr int kTileThreads = 256;  // blocks of the persistent kernels using this header
constexpr int kTile = 32;          // C tile edge
constexpr int kTileK = 32;         // K slice per shared-memory stage

// A strided matrix: element (r, c) at p[r * rs + c * cs].  Transposes and
// column ranges of row-major buffers are views, no copies.
template <typename T>
struct MatView {
  const T* p;
  int64_t rs, cs;
};

template <typename T>
struct TileSmem {
  // [k][m] and [k][n]: the inner loop reads a row of each.  The +1 column
  // keeps stores conflict-free when consecutive threads walk k.
  T a[kTileK][kTile + 1];
  T b[kTileK][kTile + 1];
};

template <typename T>
union PhaseSmem {
  TileSmem<T> tile;
  double colsum[kTileThreads / kTile][kTile];
};

// Number of 32 x 32 tiles covering an m x n matrix.
__host__ __device__ inline int64_t tile_count(int64_t m, int64_t n) {
  return ((m + kTile - 1) / kTile) * ((n + kTile - 1) / kTile);
}

// C[m, n] = sum_k A[m, k] B[k, n] for an M x N matrix; epi(m, n, value) is
// called once per element.  `Epi` is a functor with
//   __device__ void operator()(int64_t m, int64_t n, T value) const.
template <typename T, typename Epi>
struct GemmJob {
  MatView<T> a, b;  // A [M, K], B [K, N]
  int64_t M, N, K;
  Epi epi;

  __device__ int64_t units() const { return tile_count(M, N); }

  // Tile `unit` (row-major over tiles).  Whole-block call: all threads must
  // enter (it synchronises the block).
  __device__ void run(int64_t unit, PhaseSmem<T>& smem) const {
    TileSmem<T>& s = smem.tile;
    const int64_t tiles_n = (N + kTile - 1) / kTile;
    const int64_t m0 = (unit / tiles_n) * kTile, n0 = (unit % tiles_n) * kTile;
    const int tid = threadIdx.x;
    // Stage loads: element e = tid + 256 j of the 32 x 32 slice; the
    // coordinate along the unit-stride axis varies fastest, so a warp reads
    // 32 consecutive elements (coalesced) whichever way the view is laid out.
    const bool a_k_fast = a.cs == 1, b_n_fast = b.cs == 1;
    constexpr int kPerThread = kTile * kTileK / kTileThreads;  // 4
    T ra[kPerThread], rb[kPerThread];
    auto load = [&](int64_t k0) {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int e = tid + kTileThreads * j, fast = e % 32, slow = e / 32;
        const int am = a_k_fast ? slow : fast, ak = a_k_fast ? fast : slow;
        const int64_t gm = m0 + am, gk = k0 + ak;
        ra[j] = (gm < M && gk < K) ? a.p[gm * a.rs + gk * a.cs] : T(0);
        const int bn = b_n_fast ? fast : slow, bk = b_n_fast ? slow : fast;
        const int64_t gn = n0 + bn, gkb = k0 + bk;
        rb[j] = (gn < N && gkb < K) ? b.p[gkb * b.rs + gn * b.cs] : T(0);
      }
    };
    auto store = [&]() {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int e = tid + kTileThreads * j, fast = e % 32, slow = e / 32;
        if (a_k_fast) s.a[fast][slow] = ra[j]; else s.a[slow][fast] = ra[j];
        if (b_n_fast) s.b[slow][fast] = rb[j]; else s.b[fast][slow] = rb[j];
      }
    };
    // Thread (ty, tx) owns rows 2 ty, 2 ty + 1 and columns tx, tx + 16.
    const int ty = tid / 16, tx = tid % 16;
    T acc00 = 0, acc01 = 0, acc10 = 0, acc11 = 0;
    load(0);
    for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
      store();
      __syncthreads();
      if (k0 + kTileK < K) load(k0 + kTileK);  // next stage's global loads overlap the FMAs
#pragma unroll 8
      for (int k = 0; k < kTileK; ++k) {
        const T a0 = s.a[k][2 * ty], a1 = s.a[k][2 * ty + 1];
        const T b0 = s.b[k][tx], b1 = s.b[k][tx + 16];
        acc00 = fma(a0, b0, acc00);
        acc01 = fma(a0, b1, acc01);
        acc10 = fma(a1, b0, acc10);
        acc11 = fma(a1, b1, acc11);
      }
      __syncthreads();
    }
    const int64_t r0 = m0 + 2 * ty, c0 = n0 + tx;
    if (r0 < M) {
      if (c0 < N) epi(r0, c0, acc00);
      if (c0 + 16 < N) epi(r0, c0 + 16, acc01);
    }
    if (r0 + 1 < M) {
      if (c0 < N) epi(r0 + 1, c0, acc10);
      if (c0 + 16 < N) epi(r0 + 1, c0 + 16, acc11);
    }
  }
};

// The plain epilogue: C[m, n] = value, row stride ldc (a weight gradient).
template <typename T>
struct StoreEpilogue {
  T* c;
  int64_t ldc;
  __device__ void operator()(int64_t m, int64_t n, T v) const { c[m * ldc + n] = v; }
};

// A tile epilogue applied to a matrix already in memory (the product came
// from cuBLAS): epi(r, c, v[r * ldv + c]) for r < rows, c < cols, one thread
// per element, so an epilogue may overwrite the element it reads.  The
// persistent and the cuBLAS paths of a backward op thus share one copy of
// each elementwise stage's arithmetic.
// Below 2^31 elements the flat index is split into (row, column) by a
// host-prepared divider (a multiply-high and a shift) instead of a 64-bit
// division, which costs more than a cheap epilogue's own arithmetic.
template <typename T, typename Epi>
__global__ void __launch_bounds__(kTileThreads)
    apply_epilogue_kernel(const T* v, int64_t ldv, int64_t rows, int64_t cols, IntDivider by_cols, Epi epi) {
  const int64_t total = rows * cols;
  if (total < (int64_t(1) << 31)) {  // uniform: the divider's range
    const unsigned n = unsigned(total), stride = gridDim.x * blockDim.x;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
      unsigned r, c;
      by_cols.divmod(i, r, c);
      epi(int64_t(r), int64_t(c), v[int64_t(r) * ldv + c]);
    }
    return;
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    epi(r, c, v[r * ldv + c]);
  }
}

template <typename T, typename Epi>
void apply_epilogue(cudaStream_t stream, const T* v, int64_t ldv, int64_t rows, int64_t cols, Epi epi) {
  const int64_t blocks = (rows * cols + kTileThreads - 1) / kTileThreads;
  const unsigned grid = unsigned(blocks < 1 ? 1 : (blocks > 8192 ? 8192 : blocks));
  const IntDivider by_cols(cols >= 1 && cols < (int64_t(1) << 31) ? unsigned(cols) : 1u);
  apply_epilogue_kernel<T, Epi><<<grid, kTileThreads, 0, stream>>>(v, ldv, rows, cols, by_cols, epi);
}

template <typename T, typename Epi>
__device__ GemmJob<T, Epi> gemm_job(MatView<T> a, MatView<T> b, int64_t M, int64_t N, int64_t K,
                                    Epi epi) {
  return {a, b, M, N, K, epi};
}

// Row weight 1 of a plain column sum.
struct Unweighted {
  __device__ double operator()(int64_t) const { return 1.0; }
};

// out[j * out_stride] = sum_r weight(r) in[r * ld + j] for j < n over `rows`
// rows (bias gradients; a weighted sum for a time-feature column).  A unit
// is 32 columns: 8 row groups sum in double, then one fixed-order pass adds
// the 8 partials; no atomics, so reproducible.
template <typename T, typename Weight = Unweighted>
struct ColumnSumJob {
  const T* in;
  int64_t ld, n, rows;
  T* out;
  int64_t out_stride = 1;
  Weight weight = {};

  __device__ int64_t units() const { return (n + kTile - 1) / kTile; }

  __device__ void run(int64_t unit, PhaseSmem<T>& smem) const {
    constexpr int kGroups = kTileThreads / kTile;
    const int col = threadIdx.x % kTile, group = threadIdx.x / kTile;
    const int64_t j = unit * kTile + col;
    double acc = 0;
    if (j < n)
      for (int64_t r = group; r < rows; r += kGroups) acc += weight(r) * double(in[r * ld + j]);
    smem.colsum[group][col] = acc;
    __syncthreads();
    if (group == 0 && j < n) {
      double total = 0;
      for (int g = 0; g < kGroups; ++g) total += smem.colsum[g][col];
      out[j * out_stride] = T(total);
    }
    __syncthreads();  // the next unit reuses the shared memory
  }
};

// Runs every unit of `jobs` (GemmJob / ColumnSumJob), unit u on block
// u mod gridDim.x.  Whole-block call.
template <typename T, typename... Jobs>
__device__ void run_phase(PhaseSmem<T>& smem, const Jobs&... jobs) {
  const int64_t total = (jobs.units() + ...);
  for (int64_t u = blockIdx.x; u < total; u += gridDim.x) {
    int64_t rest = u;
    // Left to right, the first job whose range holds `rest` runs it (|| stops there).
    (void)(((rest < jobs.units()) ? (jobs.run(rest, smem), true) : (rest -= jobs.units(), false)) ||
           ...);
  }
}

// What a persistent kernel's phases share: run_phase's shared memory, the
// grid barrier between phases, and the grid-stride range of the elementwise
// loops between them (i = tid; i < n; i += nthreads).  One definition, so
// the kernels using this header cannot drift apart in how they set it up:
//   const auto [smem, grid, tid, nthreads] = cuda::phase_context<T>();
template <typename T>
struct PhaseContext {
  PhaseSmem<T>& smem;
  cooperative_groups::grid_group grid;
  int64_t tid, nthreads;
};

template <typename T>
__device__ __forceinline__ PhaseContext<T> phase_context() {
  // A __shared__ variable in a function is static: every call in a block
  // gets the same storage, as if declared in the kernel.
  __shared__ PhaseSmem<T> smem;
  return {smem, cooperative_groups::this_grid(), blockIdx.x * int64_t(blockDim.x) + threadIdx.x,
          int64_t(gridDim.x) * blockDim.x};
}

}  // namespace cuda
}  // namespace fused_ops
