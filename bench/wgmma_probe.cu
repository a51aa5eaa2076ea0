// Hopper wgmma on TF32 operands, measured on the device: which reading of the
// shared-memory descriptor's two byte offsets matches the "core-matrix"
// K-major layout that csrc/cuda/wgmma.cuh documents (a 64 x 64 x 32 product
// checked against a float64 one for both assignments), the accumulator
// layout (the same check), and the rate of 3xTF32 products from shared
// memory: two warpgroups per SM issuing m64n128k8 / m64n64k8 on operands
// resident in shared memory, against eight warps of mma.sync.m16n8k8 from
// registers.  Tenth session's run 1 (bench/results/nvidia-h200-wgmma-probe.txt):
// LBO = 128 B / SBO = 256 B right, 917 vs 470 multiply-adds per clock per SM.
// That run used a scratch copy of this probe with its own copies of the
// instruction wrappers; this file calls the package's (the same instructions)
// and has not been run since.
//
// Standalone (no torch):
//   nvcc -std=c++17 -O3 -Icsrc -gencode arch=compute_90a,code=sm_90a -o wgmma_probe bench/wgmma_probe.cu && ./wgmma_probe
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <cuda_runtime.h>
#include "cuda/wgmma.cuh"

using namespace fused_ops;

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint64_t make_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  uint64_t a = smem_u32(p);
  return ((a & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) | (uint64_t((sbo >> 4) & 0x3FFF) << 32);
}

// Layout in smem of an R x (8*S) operand: k-step block s (R*8 floats), inside:
// [R/8 row groups][2 k halves][8 rows][4 cols]: k-half stride 128 B, row group stride 256 B.
__device__ __forceinline__ int core_off(int r, int k, int R) { return k / 8 * R * 8 + cuda::core_offset(r, k % 8); }

// D[64 x 64] = A[64 x K] B[64 x K]^T, one warpgroup
__global__ void probe_layout(const float* A, const float* B, float* D, int K, uint32_t lbo, uint32_t sbo) {
#if defined(FUSED_OPS_WGMMA)  // the device pass for sm_90a
  extern __shared__ __align__(128) float sm[];
  float* As = sm;
  float* Bs = sm + 64 * K;
  for (int i = threadIdx.x; i < 64 * K; i += blockDim.x) {
    int r = i / K, k = i % K;
    As[core_off(r, k, 64)] = A[i];
    Bs[core_off(r, k, 64)] = B[i];
  }
  cuda::fence_proxy_async();
  __syncthreads();
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  cuda::wgmma_fence();
  for (int s = 0; s < K / 8; ++s) {
    cuda::wgmma_tf32<64>(d, make_desc(As + s * 64 * 8, lbo, sbo), make_desc(Bs + s * 64 * 8, lbo, sbo));
  }
  cuda::wgmma_commit();
  cuda::wgmma_wait<0>();
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) {
      int r = warp * 16 + g + (i >= 2 ? 8 : 0), c = j * 8 + 2 * t + (i & 1);
      D[r * 64 + c] = d[j * 4 + i];
    }
#endif
}

// Throughput: 2 warpgroups, each m64n128 over a resident K=64 chunk, 3 wgmma per k-step.
template <int N>
__global__ void __launch_bounds__(256, 1) probe_tput(float* out, int iters) {
#if defined(FUSED_OPS_WGMMA)  // the device pass for sm_90a
  extern __shared__ __align__(128) float sm[];
  constexpr int K = 64;
  float* As = sm;              // 64 x K, two planes
  float* Bs = sm + 2 * 64 * K; // 2N x K, two planes
  for (int i = threadIdx.x; i < 2 * 64 * K + 2 * 2 * N * K; i += blockDim.x) sm[i] = 1e-3f * (i % 7);
  cuda::fence_proxy_async();
  __syncthreads();
  const int wg = threadIdx.x / 128;
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  cuda::wgmma_fence();
  for (int it = 0; it < iters; ++it) {
    cuda::wgmma_fence();
#pragma unroll
    for (int s = 0; s < K / 8; ++s) {
      const float* ab = As + s * 64 * 8;
      const float* as = ab + 64 * K;
      const float* bb = Bs + s * 2 * N * 8 + wg * N * 8;
      const float* bs = bb + 2 * N * K;
      if constexpr (N == 128) {
        cuda::wgmma_tf32<128>(d, make_desc(as, 128, 256), make_desc(bb, 128, 256));
        cuda::wgmma_tf32<128>(d, make_desc(ab, 128, 256), make_desc(bs, 128, 256));
        cuda::wgmma_tf32<128>(d, make_desc(ab, 128, 256), make_desc(bb, 128, 256));
      } else {
        cuda::wgmma_tf32<64>(d, make_desc(as, 128, 256), make_desc(bb, 128, 256));
        cuda::wgmma_tf32<64>(d, make_desc(ab, 128, 256), make_desc(bs, 128, 256));
        cuda::wgmma_tf32<64>(d, make_desc(ab, 128, 256), make_desc(bb, 128, 256));
      }
    }
    cuda::wgmma_commit();
    cuda::wgmma_wait<0>();
  }
  cuda::wgmma_wait<0>();
  float s = 0;
  for (int i = 0; i < N / 2; ++i) s += d[i];
  out[blockIdx.x * 256 + threadIdx.x] = s;
#endif
}

// mma.sync m16n8k8 tf32 throughput for comparison: 8 warps, each 4x4 tiles, 3 mma each
__global__ void __launch_bounds__(256, 1) probe_mma_sync(float* out, int iters) {
  float acc[4][4][4] = {};
  uint32_t a[4][4], b[4][2];
  for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) a[i][j] = __float_as_uint(1e-3f * (threadIdx.x + i + j));
  for (int i = 0; i < 4; ++i) for (int j = 0; j < 2; ++j) b[i][j] = __float_as_uint(1e-3f * (threadIdx.x + i * j));
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int rep = 0; rep < 3; ++rep)
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n)
          asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                       : "+f"(acc[m][n][0]), "+f"(acc[m][n][1]), "+f"(acc[m][n][2]), "+f"(acc[m][n][3])
                       : "r"(a[m][0]), "r"(a[m][1]), "r"(a[m][2]), "r"(a[m][3]), "r"(b[n][0]), "r"(b[n][1]));
  }
  float s = 0;
  for (int m = 0; m < 4; ++m) for (int n = 0; n < 4; ++n) for (int i = 0; i < 4; ++i) s += acc[m][n][i];
  out[blockIdx.x * 256 + threadIdx.x] = s;
}

static float tf32_trunc(float x) { uint32_t u; memcpy(&u, &x, 4); u &= 0xffffe000u; memcpy(&x, &u, 4); return x; }

int main() {
  int K = 32;
  std::vector<float> A(64 * K), B(64 * K), D(64 * 64);
  srand(1);
  for (auto& v : A) v = tf32_trunc((rand() % 2001 - 1000) / 1000.f);
  for (auto& v : B) v = tf32_trunc((rand() % 2001 - 1000) / 1000.f);
  std::vector<double> R(64 * 64);
  for (int i = 0; i < 64; ++i) for (int j = 0; j < 64; ++j) { double s = 0; for (int k = 0; k < K; ++k) s += double(A[i * K + k]) * B[j * K + k]; R[i * 64 + j] = s; }
  float *dA, *dB, *dD;
  CK(cudaMalloc(&dA, A.size() * 4)); CK(cudaMalloc(&dB, B.size() * 4)); CK(cudaMalloc(&dD, D.size() * 4));
  CK(cudaMemcpy(dA, A.data(), A.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dB, B.data(), B.size() * 4, cudaMemcpyHostToDevice));
  uint32_t cand[2][2] = {{128, 256}, {256, 128}};
  for (auto& c : cand) {
    CK(cudaMemset(dD, 0xff, D.size() * 4));
    probe_layout<<<1, 128, 2 * 64 * K * 4>>>(dA, dB, dD, K, c[0], c[1]);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(D.data(), dD, D.size() * 4, cudaMemcpyDeviceToHost));
    double err = 0; for (int i = 0; i < 64 * 64; ++i) err = fmax(err, fabs(D[i] - R[i]));
    printf("layout LBO=%u SBO=%u: max abs err %.3e (D[0]=%f ref %f, D[77]=%f ref %f)\n", c[0], c[1], err, D[0], R[0], D[77], R[77]);
  }
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int clk; CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0));
  float* dout; CK(cudaMalloc(&dout, sms * 256 * 4));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  {
    size_t smem = (2 * 64 * 64 + 2 * 2 * 128 * 64) * 4;
    CK(cudaFuncSetAttribute(probe_tput<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int iters = 2000;
    probe_tput<128><<<sms, 256, smem>>>(dout, 10); CK(cudaDeviceSynchronize());
    cudaEventRecord(e0); probe_tput<128><<<sms, 256, smem>>>(dout, iters); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    double macs = double(sms) * iters * 8 * 3 * 2 * 64.0 * 128 * 8;
    printf("wgmma n128 x2WG: %.3f ms, %.1f TFLOPS tf32, %.0f MAC/clk/SM (clock %d kHz)\n", ms, 2 * macs / ms / 1e9, macs / sms / (ms * 1e-3 * clk * 1e3), clk);
  }
  {
    size_t smem = (2 * 64 * 64 + 2 * 2 * 64 * 64) * 4;
    CK(cudaFuncSetAttribute(probe_tput<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int iters = 2000;
    probe_tput<64><<<sms, 256, smem>>>(dout, 10); CK(cudaDeviceSynchronize());
    cudaEventRecord(e0); probe_tput<64><<<sms, 256, smem>>>(dout, iters); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    double macs = double(sms) * iters * 8 * 3 * 2 * 64.0 * 64 * 8;
    printf("wgmma n64 x2WG: %.3f ms, %.1f TFLOPS tf32, %.0f MAC/clk/SM\n", ms, 2 * macs / ms / 1e9, macs / sms / (ms * 1e-3 * clk * 1e3));
  }
  {
    int iters = 2000;
    probe_mma_sync<<<sms, 256>>>(dout, 10); CK(cudaDeviceSynchronize());
    cudaEventRecord(e0); probe_mma_sync<<<sms, 256>>>(dout, iters); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    double macs = double(sms) * 8 * iters * 3 * 16 * 1024.0;
    printf("mma.sync m16n8k8 tf32 8 warps: %.3f ms, %.1f TFLOPS, %.0f MAC/clk/SM\n", ms, 2 * macs / ms / 1e9, macs / sms / (ms * 1e-3 * clk * 1e3));
  }
  return 0;
}
