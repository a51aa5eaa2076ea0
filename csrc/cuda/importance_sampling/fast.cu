// \brief importance_sampling, path "fast": self-normalised importance weights,
// weighted mean and ESS of N samples under a K-component diagonal Gaussian
// mixture target and a diagonal Gaussian proposal, in one cooperative launch,
// with the prepared parameters in shared memory and each row in registers.
//
// When: D <= kMaxFastD (512) and the shared memory below fits kMaxFastSmem
// (96 KB, room for two blocks per SM): small K * D (fast_plan in paths.cuh).
//
// Design.  A group of G lanes (a power of two, as few as hold the row in
// kLaneElems = 16 registers each; G = 1 for D <= 16: one thread per sample,
// no shuffles) owns one sample row at a time and walks the rows grid-stride;
// each lane keeps its slice of the row in registers, loaded with 16-byte
// vector loads when D and the pointer allow (VEC), and the next row is
// loaded while the current one is computed.  Shared memory holds the
// prepared parameters mu, 1/std (rows zero-padded to G * 16, so the inner loop
// has no bounds checks: a zero mu and 1/std make a padded element contribute
// exactly 0), the proposal's, the K + 1 log-normalisers and the groups'
// weighted sums for the block merge.  Per component, the squared distance is
// summed in two interleaved partial sums per lane, then over the group by an
// xor butterfly.  The phases and their merges are paths.cuh's.

#include "cuda/importance_sampling/paths.cuh"

namespace fused_ops {
namespace {

// The rows of one group when some std is subnormal (std_overflows): z =
// (x - mu) / std with the parameters as prepare_parameters(divide) stores
// them, x read from global memory, lanes striding over d; the group's
// weighted sums go straight to its row `wsum` of shared memory.
template <typename T>
__device__ __forceinline__ GroupState<T> rows_dividing(const Args<T>& a, const T* mu, const T* std_,
                                                    const T* q_mu, const T* q_std, const T* log_norm,
                                                    int stride, int G, int lane_in_group,
                                                    int64_t my_group, int64_t total_groups,
                                                    int64_t warp_first_group, T* wsum) {
  const int D = a.D, K = a.K;
  for (int d = lane_in_group; d < D; d += G) wsum[d] = 0;
  GroupState<T> state;
  for (int64_t base = 0; warp_first_group + base < a.N; base += total_groups) {
    const int64_t i = my_group + base;
    const bool valid = i < a.N;
    const T* xi = a.x + (valid ? i : 0) * D;
    auto group_sum_sq = [&](const T* mu_k, const T* std_k) {
      T acc = 0;
      for (int d = lane_in_group; d < D; d += G) {
        const T z = (xi[d] - mu_k[d]) / std_k[d];
        acc += z * z;
      }
      return cuda::group_allreduce(acc, G);
    };
    LogSumExp<T> log_p = LogSumExp<T>::empty();
    for (int k = 0; k < K; ++k) {
      log_p.push(T(-0.5) * group_sum_sq(mu + int64_t(k) * stride, std_ + int64_t(k) * stride) + log_norm[k]);
    }
    const T log_q = T(-0.5) * group_sum_sq(q_mu, q_std) + log_norm[K];
    if (!valid) continue;
    const T lw = log_p.value() - log_q;
    if (lane_in_group == 0) a.log_weights[i] = lw;
    T e;
    const T scale = state.push(lw, e);
    for (int d = lane_in_group; d < D; d += G) wsum[d] = wsum[d] * scale + e * xi[d];
  }
  return state;
}

// Blocks per SM the register allocation must allow.  The float32 kernel for
// short vectorised rows (D <= 16, one thread per row) fits three blocks of
// 256 threads in 80 registers, and keeps them only if asked: the dividing
// loop beside the main one would otherwise take it to two.
template <typename T, int VEC, bool SINGLE>
constexpr int kMinBlocks = (sizeof(T) == 4 && VEC > 1 && SINGLE) ? 3 : 1;

// VEC: elements per load (16 bytes, or 1 when D or the pointer does not allow
// it); CH: chunks of VEC a lane holds (CH * VEC = kLaneElems); SINGLE: one
// thread per row (D <= kLaneElems), so no shuffles at all.
template <typename T, int VEC, int CH, bool SINGLE>
__global__ void __launch_bounds__(kThreads, kMinBlocks<T, VEC, SINGLE>)
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
  const bool divide = std_overflows(a);
  prepare_parameters(a, stride, mu, inv_std, q_mu, q_inv_std, log_norm, threadIdx.x, blockDim.x, divide);
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
  if (divide) {
    state = rows_dividing(a, mu, inv_std, q_mu, q_inv_std, log_norm, stride, G, lane_in_group, my_group,
                          total_groups, warp_first_group, group_wsum + int64_t(group) * D);
  }
  for (int64_t base = 0; !divide && warp_first_group + base < a.N; base += total_groups) {
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
    if (!divide && c < num_chunks) {
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

template <typename T>
void launch_fast_typed(const ImportanceSamplingCall& c) {
  constexpr int kVec = 16 / sizeof(T);
  const FastPlan plan = fast_plan<T>(c);
  Args<T> a = make_args<T>(c);
  a.group_size = plan.group_size;
  const bool single = plan.group_size == 1;
  void (*kernel)(const Args<T>) = nullptr;
  if (plan.vectorised) {
    kernel = single ? importance_sampling_fast_kernel<T, kVec, kLaneElems / kVec, true>
                    : importance_sampling_fast_kernel<T, kVec, kLaneElems / kVec, false>;
  } else {
    kernel = single ? importance_sampling_fast_kernel<T, 1, kLaneElems, true>
                    : importance_sampling_fast_kernel<T, 1, kLaneElems, false>;
  }
  launch_with_workspace(kernel, a, /*general=*/false, plan.groups, plan.smem, c);
}

}  // namespace

namespace importance_sampling_paths {

bool fast_applies(const ImportanceSamplingCall& c) {
  return dispatch_float(c.x.scalar_type(), [&](auto zero) { return fast_plan<decltype(zero)>(c).fits; });
}

void launch_fast(const ImportanceSamplingCall& c) {
  dispatch_float(c.x.scalar_type(), [&](auto zero) { launch_fast_typed<decltype(zero)>(c); });
}

}  // namespace importance_sampling_paths
}  // namespace fused_ops
