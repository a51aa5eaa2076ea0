// \brief The matmul table's epilogue (common/matmul.h's cuda_matmul::Epilogue)
// as one element's work, shared by the tf32x3 path's split-K add and the
// pass after an unsplit product.
//
// v = sum + cb[c], then + rb[i] -- the order of the ops' bias_act passes
// (cuda/ode_mlp/ops.cuh), so that a layer gives the same bits whichever of
// them adds its bias to the same sum; i = r * ldo + c indexes out, rb and h.
// `bias` is cb[c], loaded by the caller (column_bias; unused when cb is null).
#pragma once

#include "common/activations.h"
#include "common/matmul.h"

namespace fused_ops {
namespace cuda_matmul {

__device__ __forceinline__ float column_bias(const Epilogue& e, int c) { return e.cb ? e.cb[c] : 0.f; }

__device__ __forceinline__ void finish(const Epilogue& e, float sum, float bias, int64_t i, float* out) {
  float v = sum;
  if (e.cb) v += bias;
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
