// \brief fused_ops::flow_euler on CUDA: the entry point, its argument checks
// and the path table that chooses the kernel.
//
// flow_euler integrates dx/dt = MLP([x, t]) (two SiLU hidden layers of H
// units, D features) with num_steps Euler steps for a batch of B rows.  The
// table below lists every path in order of preference; a call takes the
// first whose condition holds (dispatch::PathTable, common/dispatch.h).  At
// the default D = 64, H = 256 in float32 on an H200 (132 SMs): B <= 33
// split (4 blocks per row), B <= 66 split (2 blocks), B <= 132 row, larger
// B wgmma.  Tests force a path with fused_ops._paths.force("flow_euler",
// name) or FUSED_OPS_FORCE_PATH=flow_euler=<name>; a forced path whose
// condition fails raises an error that lists every path.  Every path sums
// in a fixed order (no atomics), so results are bitwise reproducible for
// the same inputs, path and device.  docs/flow_euler.md describes each.
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <climits>

#include "common/dispatch.h"
#include "cuda/flow_euler/paths.cuh"
#include "cuda/primitives/runtime.cuh"
#include "flow_euler.h"

namespace fused_ops {
namespace {

namespace fp = flow_euler_paths;

const dispatch::PathTable<FlowEulerCall, 6> kFlowEulerPaths(
    "flow_euler", "cuda",
    {{
        {"split", "float32, D=64, H=256, sm_90, 2B <= SMs (4 blocks per row if 4B <= SMs)",
         "every weight in registers: layer 2 split over a cluster of 4 (or 2) blocks per row",
         fp::split_applies, fp::launch_split},
        {"row", "float32, D=64, H=256, B <= SMs, ~200 KB shared memory per block (sm_90)",
         "one block per row holds all weights; no inter-block exchange per layer", fp::row_applies,
         fp::launch_row},
        {"cluster", "float32, sm_90, B <= 32, weight slices fit a 16- (or 8-) block cluster",
         "small batches at any D, H: weights read once per call, all steps in one launch",
         fp::cluster_applies, fp::launch_cluster},
        {"wgmma", "float32, D=64, H=256, compute capability 9.0, sm_90a build",
         "large batches: warpgroup products on a CTA pair per 64 rows", fp::wgmma_applies,
         fp::launch_wgmma},
        {"tiled", "float32, sm_80+, H <= 512, a 32-row tile fits shared memory",
         "any B: 3xTF32 tensor-core products with float32 accuracy", fp::tiled_applies,
         fp::launch_tiled},
        {"general", "anything else (float64, larger sizes, older GPUs)",
         "correct for every input: one simple kernel per layer and step", dispatch::always<FlowEulerCall>,
         fp::launch_general},
    }});

Tensor flow_euler_cuda(const Tensor& x0, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                       const Tensor& b2, const Tensor& w3, const Tensor& b3, int64_t num_steps) {
  const cuda::TensorDeviceGuard guard(x0);
  FlowEulerCall c(x0, w1, b1, w2, b2, w3, b3, num_steps);
  FUSED_OPS_CHECK(x0.is_cuda(), "x0 must be a CUDA tensor, got ", device_str(x0));
  if (c.B == 0) return c.x;
  kFlowEulerPaths.run(c);
  return c.x;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) { m.impl("flow_euler", TORCH_BOX(&flow_euler_cuda)); }

}  // namespace fused_ops
