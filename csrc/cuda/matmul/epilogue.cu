// \brief The epilogue (common/matmul.h's cuda_matmul::Epilogue) of a product
// already stored (cuBLAS's, or an unsplit tf32x3 one): one pass over out, in
// place, on the current stream.
#include <algorithm>

#include "cuda/matmul/epilogue.cuh"
#include "cuda/matmul/paths.cuh"

namespace fused_ops {
namespace cuda_matmul {
namespace {

// Grid-stride over the m x n elements, a thread's consecutive elements a
// row's consecutive columns (coalesced at any row stride).
__global__ void epilogue_kernel(float* out, int64_t ldo, int64_t M, int64_t N, const Epilogue e) {
  const int64_t n = M * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % N);
    const int64_t o = (i / N) * ldo + c;
    finish(e, out[o], column_bias(e, c), o, out);
  }
}

}  // namespace

void launch_epilogue(const Call& c) {
  if (c.m == 0 || c.n == 0) return;
  const int64_t sms = cuda::multiprocessor_count(c.device);
  const int64_t blocks = std::min<int64_t>((c.m * c.n + 255) / 256, 8 * sms);
  epilogue_kernel<<<unsigned(blocks), 256, 0, cuda::current_stream(c.device)>>>(c.out, c.ldo, c.m, c.n, c.epilogue);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace cuda_matmul
}  // namespace fused_ops
