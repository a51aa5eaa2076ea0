// \brief Shared-memory transaction barriers (mbarrier, sm_90) and asynchronous
// stores into another block of the cluster (st.async), for kernels whose
// blocks exchange small slices of activations every step.
//
// Why: a cluster barrier (barrier.cluster arrive + wait) makes every block
// wait for every other block's arrival, a round trip through the cluster's
// synchronisation hardware (~0.24 us on the H200 alone, ~0.37 us with a
// push of a few float4s: `git show 3b1fe44:bench/results/nvidia-h200-cluster-sync.txt`).  With
// st.async the data carries its own signal: each store completes its bytes
// on an mbarrier in the destination block, so a consumer waits only until
// the bytes it needs have landed, and a producer never waits at all.
//
// Protocol for one exchange buffer (flow_euler's split path, vae_elbo's
// cluster path): the consumer block's mbarrier expects one
// arrival, which also declares the bytes its partners will store
// (arrive_expect_tx), so the phase cannot complete before that declaration
// even when their bytes land first (the transaction count may go negative
// meanwhile).  Each phase completes when the partners' bytes have landed;
// waiting on it (acquire at cluster scope) makes them visible.  The block's
// own part of the buffer is published by an ordinary block barrier:
// compute-sanitizer's racecheck does not follow stores through another
// thread's mbarrier arrival.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_ops {
namespace cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The shared::cluster address of `p` (in this block's shared memory) in
// block `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_addr(const void* p, int rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
  return a;
}

// One thread initialises; the fence makes the initialisation visible to the
// cluster's other blocks, which may store into this block once the cluster
// barrier that must follow has completed.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// An arrival that also expects `bytes` more of asynchronous stores in this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

// Waits until the phase of parity `parity` has completed, acquiring at
// cluster scope (kCluster: the peer's st.async bytes are released at
// cluster scope) or at block scope (a barrier whose phase completes by this
// block's own bulk copies, such as a weight ring: spares the L1
// invalidation that a cluster-scope acquire costs on every wait, CCTL.IVALL
// in the SASS).
template <bool kCluster>
__device__ __forceinline__ void mbarrier_wait_at(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_addr(bar);
  uint32_t done;
  do {
    if constexpr (kCluster) {
      asm volatile(
          "{ .reg .pred p;\n"
          "  mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
          "  selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(a), "r"(parity)
          : "memory");
    } else {
      asm volatile(
          "{ .reg .pred p;\n"
          "  mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
          "  selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(a), "r"(parity)
          : "memory");
    }
  } while (!done);
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) { mbarrier_wait_at<true>(bar, parity); }
__device__ __forceinline__ void mbarrier_wait_cta(uint64_t* bar, uint32_t parity) {
  mbarrier_wait_at<false>(bar, parity);
}

// Stores v into block `rank`'s copy of *dst and completes its bytes (4 or
// 16) on that block's copy of *bar (both given as this block's addresses).
// `rank` must be another block of the cluster.
__device__ __forceinline__ void st_async(float* dst, float v, uint64_t* bar, int rank) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                   cluster_addr(dst, rank)),
               "r"(__float_as_uint(v)), "r"(cluster_addr(bar, rank))
               : "memory");
}

__device__ __forceinline__ void st_async(float4* dst, float4 v, uint64_t* bar, int rank) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   cluster_addr(dst, rank)),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
               "r"(__float_as_uint(v.w)), "r"(cluster_addr(bar, rank))
               : "memory");
}

// st_async of a float pair to a shared::cluster address (cluster_addr),
// completing its 8 bytes on the mbarrier at cluster address `bar`.
__device__ __forceinline__ void st_async(uint32_t dst, float2 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(dst),
               "f"(v.x), "f"(v.y), "r"(bar)
               : "memory");
}

// A cluster barrier whose arrival orders no memory: for "done reading"
// (a write-after-read hazard on reads already complete, such as wgmma
// operands after wgmma.wait_group), where the release of a default arrival
// would wait for this thread's outstanding stores at GPU scope (MEMBAR.GPU
// in the SASS).  Every thread of the cluster arrives, then waits.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from
// global memory into this block's shared memory with the bulk copy engine
// (one thread issues it), completing the bytes on *bar: the block's threads
// wait on *bar, whose phase the issuing thread armed with
// mbarrier_arrive_expect_tx(bar, bytes).
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Ends an mbarrier's life (the PTX rule before its shared memory serves
// anything else, including an mbarrier of a later block on this SM).
__device__ __forceinline__ void mbarrier_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace cuda
}  // namespace fused_ops
