// Host-side CUDA plumbing shared by the op wrappers, on the LibTorch stable
// ABI only (no ATen/c10 CUDA headers): error checks, the caller's current
// stream, device facts.  Keeping this in one place is what lets one build of
// the extension load into several torch releases.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include "common/checks.h"

#include <array>

#define FUSED_OPS_CUDA_CHECK(expr)                                                        \
  do {                                                                                    \
    const cudaError_t fused_ops_err_ = (expr);                                            \
    FUSED_OPS_CHECK(fused_ops_err_ == cudaSuccess, "CUDA error: ",                        \
                    cudaGetErrorString(fused_ops_err_), " (", #expr, ")");               \
  } while (0)

// After a <<<>>> launch: configuration errors surface here, not at the next sync.
#define FUSED_OPS_CUDA_LAUNCH_CHECK() FUSED_OPS_CUDA_CHECK(cudaGetLastError())

namespace fused_ops {
namespace cuda {

// The stream torch considers current on `device` (what a user's
// torch.cuda.stream(...) context or a CUDA graph capture set).
inline cudaStream_t current_stream(int device) {
  void* stream = nullptr;
  FUSED_OPS_CHECK(aoti_torch_get_current_cuda_stream(device, &stream) == AOTI_TORCH_SUCCESS,
                  "fused_ops: could not query the current CUDA stream of device ", device);
  return static_cast<cudaStream_t>(stream);
}

inline int current_device() {
  int device = 0;
  FUSED_OPS_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// Number of SMs, cached per device (the attribute query is not free and
// small calls care about every microsecond).
inline int multiprocessor_count(int device) {
  static std::array<int, 64> cache{};
  FUSED_OPS_CHECK(device >= 0 && device < int(cache.size()), "fused_ops: device index ", device,
                  " out of range");
  if (cache[device] == 0) {
    int n = 0;
    FUSED_OPS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cache[device] = n;
  }
  return cache[device];
}

}  // namespace cuda
}  // namespace fused_ops
