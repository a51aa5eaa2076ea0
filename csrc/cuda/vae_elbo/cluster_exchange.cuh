// \brief How the CTAs of a VAE cluster kernel share activations
// (cuda/vae_elbo/cluster.cu, cuda/vae_mlp/cluster.cu): the slice of a layer
// each CTA owns, the pushes of that slice into the other CTAs' shared
// memory, and the cluster size a launch asks for.
#pragma once

#include <cstdint>

#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/vae_elbo/cluster_products.cuh"

namespace fused_ops {
namespace vae_elbo_kernels {

// [begin, end) of part p when n items are cut into `parts` contiguous slices.
struct Slice {
  int begin, end;
};
[[maybe_unused]] __host__ __device__ __forceinline__ Slice slice_of(int n, int parts, int p) {
  const int per = (n + parts - 1) / parts;
  const int b = min(n, p * per);
  return {b, min(n, b + per)};
}

// Bytes the other CTAs of the cluster push into this one's copy of a
// [kRows, N] buffer when this CTA owns the columns s: everything else.
[[maybe_unused]] __device__ __forceinline__ uint32_t exchange_bytes(int N, Slice s) {
  return uint32_t(kRows) * uint32_t(N - (s.end - s.begin)) * uint32_t(sizeof(float));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Pushes this CTA's columns [s.begin, s.end) of buf [kRows, N] (row stride N)
// into the other CTAs' copies of buf by st.async (cuda/primitives/mbarrier.cuh), as
// float4 runs where the columns allow (distributed shared memory traffic is
// per transaction: one float4 store costs about what one float store does);
// each store completes its bytes on the destination's copy of `bar`, whose
// phase expects exchange_bytes, so a CTA waits only until its copy is
// complete -- no cluster barrier.  Stores need no reply, so a push costs the
// issue of the stores, where gathering the slices with remote loads would
// wait on each load's round trip.
__device__ __forceinline__ void push_slice(float* buf, int N, Slice s, int C, int rank, uint64_t* bar) {
  const int n = s.end - s.begin;
  if (n <= 0) return;
  float* const src = buf + s.begin;
  if (N % 4 == 0 && s.begin % 4 == 0 && n % 4 == 0) {
    const int n4 = n / 4, per_dst = kRows * n4;
    for (int idx = threadIdx.x; idx < (C - 1) * per_dst; idx += kThreads) {
      const int d = idx / per_dst, rest = idx - d * per_dst;
      const int r = rest / n4, q = rest - r * n4;
      const int dst = d + (d >= rank);
      float4* const p = reinterpret_cast<float4*>(src + r * N) + q;
      cuda::st_async(p, *p, bar, dst);
    }
  } else {
    const int per_dst = kRows * n;
    for (int idx = threadIdx.x; idx < (C - 1) * per_dst; idx += kThreads) {
      const int d = idx / per_dst, rest = idx - d * per_dst;
      const int r = rest / n, q = rest - r * n;
      const int dst = d + (d >= rank);
      float* const p = src + r * N + q;
      cuda::st_async(p, *p, bar, dst);
    }
  }
}
#endif

// The cluster size for `kernel` with `smem` bytes per block and `tiles`
// row tiles on the current device: 16 (each CTA then holds half the weight
// slices it holds at 8) when every tile's cluster can have SMs of its own,
// else 8; 0 if neither fits.  A 16-CTA cluster takes most of a GPC, and
// the GPU has only so many that can host one with one CTA per SM (an H200:
// seven, not the eight its 132 SMs suggest); beyond that, two clusters
// share SMs and run at about half speed, slower than 8-CTA clusters.
template <typename Kernel>
int cluster_size_for(Kernel kernel, size_t smem, int64_t tiles) {
  const bool fits8 = cuda::cluster_fits(kernel, 8, kThreads, smem);
  if (cuda::cluster_fits(kernel, 16, kThreads, smem)) {
    // Clusters resident at once with one CTA per SM: asked with the most
    // shared memory a CTA may have, which leaves no room for a second.
    const int own_sms = cuda::max_active_clusters(kernel, 16, kThreads, cuda::max_shared_memory_per_block());
    if (tiles <= own_sms || !fits8) return 16;
  }
  return fits8 ? 8 : 0;
}

}  // namespace vae_elbo_kernels
}  // namespace fused_ops
