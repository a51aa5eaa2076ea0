// \brief Host-side CUDA plumbing shared by the op wrappers, on the LibTorch stable
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
#include <optional>
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

// Values worked out once per key and kept for the process: device facts,
// occupancies, launch plans.  Each query behind them costs about as much as
// a launch (cudaDeviceGetAttribute, the occupancy API), a sizeable share of
// a small call, and their answers never change for a key that names the
// device.  Thread-safe; `compute` runs outside the lock (it may consult
// other memos, and it may throw: then nothing is kept).  Two threads that
// miss at once both compute; the first answer stays.
template <typename Key, typename Value>
class Memo {
 public:
  template <typename Compute>
  Value get(const Key& key, Compute&& compute) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = map_.find(key);
      if (it != map_.end()) return it->second;
    }
    Value value = compute();
    std::lock_guard<std::mutex> lock(mutex_);
    return map_.emplace(key, std::move(value)).first->second;
  }

 private:
  std::mutex mutex_;
  std::map<Key, Value> map_;
};

// Makes a CUDA tensor's device current for the scope of an op wrapper.  A
// CPU tensor (the first argument of a CPU/CUDA mix, which the argument
// checks then name) leaves the device alone, and so does the common case
// of the tensor's device being current already: a DeviceGuard (a device
// query and two device sets through the stable ABI) costs several times a
// cudaGetDevice, which matters to calls that are host-bound.
class TensorDeviceGuard {
 public:
  explicit TensorDeviceGuard(const torch::stable::Tensor& t) {
    // An undefined tensor (None) is left to the argument checks, which name it.
    if (!t.defined() || !t.is_cuda()) return;
    const int device = int(t.get_device_index());
    if (current_device() != device) guard_.emplace(device);
  }

 private:
  std::optional<torch::stable::accelerator::DeviceGuard> guard_;
};

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
  static Memo<std::pair<int, int>, int> memo;
  const int device = current_device();
  return memo.get({device, int(attr)}, [&] {
    int value = 0;
    FUSED_OPS_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
    return value;
  });
}

inline int compute_capability_major() {
  return device_attribute(cudaDevAttrComputeCapabilityMajor);
}

inline size_t max_shared_memory_per_block() {  // with the opt-in attribute set
  return size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
}

// Sets a kernel's dynamic shared memory limit to at least `smem` on the
// current device, once per (kernel, device, size): above 48 KB a kernel must
// opt in before launch.  Not a Memo: the attribute is one value per kernel
// that only ever rises here (setting a smaller one would lower the limit a
// larger launch of the same kernel relies on).
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

// A launch of `grid` blocks in thread-block clusters of `cluster` blocks
// (sm_90), for cudaLaunchKernelEx / cudaOccupancyMaxActiveClusters.  Not
// copyable: cfg.attrs points into the object.
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[2] = {};

  ClusterLaunch(int64_t grid, int cluster, int threads, size_t smem, cudaStream_t stream) {
    cfg.gridDim = dim3(unsigned(grid));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  // Programmatic dependent launch: the kernel may start while the previous
  // one in the stream still runs (cuda/primitives/dependent_launch.cuh: it must call
  // wait_prior_grids() before touching global memory).
  void overlap_prior_kernel() {
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs = 2;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// How many clusters of `cluster` blocks of `kernel` (with `smem` bytes of
// dynamic shared memory each) can be resident at once on the current
// device; 0 when none can.  Clusters above 8 blocks are "non-portable" and
// need an opt-in; how many fit depends on the GPU's SM partitioning into
// GPCs (an H200 holds seven 16-block clusters of one block per SM, not the
// eight its 132 SMs suggest), so ask the occupancy API.  Cached: the query
// costs about as much as a launch.
template <typename Kernel>
int max_active_clusters(Kernel kernel, int cluster, int threads, size_t smem) {
  static Memo<std::tuple<const void*, int, int, size_t, int>, int> memo;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), cluster, threads, smem,
                                   current_device());
  return memo.get(key, [&] {
    if (smem > max_shared_memory_per_block()) return 0;
    allow_dynamic_smem(kernel, smem);
    if (cluster > 8 &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    int clusters = 0;
    const ClusterLaunch launch(cluster, cluster, threads, smem, nullptr);
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // an unsupported size is an answer, not an error
      clusters = 0;
    }
    return clusters;
  });
}

// Whether at least one such cluster can be resident (the launch can run).
template <typename Kernel>
bool cluster_fits(Kernel kernel, int cluster, int threads, size_t smem) {
  return max_active_clusters(kernel, cluster, threads, smem) >= 1;
}

}  // namespace cuda
}  // namespace fused_ops
