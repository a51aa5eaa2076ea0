// \brief CUDA entry of fused_ops::matmul (common/matmul.h): the kernel-path
// table of the float32 products every op's CUDA kernels run on raw buffers.
//
// The tf32x3 path (tf32x3.cu) is taken for products large enough that its
// tensor-core tiles beat cuBLAS's float32 CUDA-core kernels; the rest go to
// cuBLAS through aten::mm.out, on torch's current stream.  A call's epilogue
// (a hidden layer's bias and activation) is done by tf32x3's split-K add,
// or by one pass after the product.

#include "common/dispatch.h"
#include "cuda/matmul/paths.cuh"

namespace fused_ops {
namespace cuda_matmul {
namespace {

// Multiply-adds from which tf32x3 is taken: at every shape of
// bench/results/nvidia-h200-matmul-sweep.md from 2^24 up it beat cuBLAS;
// smaller products were not measured and stay on cuBLAS.  The narrowest
// output edge it takes: a 128 x 128 tile over an edge of 64 already
// computes twice what it keeps.
constexpr int64_t kMinMacs = int64_t(1) << 24;
constexpr int64_t kMinEdge = 64;

bool tf32x3_applies(const Call& c) {
  const bool large = c.m >= kMinEdge && c.n >= kMinEdge && c.m * c.n * c.k >= kMinMacs;
  return (large || dispatch::is_forced("matmul", "cuda", "tf32x3")) && tf32x3_can_run(c);
}

void launch_cublas(const Call& c) {
  const torch::stable::Device dev(torch::headeronly::DeviceType::CUDA, c.device);
  mm_out(matrix_view(c.a, c.m, c.k, c.a_rs, c.a_cs, dev), matrix_view(c.b, c.k, c.n, c.b_rs, c.b_cs, dev),
         matrix_view(c.out, c.m, c.n, c.ldo, 1, dev));
  if (c.epilogue.on) launch_epilogue(c);
}

const dispatch::PathTable<Call, 2> kPaths("matmul", "cuda", {{
    {"tf32x3",
     "float32, m, n >= 64, m n k >= 2^24, each operand contiguous along one axis (strides and that "
     "axis's extent multiples of 4, 16-byte aligned), sm_90a build on a compute capability 9.0 GPU",
     "3xTF32 warpgroup tensor-core products, float32-accurate (a bias and activation in the split-K "
     "add, else one pass): the large products of the ops' cuBLAS paths, which cuBLAS runs on the CUDA "
     "cores at float32 precision",
     tf32x3_applies, launch_tf32x3},
    {"cublas", "anything else",
     "cuBLAS through aten::mm.out (and one pass for a bias and activation): small, odd-strided and "
     "pre-Hopper products",
     dispatch::always<Call>, launch_cublas},
}});

}  // namespace

void run(const Call& c) { kPaths.run(c); }

}  // namespace cuda_matmul
}  // namespace fused_ops
