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
#include <map>
#include <mutex>
#include <tuple>

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

// An attribute of the current device (compute capability, opt-in shared
// memory per block, ...), cached per (device, attribute).
inline int device_attribute(cudaDeviceAttr attr) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> cache;
  const int device = current_device();
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, int(attr));
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int value = 0;
  FUSED_OPS_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  cache.emplace(key, value);
  return value;
}

inline int compute_capability_major() {
  return device_attribute(cudaDevAttrComputeCapabilityMajor);
}

inline size_t max_shared_memory_per_block() {  // with the opt-in attribute set
  return size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
}

// Sets a kernel's dynamic shared memory limit to at least `smem` on the
// current device, once per (kernel, device, size): above 48 KB a kernel must
// opt in before launch.
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return;
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int>, size_t> done;
  const int device = current_device();
  std::lock_guard<std::mutex> lock(mutex);
  auto& have = done[std::make_tuple(reinterpret_cast<const void*>(kernel), device)];
  if (have >= smem) return;
  FUSED_OPS_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  have = smem;
}

}  // namespace cuda
}  // namespace fused_ops
