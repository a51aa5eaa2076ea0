// \brief Asynchronous global -> shared copies (cp.async, sm_80+) for kernels that
// stream operands through shared memory: the copy bypasses the registers, so
// staging a chunk costs one instruction per 16 bytes instead of a load, a
// store and their address arithmetic, and several chunks can be in flight.
//
// Use: every thread issues its copies of a chunk, then commit(); before
// reading chunk q, wait<N>() (at most N newer groups still pending for this
// thread) and a block barrier (the other threads' copies).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_ops {
namespace cuda {

// 16 bytes from global `src` to shared `dst`, both 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
#else
  __trap();
#endif
}

// 4 bytes from global `src` to shared `dst` (cached in L1: .ca is the only
// form for sizes below 16), both 4-byte aligned.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
#else
  __trap();
#endif
}

// Closes this thread's group of copies issued since the last commit (an
// empty group is fine: it keeps group counts uniform across iterations).
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace cuda
}  // namespace fused_ops
