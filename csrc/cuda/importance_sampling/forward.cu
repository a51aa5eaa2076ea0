// CUDA kernel of fused_ops::importance_sampling: one cooperative launch.
//
// Phase 1  Each sample row is handled by a group of G lanes (a power of two,
//          as few as hold the row in <= 16 registers each: one thread per
//          sample for D <= 16) that read it with vectorised loads; the group
//          reduces the K mixture terms and the proposal term to the log
//          weight lw.  Few lanes per row means little redundant exp/log work.  Every group keeps an online-softmax state over the
//          samples it visits (running max m, sum e, sum e^2 and sum e*x with
//          e = exp(lw - m)), so x is read from memory exactly once.  Groups
//          merge into one partial per block, written to a workspace.
// Phase 2  After a grid barrier every block merges the per-block (max, sum)
//          pairs in the same fixed order (so all blocks agree bitwise on the
//          normaliser), normalises its share of log_weights, and the
//          weighted-mean / ESS sums are spread over blocks by dimension.
//
// No atomics: every reduction has a fixed order, so results are bitwise
// reproducible for a given device and input size.
//
// Fast path: the prepared mixture parameters (mu, 1/std, log-normalisers) sit
// in shared memory and each lane holds its slice of a row (<= 16 elements) in
// registers, so D <= 512 and small enough K*D.  Anything else takes the
// general path: parameters prepared once into global memory (an extra grid
// barrier), rows re-read from L1/L2 for each component, and per-group
// weighted sums kept in a global workspace.

#include <cooperative_groups.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <climits>

#include "common/logsumexp.h"
#include "cuda/primitives/cooperative.cuh"
#include "cuda/primitives/reductions.cuh"
#include "importance_sampling.h"

namespace fused_ops {
namespace {

using cuda::Vec;
namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / cuda::kWarpSize;
// Row elements a lane keeps in registers on the fast path.  16 keeps register
// use near 100 per thread (the row slice plus its weighted-sum accumulators).
constexpr int kLaneElems = 16;
constexpr int kMaxFastD = cuda::kWarpSize * kLaneElems;
// Fast path only while its shared memory leaves room for two blocks per SM.
constexpr size_t kMaxFastSmem = 96 * 1024;

template <typename T>
struct Args {
  const T* x;            // [N, D]
  const T* mix_weights;  // [K]
  const T* mix_mus;      // [K, D]
  const T* mix_stds;     // [K, D]
  const T* q_mu;         // [D]
  const T* q_std;        // [D]
  int64_t N;
  int D, K;
  int group_size;        // lanes per sample row
  T* weighted_mean;      // [D]
  T* ess;                // []
  T* log_weights;        // [N]
  // Workspace (no initialisation needed: every entry is written before it is read).
  LogSumExp<T>* block_lse;  // [grid]      per-block (max, sum exp(lw - max))
  T* block_sum_sq;          // [grid]      per-block sum exp(2 (lw - max))
  T* block_wsum;            // [D, grid]   per-block sum exp(lw - max) x, block-minor
  T* prepared;              // general path: 1/std [K*D], q 1/std [D], log-normalisers [K+1]
  T* group_wsum;            // general path: per-group sum exp(lw - m) x, [groups, D]
};

// Mixture parameters in the form the inner loop wants: z = (x - mu) * inv_std,
// log-normaliser log w_k - sum_d log std_kd (index K: the proposal's, -sum_d log q_std_d).
template <typename T>
struct Prepared {
  const T* mu;
  const T* inv_std;
  const T* q_mu;
  const T* q_inv_std;
  const T* log_norm;  // [K + 1]
};

// Fills inv_std / q_inv_std / log_norm (and copies mu / q_mu when given
// destinations), split over `num_threads` cooperating threads with index `tid`.
// Rows are stored `stride` >= D apart; the padding is zero (mu = inv_std = 0
// makes a zero-padded x contribute exactly 0), which lets the fast kernel read
// whole chunks without bounds checks.  Each log-normaliser is summed by one
// warp in a fixed order.
template <typename T>
__device__ void prepare_parameters(const Args<T>& a, int stride, T* mu, T* inv_std, T* q_mu,
                                   T* q_inv_std, T* log_norm, int64_t tid, int64_t num_threads) {
  const int D = a.D;
  for (int64_t j = tid; j < int64_t(a.K + 1) * stride; j += num_threads) {
    const int64_t k = j / stride;
    const int d = int(j - k * stride);
    const bool is_q = k == a.K, inside = d < D;
    const T sd = inside ? (is_q ? a.q_std[d] : a.mix_stds[k * D + d]) : T(0);
    const T inv = inside ? T(1) / sd : T(0);
    (is_q ? q_inv_std[d] : inv_std[j]) = inv;
    if (mu) (is_q ? q_mu[d] : mu[j]) = inside ? (is_q ? a.q_mu[d] : a.mix_mus[k * D + d]) : T(0);
  }
  const int lane = threadIdx.x % cuda::kWarpSize;
  for (int64_t k = tid / cuda::kWarpSize; k <= a.K; k += num_threads / cuda::kWarpSize) {
    const T* stds = k < a.K ? a.mix_stds + k * D : a.q_std;
    T log_det = 0;
    for (int d = lane; d < D; d += cuda::kWarpSize) log_det += std::log(stds[d]);
    log_det = cuda::group_allreduce(log_det, cuda::kWarpSize);
    if (lane == 0) log_norm[k] = (k < a.K ? std::log(a.mix_weights[k]) : T(0)) - log_det;
  }
}

// Online-softmax state of one group (lanes hold their own slices of wsum).
template <typename T>
struct GroupState {
  T max = -INFINITY, sum = 0, sum_sq = 0;

  // Adds a sample with log weight lw; returns the factor to rescale the
  // running weighted sums by, and the sample's own weight in `e`.
  // One exp per sample, as in LogSumExp::push.
  __device__ __forceinline__ T push(T lw, T& e) {
    const bool up = lw > max;
    const T f = rel_exp(up ? max : lw, up ? lw : max);
    const T scale = up ? f : T(1);
    e = up ? T(1) : f;
    sum = sum * scale + e;
    sum_sq = sum_sq * scale * scale + e * e;
    max = up ? lw : max;
    return scale;
  }
};

// Shared memory of one block: the merge of its groups' states.
template <typename T>
struct BlockScratch {
  T* group_max;     // [groups]
  T* group_sum;     // [groups]
  T* group_sum_sq;  // [groups]
  T* group_scale;   // [groups] exp(group max - block max)
};

// Merges the groups' states into the block's partial (workspace), given each
// group's weighted sums through `group_wsum(g, d)`.  `partial` holds blockDim.x
// values.
template <typename T, typename GroupWsum>
__device__ void write_block_partial(const Args<T>& a, const BlockScratch<T>& s, int groups,
                                    GroupWsum group_wsum, T* reduce_t, LogSumExp<T>* reduce_lse,
                                    T* partial) {
  const int tid = threadIdx.x, D = a.D;
  LogSumExp<T> mine = LogSumExp<T>::empty();
  if (tid < groups) mine = {s.group_max[tid], s.group_sum[tid]};
  const LogSumExp<T> block = cuda::block_allreduce(mine, reduce_lse, cuda::MergeLogSumExp{});
  T sq = 0;
  if (tid < groups) {
    const T f = rel_exp(s.group_max[tid], block.max);
    s.group_scale[tid] = f;
    sq = s.group_sum_sq[tid] * f * f;
  }
  sq = cuda::block_allreduce(sq, reduce_t);  // its barriers also publish group_scale
  // Weighted sums over the groups.  For short rows the groups are split into R
  // slices so that every thread works (D = 16: 16 slices of 16 groups), then
  // the slices are added in order.
  const int R = (D > 0 && D < int(blockDim.x)) ? std::min(groups, int(blockDim.x) / D) : 1;
  const int64_t out = int64_t(blockIdx.x);
  if (R == 1) {
    for (int d = tid; d < D; d += blockDim.x) {
      T acc = 0;
      for (int g = 0; g < groups; ++g) acc += group_wsum(g, d) * s.group_scale[g];
      a.block_wsum[int64_t(d) * gridDim.x + out] = acc;
    }
  } else {
    if (tid < R * D) {
      const int d = tid % D;
      T acc = 0;
      for (int g = tid / D; g < groups; g += R) acc += group_wsum(g, d) * s.group_scale[g];
      partial[tid] = acc;
    }
    __syncthreads();
    if (tid < D) {
      T acc = 0;
      for (int r = 0; r < R; ++r) acc += partial[r * D + tid];
      a.block_wsum[int64_t(tid) * gridDim.x + out] = acc;
    }
  }
  if (tid == 0) {
    a.block_lse[blockIdx.x] = block;
    a.block_sum_sq[blockIdx.x] = sq;
  }
}

// Phase 2: runs in every block after the grid barrier.
template <typename T>
__device__ void finish(const Args<T>& a, T* reduce_scratch_t, LogSumExp<T>* reduce_scratch_lse) {
  const int tid = threadIdx.x;
  const int num_blocks = gridDim.x;
  LogSumExp<T> total = LogSumExp<T>::empty();
  for (int b = tid; b < num_blocks; b += blockDim.x) total = LogSumExp<T>::merge(total, a.block_lse[b]);
  total = cuda::block_allreduce(total, reduce_scratch_lse, cuda::MergeLogSumExp{});

  const T log_norm = total.value();
  const int64_t stride = int64_t(num_blocks) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + tid; i < a.N; i += stride) {
    a.log_weights[i] -= log_norm;
  }
  // Weighted mean: dimensions spread over blocks, block partials rescaled to the global max.
  for (int d = blockIdx.x; d < a.D; d += num_blocks) {
    T acc = 0;
    for (int b = tid; b < num_blocks; b += blockDim.x) {
      acc += a.block_wsum[int64_t(d) * num_blocks + b] * rel_exp(a.block_lse[b].max, total.max);
    }
    acc = cuda::block_allreduce(acc, reduce_scratch_t);
    if (tid == 0) a.weighted_mean[d] = acc / total.sum;
  }
  if (blockIdx.x == num_blocks - 1) {
    T acc = 0;
    for (int b = tid; b < num_blocks; b += blockDim.x) {
      const T f = rel_exp(a.block_lse[b].max, total.max);
      acc += a.block_sum_sq[b] * f * f;
    }
    acc = cuda::block_allreduce(acc, reduce_scratch_t);
    // sum_i w_i^2 = acc / total.sum^2 with w_i = exp(lw_i - max) / total.sum.
    if (tid == 0) *a.ess = total.sum * total.sum / acc;
  }
}

template <typename T>
__device__ __forceinline__ T* carve(char*& p, int64_t count) {
  T* out = reinterpret_cast<T*>(p);
  p += (count * sizeof(T) + 15) / 16 * 16;  // keep every array 16-byte aligned
  return out;
}

// Fast path.  VEC: elements per load (16 bytes, or 1 when D or the pointer does
// not allow it); CH: chunks of VEC a lane holds (CH * VEC = kLaneElems);
// SINGLE: one thread per row (D <= kLaneElems), so no shuffles at all.
// Parameter rows are zero-padded to G * CH * VEC so the inner loop has no
// bounds checks, and the next row is loaded while the current one is computed.
template <typename T, int VEC, int CH, bool SINGLE>
__global__ void __launch_bounds__(kThreads)
importance_sampling_fast_kernel(const Args<T> a) {
  using V = Vec<T, VEC>;
  constexpr int E = CH * VEC;  // row elements per lane
  extern __shared__ __align__(16) char smem_raw[];
  __shared__ T reduce_t[kWarps];
  __shared__ LogSumExp<T> reduce_lse[kWarps];
  __shared__ T partial[kThreads];

  const int G = SINGLE ? 1 : a.group_size, D = a.D, K = a.K;
  const int stride = G * E;  // padded parameter row
  const int groups_per_warp = cuda::kWarpSize / G, groups = kWarps * groups_per_warp;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int lane_in_group = lane % G, group = warp * groups_per_warp + lane / G;
  const int num_chunks = D / VEC;

  const int64_t total_groups = int64_t(gridDim.x) * groups;
  const int64_t my_group = int64_t(blockIdx.x) * groups + group;
  const int64_t warp_first_group = int64_t(blockIdx.x) * groups + warp * groups_per_warp;

  // Lane's slice of row i (zeros past the row or past N).
  auto load_row = [&](int64_t i, T (&x)[E]) {
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int c = lane_in_group + j * G;
      V v;
      if (i < a.N && c < num_chunks) {
        v = *reinterpret_cast<const V*>(a.x + i * D + c * VEC);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) v.v[e] = 0;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) x[j * VEC + e] = v.v[e];
    }
  };
  // The first row's load overlaps the parameter set-up below.
  T x[E];
  load_row(my_group, x);

  char* p = smem_raw;
  T* mu = carve<T>(p, int64_t(K) * stride);
  T* inv_std = carve<T>(p, int64_t(K) * stride);
  T* q_mu = carve<T>(p, stride);
  T* q_inv_std = carve<T>(p, stride);
  T* log_norm = carve<T>(p, K + 1);
  T* group_wsum = carve<T>(p, int64_t(groups) * D);
  BlockScratch<T> scratch{carve<T>(p, groups), carve<T>(p, groups), carve<T>(p, groups),
                          carve<T>(p, groups)};
  prepare_parameters(a, stride, mu, inv_std, q_mu, q_inv_std, log_norm, threadIdx.x, blockDim.x);
  __syncthreads();

  // Sum over the row of ((x - mu) * inv_std)^2 for one parameter row.  Two
  // interleaved partial sums halve the dependent-add chain and keep the
  // float32 rounding of long rows close to torch.sum's pairwise order.
  auto sum_sq = [&](const T* mu_k, const T* inv_k) {
    T acc[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int c = lane_in_group + j * G;
      const V m = *reinterpret_cast<const V*>(mu_k + c * VEC);
      const V r = *reinterpret_cast<const V*>(inv_k + c * VEC);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const T z = (x[j * VEC + e] - m.v[e]) * r.v[e];
        acc[(j * VEC + e) % 2] += z * z;
      }
    }
    T total = acc[0] + acc[1];
    if constexpr (!SINGLE) total = cuda::group_allreduce(total, G);
    return total;
  };

  GroupState<T> state;
  T wsum[E];
#pragma unroll
  for (int e = 0; e < E; ++e) wsum[e] = 0;

  // The loop bound is uniform across the warp (shuffles need all lanes).
  for (int64_t base = 0; warp_first_group + base < a.N; base += total_groups) {
    const int64_t i = my_group + base;
    T next[E];
    load_row(i + total_groups, next);

    LogSumExp<T> log_p = LogSumExp<T>::empty();
    for (int k = 0; k < K; ++k) {
      log_p.push(T(-0.5) * sum_sq(mu + int64_t(k) * stride, inv_std + int64_t(k) * stride) + log_norm[k]);
    }
    const T log_q = T(-0.5) * sum_sq(q_mu, q_inv_std) + log_norm[K];
    if (i < a.N) {
      const T lw = log_p.value() - log_q;
      if (lane_in_group == 0) a.log_weights[i] = lw;
      T e;
      const T scale = state.push(lw, e);
#pragma unroll
      for (int q = 0; q < E; ++q) wsum[q] = wsum[q] * scale + e * x[q];
    }
#pragma unroll
    for (int q = 0; q < E; ++q) x[q] = next[q];
  }

  // Merge the groups of this block.
  if (lane_in_group == 0) {
    scratch.group_max[group] = state.max;
    scratch.group_sum[group] = state.sum;
    scratch.group_sum_sq[group] = state.sum_sq;
  }
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    const int c = lane_in_group + j * G;
    if (c < num_chunks) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) group_wsum[int64_t(group) * D + c * VEC + e] = wsum[j * VEC + e];
    }
  }
  __syncthreads();
  write_block_partial(
      a, scratch, groups, [&](int g, int d) { return group_wsum[int64_t(g) * D + d]; }, reduce_t,
      reduce_lse, partial);

  cg::this_grid().sync();
  finish(a, reduce_t, reduce_lse);
}

// General path: any D and K.  Parameters are prepared once into global memory,
// rows are re-read (from L1/L2) for every component, and each group's running
// weighted sums live in its own row of a global workspace.
template <typename T>
__global__ void __launch_bounds__(kThreads) importance_sampling_general_kernel(const Args<T> a) {
  extern __shared__ __align__(16) char smem_raw[];
  __shared__ T reduce_t[kWarps];
  __shared__ LogSumExp<T> reduce_lse[kWarps];
  __shared__ T partial[kThreads];

  const int G = a.group_size, D = a.D, K = a.K;
  const int groups_per_warp = cuda::kWarpSize / G, groups = kWarps * groups_per_warp;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int lane_in_group = lane % G, group = warp * groups_per_warp + lane / G;

  char* p = smem_raw;
  BlockScratch<T> scratch{carve<T>(p, groups), carve<T>(p, groups), carve<T>(p, groups),
                          carve<T>(p, groups)};

  const int64_t KD = int64_t(K) * D;
  T* inv_std = a.prepared;
  T* q_inv_std = inv_std + KD;
  T* log_norm = q_inv_std + D;
  prepare_parameters<T>(a, D, nullptr, inv_std, nullptr, q_inv_std, log_norm,
                        int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                        int64_t(gridDim.x) * blockDim.x);

  const int64_t total_groups = int64_t(gridDim.x) * groups;
  const int64_t my_group = int64_t(blockIdx.x) * groups + group;
  T* wsum = a.group_wsum + my_group * D;
  for (int d = lane_in_group; d < D; d += G) wsum[d] = 0;
  cg::this_grid().sync();

  GroupState<T> state;
  const int64_t warp_first_group = int64_t(blockIdx.x) * groups + warp * groups_per_warp;
  for (int64_t base = 0; warp_first_group + base < a.N; base += total_groups) {
    const int64_t i = my_group + base;
    const bool valid = i < a.N;
    const T* xi = a.x + (valid ? i : 0) * D;
    auto group_sum_sq = [&](const T* mu_k, const T* inv_k) {
      T acc = 0;
      for (int d = lane_in_group; d < D; d += G) {
        const T z = (xi[d] - mu_k[d]) * inv_k[d];
        acc += z * z;
      }
      return cuda::group_allreduce(acc, G);
    };
    LogSumExp<T> log_p = LogSumExp<T>::empty();
    for (int k = 0; k < K; ++k) {
      log_p.push(T(-0.5) * group_sum_sq(a.mix_mus + int64_t(k) * D, inv_std + int64_t(k) * D) +
                 log_norm[k]);
    }
    const T log_q = T(-0.5) * group_sum_sq(a.q_mu, q_inv_std) + log_norm[K];
    if (!valid) continue;
    const T lw = log_p.value() - log_q;
    if (lane_in_group == 0) a.log_weights[i] = lw;
    T e;
    const T scale = state.push(lw, e);
    for (int d = lane_in_group; d < D; d += G) wsum[d] = wsum[d] * scale + e * xi[d];
  }

  if (lane_in_group == 0) {
    scratch.group_max[group] = state.max;
    scratch.group_sum[group] = state.sum;
    scratch.group_sum_sq[group] = state.sum_sq;
  }
  __syncthreads();  // also orders this block's global wsum writes before the reads below
  const T* block_wsum = a.group_wsum + int64_t(blockIdx.x) * groups * D;
  write_block_partial(
      a, scratch, groups, [&](int g, int d) { return block_wsum[int64_t(g) * D + d]; }, reduce_t,
      reduce_lse, partial);

  cg::this_grid().sync();
  finish(a, reduce_t, reduce_lse);
}

int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

template <typename T>
void importance_sampling_launch(const Tensor& x, const Tensor& mix_weights,
                                const Tensor& mix_mus, const Tensor& mix_stds,
                                const Tensor& q_mu, const Tensor& q_std,
                                Tensor& weighted_mean, Tensor& ess, Tensor& log_weights) {
  constexpr int kVec = 16 / sizeof(T);
  Args<T> a{};
  a.x = cdata<T>(x);
  a.mix_weights = cdata<T>(mix_weights);
  a.mix_mus = cdata<T>(mix_mus);
  a.mix_stds = cdata<T>(mix_stds);
  a.q_mu = cdata<T>(q_mu);
  a.q_std = cdata<T>(q_std);
  a.N = x.size(0);
  a.D = int(x.size(1));
  a.K = int(mix_weights.size(0));
  a.weighted_mean = mdata<T>(weighted_mean);
  a.ess = mdata<T>(ess);
  a.log_weights = mdata<T>(log_weights);
  const int64_t D = a.D, K = a.K;

  // Fast-path configuration: as few lanes per row as hold it in registers.
  const bool vectorised = D % kVec == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
  const int vec = vectorised ? kVec : 1;
  const int64_t num_chunks = D / vec, chunks_per_lane = kLaneElems / vec;
  int G = next_pow2(int(std::max<int64_t>(1, (num_chunks + chunks_per_lane - 1) / chunks_per_lane)));
  int groups = kWarps * (cuda::kWarpSize / G);
  const int64_t stride = int64_t(G) * kLaneElems;  // zero-padded parameter row
  const size_t params_bytes = 2 * align16(K * stride * sizeof(T)) +
                              2 * align16(stride * sizeof(T)) + align16((K + 1) * sizeof(T));
  size_t smem = params_bytes + align16(groups * D * sizeof(T)) + 4 * align16(groups * sizeof(T));
  const bool fast = D <= kMaxFastD && smem <= kMaxFastSmem;

  void (*kernel)(const Args<T>) = nullptr;
  if (fast) {
    const bool single = G == 1;
    if (vectorised) {
      kernel = single ? importance_sampling_fast_kernel<T, kVec, kLaneElems / kVec, true>
                      : importance_sampling_fast_kernel<T, kVec, kLaneElems / kVec, false>;
    } else {
      kernel = single ? importance_sampling_fast_kernel<T, 1, kLaneElems, true>
                      : importance_sampling_fast_kernel<T, 1, kLaneElems, false>;
    }
  } else {
    kernel = importance_sampling_general_kernel<T>;
    G = std::min(cuda::kWarpSize, next_pow2(int(std::max<int64_t>(D, 1))));
    groups = kWarps * (cuda::kWarpSize / G);
    smem = 4 * align16(groups * sizeof(T));
  }
  a.group_size = G;

  // One group per row at a time; the grid is as large as can be resident (the
  // grid barrier needs every block resident) or as the rows need, if fewer.
  int64_t grid = std::min(cuda::max_resident_blocks(kernel, kThreads, smem),
                          (a.N + groups - 1) / groups);
  if (!fast) {
    // Bound the per-group weighted-sum workspace (grid * groups * D) to ~256 MB.
    const int64_t cap = (int64_t(256) << 20) / int64_t(sizeof(T)) / (int64_t(groups) * std::max<int64_t>(D, 1));
    grid = std::min(grid, cap);
  }
  grid = std::max<int64_t>(grid, 1);

  // One workspace allocation, carved into 16-byte aligned arrays.
  auto count = [](int64_t n) { return (n * int64_t(sizeof(T)) + 15) / 16 * 16 / int64_t(sizeof(T)); };
  const int64_t n_lse = count(2 * grid), n_sq = count(grid), n_wsum = count(D * grid);
  const int64_t n_prep = fast ? 0 : count(K * D + D + K + 1);
  const int64_t n_group = fast ? 0 : count(grid * groups * D);
  Tensor workspace = empty_like_device(x, {n_lse + n_sq + n_wsum + n_prep + n_group});
  T* w = mdata<T>(workspace);
  a.block_lse = reinterpret_cast<LogSumExp<T>*>(w);
  a.block_sum_sq = w + n_lse;
  a.block_wsum = a.block_sum_sq + n_sq;
  a.prepared = a.block_wsum + n_wsum;
  a.group_wsum = a.prepared + n_prep;

  cuda::launch_cooperative(kernel, grid, kThreads, smem, a);
}

ImportanceSamplingResult importance_sampling_cuda(const Tensor& samples, const Tensor& mix_weights,
                                                  const Tensor& mix_mus, const Tensor& mix_stds,
                                                  const Tensor& q_mu, const Tensor& q_std) {
  const cuda::TensorDeviceGuard guard(samples);
  ImportanceSamplingCall c(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std);
  FUSED_OPS_CHECK(samples.is_cuda(), "samples must be a CUDA tensor, got ", device_str(samples));
  FUSED_OPS_CHECK(c.D <= INT_MAX && c.K <= INT_MAX,
                  "importance_sampling: D and K must fit in int32, got D=", c.D, ", K=", c.K);
  dispatch_float(samples.scalar_type(), [&](auto zero) {
    importance_sampling_launch<decltype(zero)>(c.x, c.mix_weights, c.mix_mus, c.mix_stds, c.q_mu,
                                               c.q_std, c.weighted_mean, c.ess, c.log_weights);
  });
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("importance_sampling", TORCH_BOX(&importance_sampling_cuda));
}

}  // namespace fused_ops
