// \brief One Linear layer of a small batch spread over a thread-block
// cluster (sm_90): the fused-MLP core of the cluster paths of flow_euler
// (cuda/flow_euler/cluster.cu: SiLU with a time column, the Euler update)
// and ode_mlp (cuda/ode_mlp/cluster.cu: any activation, the Runge-Kutta
// stages), which differ only in the epilogue, a functor here.
//
// Scheme.  A cluster of C blocks (8 or 16) of kClusterThreads threads; block
// r owns the neurons [r*n, (r+1)*n) of a layer (n = ceil(width / C)) and
// keeps those neurons' weight rows in its shared memory for the whole launch.
// Every block holds a full copy of the layer input ([rows][ld_in] floats,
// rows = the batch rounded up to 8, ld_in >= the input width, a multiple of
// 4, zero past the true width).  cluster_layer:
//   1. partial dot products, one (neuron j, k-segment s, 8-row chunk) item
//      per thread (ClusterLayer: the split), the weight float4 kept in
//      registers across the chunk's 8 rows;
//   2. each output's segments summed in a fixed order (bitwise
//      reproducible), then the epilogue (bias, activation, ...) into `stage`;
//   3. the block's slice [rows][n] pushed into every block's copy of the
//      output (distributed shared memory stores, float4 runs when n % 4 == 0).
// The caller's cluster barrier then publishes the pushes; it must also make
// sure no block still reads the buffer the pushes overwrite (one barrier
// between the buffer's last reader and the push suffices).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/primitives/int_divider.cuh"
#include "cuda/primitives/reductions.cuh"

namespace fused_ops {
namespace cuda {
namespace cluster_mlp {

constexpr int kClusterThreads = 256;
// Most rows a launch handles: 4 chunks of 8 rows; the partial sums of a
// thread are 8 registers, the work split assumes few chunks.
constexpr int kClusterMaxRows = 32;
// Activation rows hold at least the C * n columns the pushes of a layer of
// n neurons per block write (C * ceil(N / C) >= N, zero past N), a multiple
// of 4 floats (float4 reads): then a push needs no per-block width.

inline int round_up(int v, int m) { return (v + m - 1) / m * m; }

// Weight rows in shared memory are 4 floats longer than the activation rows:
// for ld a multiple of 8, (ld + 4) / 4 is odd, so the 8 lanes of a
// quarter-warp that read float4s of 8 consecutive neurons' rows at the same
// k hit 8 distinct bank quads (a multiple of 16 would put them in 2).
__host__ __device__ inline int weight_ld(int ld) { return ld + 4; }

// How one layer's work is cut, fixed for the launch (host-computed; the
// dividers turn the flat thread index into coordinates without a
// ~20-instruction integer division in every layer of every step).
//   dot products: items (neuron j, k-segment s, 8-row chunk), j fastest, one
//     per thread where possible: segments of `seg` floats (a multiple of 4),
//     doubled from 4 until the items fit the block's threads, so that short
//     layers still spread over all warps;
//   partial sums: [segment][row][neuron], segment stride s_stride (rows * n
//     rounded up to 32 / 2^log_parts mod 32, so a warp's finalisation reads
//     hit 32 distinct banks);
//   finalisation: 2^log_parts lanes per output each sum every 2^log_parts-th
//     segment, then a butterfly over those lanes (a fixed order);
//   exchange: the [rows][n] slice is pushed as `per_row` vectors per row
//     (float4s when n % 4 == 0, else floats), `per_dst` to each block.
struct ClusterLayer {
  int n, ld_in, seg, nseg, s_stride, log_parts, vec4;
  IntDivider by_n, by_nseg, by_per_row, by_per_dst;
  int partial_floats() const { return nseg * s_stride; }
};

// The work split of a layer with n neurons per block, input rows of ld_in
// floats (a multiple of 4) and `rows` rows (a multiple of 8).
inline ClusterLayer cluster_layer_geometry(int n, int ld_in, int rows) {
  ClusterLayer g{};
  g.n = n;
  g.ld_in = ld_in;
  const int chunks = rows / 8;
  auto segments = [&](int seg) { return (ld_in + seg - 1) / seg; };
  g.seg = 4;
  while (g.seg < ld_in && n * segments(g.seg) * chunks > kClusterThreads) g.seg *= 2;
  g.nseg = segments(g.seg);
  const int outputs = rows * n;
  g.log_parts = 0;
  while ((2 << g.log_parts) <= std::min(kWarpSize, g.nseg) && (outputs << (g.log_parts + 1)) <= kClusterThreads) {
    ++g.log_parts;
  }
  const int lanes_per_part = kWarpSize >> g.log_parts;  // outputs one warp finalises
  g.s_stride = outputs + ((lanes_per_part - outputs) % kWarpSize + kWarpSize) % kWarpSize;
  g.vec4 = n % 4 == 0;
  const int per_row = g.vec4 ? n / 4 : n;
  g.by_n = IntDivider(unsigned(n));
  g.by_nseg = IntDivider(unsigned(g.nseg));
  g.by_per_row = IntDivider(unsigned(per_row));
  g.by_per_dst = IntDivider(unsigned(rows * per_row));
  return g;
}

// dst[r, k] (row stride ld, total_rows rows) = src[r, k] (row stride src_ld)
// for r < nrows and k < ncols, else 0; all threads of the block cooperate.
// Eight loads in flight per thread: the one-off staging of a persistent
// kernel is otherwise a chain of dependent L2 round trips.  src is not
// dereferenced when nrows or ncols is 0.
__device__ __forceinline__ void stage_rows(float* dst, int total_rows, int ld, const float* src, int64_t src_ld,
                                           int nrows, int ncols) {
  constexpr int kUnroll = 8;
  const int n = total_rows * ld;
  for (int base = 0; base < n; base += kClusterThreads * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kClusterThreads + int(threadIdx.x);
      const int r = i / ld, k = i - r * ld;
      v[u] = (i < n && r < nrows && k < ncols) ? src[r * src_ld + k] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kClusterThreads + int(threadIdx.x);
      if (i < n) dst[i] = v[u];
    }
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// One layer.  `in`: this block's full copy of the input ([rows][g.ld_in],
// zero past the true width); `w`: its weight rows ([g.n][weight_ld(g.ld_in)],
// zero past the true width and for neurons past the layer's width).  The
// value for (row, first_neuron + j), j < g.n, is epi(o, row, j, sum) with o =
// row * g.n + j the index into `stage`, and goes to `out[row * ld_out +
// first_neuron + j]` of every block of the cluster (this one's included).
// `partial` holds g.partial_floats() floats, `stage` rows * g.n.  Called by
// all threads of every block; block barriers between the stages, none at the
// end (the caller's cluster barrier follows).
template <typename Epilogue>
__device__ __forceinline__ void cluster_layer(cooperative_groups::cluster_group& cluster, int num_blocks,
                                              const ClusterLayer& g, const float* in, const float* w,
                                              int first_neuron, float* out, int ld_out, int rows,
                                              float* partial, float* stage, const Epilogue& epi) {
  const int n = g.n, ld_in = g.ld_in, wld = weight_ld(ld_in);
  const unsigned tid = threadIdx.x;
  const unsigned items = unsigned(n * g.nseg * (rows / 8));
  for (unsigned item = tid; item < items; item += kClusterThreads) {
    unsigned j, rest, s, chunk;
    g.by_n.divmod(item, rest, j);
    g.by_nseg.divmod(rest, chunk, s);
    const float* wrow = w + j * wld;
    const float* irow = in + chunk * 8 * ld_in;
    const int k_end = min(int(s + 1) * g.seg, ld_in);
    float acc[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[r] = 0.f;
#pragma unroll 4
    for (int k = int(s) * g.seg; k < k_end; k += 4) {
      const float4 wv = *reinterpret_cast<const float4*>(wrow + k);
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const float4 v = *reinterpret_cast<const float4*>(irow + r * ld_in + k);
        acc[r] = fmaf(wv.x, v.x, acc[r]);
        acc[r] = fmaf(wv.y, v.y, acc[r]);
        acc[r] = fmaf(wv.z, v.z, acc[r]);
        acc[r] = fmaf(wv.w, v.w, acc[r]);
      }
    }
    float* p = partial + s * g.s_stride + (chunk * 8) * n + j;
#pragma unroll
    for (int r = 0; r < 8; ++r) p[r * n] = acc[r];
  }
  __syncthreads();
  // Every thread runs every round (the butterfly needs whole warps); groups
  // of 2^log_parts lanes never straddle a warp.
  const int parts = 1 << g.log_parts;
  const unsigned slots = unsigned(rows * n) << g.log_parts;
  for (unsigned base = 0; base < slots; base += kClusterThreads) {
    const unsigned idx = base + tid;
    const unsigned o = idx >> g.log_parts;
    const int part = int(idx) & (parts - 1);
    float sum = 0.f;
    if (idx < slots) {
      for (int s = part; s < g.nseg; s += parts) sum += partial[s * g.s_stride + o];
    }
    for (int off = parts / 2; off > 0; off /= 2) sum += __shfl_xor_sync(kFullMask, sum, off);
    if (idx < slots && part == 0) {
      unsigned row, j;
      g.by_n.divmod(o, row, j);
      stage[o] = epi(o, row, j, sum);
    }
  }
  __syncthreads();
  const unsigned pushes = unsigned(num_blocks) * g.by_per_dst.divisor;
  for (unsigned i = tid; i < pushes; i += kClusterThreads) {
    unsigned dst, rem, row, q;
    g.by_per_dst.divmod(i, dst, rem);
    g.by_per_row.divmod(rem, row, q);
    if (g.vec4) {
      const float4 v = reinterpret_cast<const float4*>(stage + row * n)[q];
      float* remote = cluster.map_shared_rank(out + row * ld_out + first_neuron, int(dst));
      reinterpret_cast<float4*>(remote)[q] = v;
    } else {
      *cluster.map_shared_rank(out + row * ld_out + first_neuron + q, int(dst)) = stage[rem];
    }
  }
}
#endif

}  // namespace cluster_mlp
}  // namespace cuda
}  // namespace fused_ops
