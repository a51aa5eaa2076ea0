// \brief importance_sampling, path "general": the same outputs as the fast
// path (fast.cu) for any D and K, in one cooperative launch.
//
// When: every call the fast path does not take (D > 512, or the fast path's
// prepared parameters and weighted sums would need more than 96 KB of
// shared memory: large K * D).  Correct for every input.
//
// Design.  A group of G = min(32, next_pow2(D)) lanes owns one sample row at a
// time (grid-stride over rows); lanes stride over d.  The parameters are
// prepared once by the whole grid into global memory (1/std, the proposal's
// 1/std, the K + 1 log-normalisers), published by an extra grid barrier;
// the row is re-read from L1/L2 for every component instead of being held in
// registers, and each group's running weighted sums live in its own row of a
// global workspace ([grid * groups, D], bounded to ~256 MB by capping the
// grid).  Shared memory holds only the block merge's per-group states.  The
// phases and their merges are paths.cuh's.

#include "cuda/importance_sampling/paths.cuh"

namespace fused_ops {
namespace {

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
  const bool divide = std_overflows(a);
  prepare_parameters<T>(a, D, nullptr, inv_std, nullptr, q_inv_std, log_norm,
                        int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                        int64_t(gridDim.x) * blockDim.x, divide);

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
        const T diff = xi[d] - mu_k[d];
        const T z = divide ? diff / inv_k[d] : diff * inv_k[d];  // inv_k: std when dividing
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

template <typename T>
void launch_general_typed(const ImportanceSamplingCall& c) {
  Args<T> a = make_args<T>(c);
  const int G = std::min(cuda::kWarpSize, next_pow2(int(std::max<int64_t>(c.D, 1))));
  const int groups = kWarps * (cuda::kWarpSize / G);
  const size_t smem = 4 * align16(groups * sizeof(T));
  a.group_size = G;
  launch_with_workspace(importance_sampling_general_kernel<T>, a, /*general=*/true, groups, smem, c);
}

}  // namespace

namespace importance_sampling_paths {

void launch_general(const ImportanceSamplingCall& c) {
  dispatch_float(c.x.scalar_type(), [&](auto zero) { launch_general_typed<decltype(zero)>(c); });
}

}  // namespace importance_sampling_paths
}  // namespace fused_ops
