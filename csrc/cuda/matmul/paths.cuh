// \brief What the CUDA paths of fused_ops::matmul share: the call (one
// float32 product and its epilogue, common/matmul.h's cuda_matmul::Call), the
// tf32x3 path's predicate and launcher (tf32x3.cu), the epilogue pass after
// a cuBLAS or unsplit tf32x3 product (epilogue.cu), and the split-K workspace.
//
// The table (dispatch.cu) is the one through which every CUDA float32
// product of every op's kernels goes (common/matmul.h's matmul, linear_nt
// and LinearNT): tests and benchmarks force a path with
// fused_ops._paths.force("matmul", ...) like any op's.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "common/matmul.h"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace cuda_matmul {

// Whether the tf32x3 kernel computes this product: sizes below 2^30 (out
// below 2^31 elements), each operand readable by float4 loads along one
// axis (a unit stride there, the other stride and that axis's extent
// multiples of 4, 16-byte aligned), an sm_90a build on a compute
// capability 9.0 GPU.
bool tf32x3_can_run(const Call& c);
void launch_tf32x3(const Call& c);  // the product and its epilogue

// c's epilogue over c.out in place (epilogue.cu): after a cuBLAS or unsplit
// tf32x3 product.
void launch_epilogue(const Call& c);

// A float32 workspace of n elements on CUDA device `device` (the split-K
// partials), from torch's caching allocator on the current stream.
inline Tensor cuda_workspace(int device, int64_t n) {
  int64_t size = n > 0 ? n : 1, stride = 1;
  AtenTensorHandle out = nullptr;
  FUSED_OPS_CHECK(aoti_torch_empty_strided(1, &size, &stride, aoti_torch_dtype_float32(),
                                           aoti_torch_device_type_cuda(), device, &out) == AOTI_TORCH_SUCCESS,
                  "fused_ops: could not allocate the matmul workspace (", size, " floats)");
  return Tensor(out);
}

}  // namespace cuda_matmul
}  // namespace fused_ops
