// \brief fused_ops::flow_euler_backward on CUDA: the entry point, its
// argument checks and the path table that chooses between the two modes of
// flow_euler_backward.h.
//
// resident   small problems (num_steps * B <= 512, 6 num_steps B H <= 4 Mi):
//            one cooperative launch keeps every step's activations
//            (backward_resident.cu);
// streaming  anything else: per-step recompute with cuBLAS products and
//            small kernels (backward_streaming.cu).
// The choice depends on the sizes only, so results never depend on the
// device's load.  Tests force a mode with
// fused_ops._paths.force("flow_euler_backward", name) or
// FUSED_OPS_FORCE_PATH=flow_euler_backward=<name>.
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <climits>

#include "common/dispatch.h"
#include "cuda/flow_euler/backward_paths.cuh"
#include "cuda/primitives/runtime.cuh"
#include "flow_euler_backward.h"

namespace fused_ops {
namespace {

namespace bp = flow_euler_backward_paths;

const dispatch::PathTable<FlowEulerBackwardCall, 2> kFlowEulerBackwardPaths(
    "flow_euler_backward", "cuda",
    {{
        {"resident", "num_steps * B <= 512 and 6 * num_steps * B * H <= 4 Mi elements",
         "small problems are host-bound: one cooperative launch, no activation recomputed",
         bp::resident_applies, bp::launch_resident},
        {"streaming", "anything else",
         "memory independent of num_steps * B * H: recompute per step, cuBLAS products",
         dispatch::always<FlowEulerBackwardCall>, bp::launch_streaming},
    }});

FlowEulerBackwardCall::Grads flow_euler_backward_cuda(const Tensor& grad_x, const Tensor& x0,
                                                      const Tensor& w1, const Tensor& b1,
                                                      const Tensor& w2, const Tensor& b2,
                                                      const Tensor& w3, const Tensor& b3,
                                                      int64_t num_steps) {
  const cuda::TensorDeviceGuard guard(x0);
  FlowEulerBackwardCall c(grad_x, x0, w1, b1, w2, b2, w3, b3, num_steps);
  FUSED_OPS_CHECK(x0.is_cuda(), "x0 must be a CUDA tensor, got ", device_str(x0));
  // Column-sum partials are for the streaming kernels only: the resident
  // kernel sums the bias gradients in its last phase.
  const int64_t P = flow_backward_resident(c.B, c.H, c.num_steps) ? 0 : (c.B + bp::kChunkRows - 1) / bp::kChunkRows;
  FUSED_OPS_CHECK(P <= INT_MAX && (std::max(c.D, c.H) + bp::kColTile - 1) / bp::kColTile <= 65535,
                  "flow_euler backward: sizes too large for the CUDA kernels (B=", c.B, ", D=", c.D,
                  ", H=", c.H, ")");
  if (c.B == 0) {
    // No rows: every gradient is zero (and grad_x0 is empty).
    bp::zero_weight_grads(c);
    return c.grads();
  }
  kFlowEulerBackwardPaths.run(c);
  return c.grads();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("flow_euler_backward", TORCH_BOX(&flow_euler_backward_cuda));
}

}  // namespace fused_ops
