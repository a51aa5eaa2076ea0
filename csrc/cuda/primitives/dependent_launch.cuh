// \brief Programmatic dependent launch (sm_90): a kernel launched with
// ClusterLaunch::overlap_prior_kernel (cuda/primitives/runtime.cuh) may start on free
// SMs while the kernel before it in the stream is still running, instead of
// after it has drained.  What that hides is the launch itself and the
// prologue before the first global-memory access (shared-memory setup,
// barrier initialisation, the cluster's start-up), per call of a small
// kernel that leaves most SMs idle (the VAE cluster kernel at B=128 uses 64
// of an H200's 132 SMs).
//
// Protocol: a kernel so launched calls wait_prior_grids() in every thread
// before its first global-memory read or write: that waits until the grids
// it depends on have completed and their memory is visible, which keeps
// stream order for everything it touches.  It may call launch_dependents()
// early to let the next such launch start.  Launched without the
// attribute (or after a kernel that never calls launch_dependents, which
// then counts as calling it when it exits), both are no-ops in effect.
#pragma once

#include <cuda_runtime.h>

namespace fused_ops {
namespace cuda {

// The next kernel in the stream, if launched with overlap_prior_kernel, may
// start once every CTA of this grid has called this (or exited).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits until the prior grids this one depends on have completed and their
// memory operations are visible to this thread.
__device__ __forceinline__ void wait_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace cuda
}  // namespace fused_ops
