// \brief Launch helpers for persistent kernels that synchronise the whole
// grid (cooperative_groups::this_grid().sync()): the largest grid that can be
// resident, and the cooperative launch itself.
//
// Used by every kernel with grid barriers (importance_sampling forward and
// backward, the vae_elbo backward chain, the flow backward).  A cooperative
// launch fails unless every block is resident at once, so the grid is sized
// from the occupancy API, memoised because the query is a driver call on the
// host path of every small call.
#pragma once

#include <cuda_runtime.h>

#include "cuda/primitives/runtime.cuh"

#include <tuple>

namespace fused_ops {
namespace cuda {

// How many blocks of `kernel` can be resident on the current device at once:
// the largest grid a cooperative launch accepts.  The occupancy query is a
// driver call, a sizeable share of a small call's host time, so it is cached
// per (kernel, block size, shared memory, device).
template <typename Kernel>
int64_t max_resident_blocks(Kernel kernel, int threads, size_t smem) {
  static Memo<std::tuple<const void*, int, size_t, int>, int64_t> memo;
  const int device = current_device();
  return memo.get(std::make_tuple(reinterpret_cast<const void*>(kernel), threads, smem, device), [&] {
    allow_dynamic_smem(kernel, smem);
    int per_sm = 0;
    FUSED_OPS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    FUSED_OPS_CHECK(per_sm > 0, "fused_ops: kernel does not fit on this GPU (", threads, " threads, ", smem,
                    " bytes of shared memory per block)");
    return int64_t(per_sm) * multiprocessor_count(device);
  });
}

// Cooperative launch of kernel(args) on the current stream; grid <= max_resident_blocks.
template <typename Args>
void launch_cooperative(void (*kernel)(Args), int64_t grid, int threads, size_t smem, Args& args) {
  void* kernel_args[] = {&args};
  FUSED_OPS_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(unsigned(grid)),
                                             dim3(unsigned(threads)), kernel_args, smem,
                                             current_stream(current_device())));
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace fused_ops
