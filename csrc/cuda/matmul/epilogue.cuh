// \brief The matmul table's epilogue (common/matmul.h's cuda_matmul::Epilogue)
// as one element's work, shared by the tf32x3 kernel's stores, its split-K
// add and the pass after a cuBLAS product.
//
// v = sum + cb[c], then + rb[i] -- the order of the ops' bias_act passes
// (cuda/ode_mlp/ops.cuh), so that a layer gives the same bits whichever of
// them adds its bias to the same sum; i = r * ldo + c indexes out, rb and h.
#pragma once

#include "common/activations.h"
#include "common/matmul.h"

namespace fused_ops {
namespace cuda_matmul {

__device__ __forceinline__ void finish(const Epilogue& e, float sum, int64_t i, int c, float* out) {
  float v = sum;
  if (e.cb) v += e.cb[c];
  if (e.rb) v += e.rb[i];
  if (e.h == out) {
    out[i] = activate(e.act, e.act_param, v);
    return;
  }
  out[i] = v;
  if (e.h) e.h[i] = activate(e.act, e.act_param, v);
}

}  // namespace cuda_matmul
}  // namespace fused_ops
