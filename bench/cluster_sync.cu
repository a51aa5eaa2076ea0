// What one step of a cluster-resident kernel pays for synchronisation, measured
// on the device: the time of a thread-block-cluster barrier (cluster.sync(),
// i.e. barrier.cluster.arrive.release + wait.acquire) for cluster sizes 2-16,
// alone (slice 0) and as part of an all-gather of the shape the flow_euler
// cluster kernel does per layer (each block contributes a [rows x n] slice of
// f4 float4s: 8 for the default's layer 3, 32 for layers 1-2), by pushing
// (distributed shared memory stores, then the barrier) or pulling (the
// barrier, then distributed shared memory loads).  The flow_euler cluster path
// does three such exchanges per Euler step: 3 x these numbers is its per-step
// synchronisation floor.
//
// Standalone (no torch):  nvcc -O3 -arch=sm_90 -o cluster_sync bench/cluster_sync.cu && ./cluster_sync
// One cluster is launched (as the flow kernel does); times are CUDA-event
// times of the whole launch for N and 2N barriers, differenced, so launch
// overhead and the one-off prologue cancel.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace cg = cooperative_groups;

#define CHECK(expr)                                                                           \
  do {                                                                                        \
    cudaError_t e_ = (expr);                                                                  \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_));                 \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int kThreads = 256;

// Two ways to give every block a full copy of an activation of which each
// block computed a slice of f4 float4s:
//   push (pull == 0): each block stores its slice into EVERY block of the
//        cluster (its own region there), then cluster.sync() publishes;
//   pull (pull == 1): each block writes its slice locally (one of two
//        alternating buffers), cluster.sync(), then every block loads all
//        slices from the other blocks' shared memory, then __syncthreads().
//        The alternation makes one barrier per exchange enough: a slice
//        buffer is rewritten only after the next barrier, which every
//        reader passes after its loads.
__global__ void __launch_bounds__(kThreads, 1) cluster_sync_kernel(int iters, int f4, int pull, float* sink) {
  extern __shared__ float4 buf[];  // [nb * f4] full copy, then 2 x [f4] slices
  cg::cluster_group cluster = cg::this_cluster();
  const int nb = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  float4* slices = buf + nb * f4;
  for (int i = threadIdx.x; i < (nb + 2) * f4; i += kThreads) buf[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  cluster.sync();
  for (int it = 0; it < iters; ++it) {
    if (!pull) {
      for (int i = threadIdx.x; i < nb * f4; i += kThreads) {
        const int dst = i / f4, q = i - dst * f4;
        float4* remote = cluster.map_shared_rank(buf + rank * f4, dst);
        remote[q] = make_float4(float(it), float(q), 0.f, 1.f);
      }
      cluster.sync();
    } else {
      float4* mine = slices + (it & 1) * f4;
      for (int q = threadIdx.x; q < f4; q += kThreads) mine[q] = make_float4(float(it), float(q), 0.f, 1.f);
      cluster.sync();
      for (int i = threadIdx.x; i < nb * f4; i += kThreads) {
        const int src = i / f4, q = i - src * f4;
        buf[i] = cluster.map_shared_rank(mine, src)[q];
      }
      __syncthreads();
    }
  }
  // Keep the stores observable.
  if (threadIdx.x == 0 && f4 > 0) sink[blockIdx.x] = buf[0].x;
}

static float time_launch(int cluster, int iters, int f4, int pull, float* sink) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {};
  cfg.gridDim = dim3(cluster);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = size_t(cluster + 2) * f4 * sizeof(float4);
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 20; ++rep) {
    CHECK(cudaEventRecord(a));
    CHECK(cudaLaunchKernelEx(&cfg, cluster_sync_kernel, iters, f4, pull, sink));
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (rep > 2 && ms < best) best = ms;  // minimum of the warm repetitions
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return best * 1000.f;  // us
}

int main() {
  CHECK(cudaFuncSetAttribute(cluster_sync_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  float* sink = nullptr;
  CHECK(cudaMalloc(&sink, 64 * sizeof(float)));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::printf("us per cluster barrier (one cluster, 256 threads per block; difference of 960 vs 1920 barriers)\n");
  std::printf("%8s %24s %10s %10s\n", "cluster", "slice per block", "push us", "pull us");
  const int n = 960;
  // Pushes: none; the flow default's layer 3 (8 rows x 4 columns = 8 float4
  // to each block) and layers 1-2 (8 rows x 16 columns = 32 float4 to each).
  for (int cluster : {2, 4, 8, 16}) {
    for (int f4 : {0, 8, 32}) {
      float us[2];
      for (int pull : {0, 1}) {
        const float t1 = time_launch(cluster, n, f4, pull, sink);
        const float t2 = time_launch(cluster, 2 * n, f4, pull, sink);
        us[pull] = (t2 - t1) / n;
      }
      char what[64];
      std::snprintf(what, sizeof(what), "%d float4", f4);
      std::printf("%8d %24s %10.3f %10.3f\n", cluster, what, us[0], us[1]);
    }
  }
  CHECK(cudaFree(sink));
  return 0;
}
