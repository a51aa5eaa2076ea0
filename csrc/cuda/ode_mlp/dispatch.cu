// \brief fused_ops::ode_mlp on CUDA: the entry point, its argument checks and
// the path table that chooses the kernel (csrc/ode_mlp.h for the math).
//
// "split" runs the seed field (D = 64, widths 256, 256, 64, SiLU, float32)
// at small B with 4 or 2 blocks of a cluster per row, every weight in
// registers (cuda/ode_mlp/split.cu); "cluster" runs small float32 batches in
// one thread-block cluster, weights resident in its shared memory
// (cuda/ode_mlp/cluster.cu); "tiled" runs every step, stage and layer in one
// launch on 3xTF32 tensor cores, a block per 32 rows (cuda/ode_mlp/tiled.cu);
// "stepwise" runs the step sequence of csrc/ode_mlp_core.h with cuBLAS
// products over the whole batch (cuda/ode_mlp/stepwise.cu); "shared" and
// "general" run cuda/ode_mlp/general.cu's fused kernel (all steps, stages and
// layers in one launch, a block per 16-row tile) and differ in where a tile's
// activations live.  Tests force a path with
// fused_ops._paths.force("ode_mlp", name) or FUSED_OPS_FORCE_PATH=ode_mlp=<name>.
// No value of t_grid is checked here (that would cost a host
// synchronisation): fused_ops.odeint_mlp checks the grid.
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "common/dispatch.h"
#include "cuda/ode_mlp/paths.cuh"
#include "cuda/primitives/runtime.cuh"

namespace fused_ops {
namespace {

namespace op = ode_mlp_paths;

// split and cluster take the small batches they serve (the seed field;
// B <= 32); stepwise comes before tiled where the forced sweep measured its
// cuBLAS products faster (paths.cuh: wide layers on few row tiles, narrow
// layers on very many rows); tiled then takes every float32 call whose tile
// fits (hidden widths up to 512), where shared/general run one CUDA-core dot
// product per thread; float64 and wider layers fall through.
const dispatch::PathTable<OdeMlpCall, 6> kOdeMlpPaths(
    "ode_mlp", "cuda",
    {{
        {"split", "float32, D=64, widths 256, 256, 64, SiLU, sm_90, 2B <= SMs (4 blocks per row if 4B <= SMs)",
         "the seed field at small B: every weight in registers, layer 2 split over 4 (or 2) blocks per row",
         op::split_applies, op::launch_split},
        {"cluster", "float32, sm_90, B <= 32, every layer's weight slices fit one block of a 16- or 8-block cluster",
         "small batches: weights resident in a cluster's shared memory, one barrier per layer, one launch",
         op::cluster_applies, op::launch_cluster},
        {"stepwise", "B >= 512 and: a row's evaluation >= 4e5 multiply-adds below 2048 rows, widths <= 128 from "
                     "32768 rows, or tiled refused and (>= 6e4 multiply-adds or B >= 16384); forced: any",
         "wide layers or many rows: one cuBLAS product per layer and stage over all rows",
         op::stepwise_applies, op::launch_stepwise},
        {"tiled", "float32, sm_80+, a 32-row tile + 2-3 weight chunks of 32 KB fit shared memory, hidden widths <= 512",
         "tensor cores at float32 accuracy (3xTF32), weights streamed from L2, one launch",
         op::tiled_applies, op::launch_tiled},
        {"shared", "a 16-row tile's working set 16 (D (stages + 2) + 2 Hmax) fits shared memory",
         "activations on chip across all steps and stages, one launch", op::shared_applies,
         op::launch_shared},
        {"general", "anything", "correct for every width: the same kernel, activations in global memory",
         dispatch::always<OdeMlpCall>, op::launch_general},
    }});

Tensor ode_mlp_cuda(const Tensor& x0, const Tensor& t_grid, OptTensors weights,
                    OptTensors biases, const Tensor& time_bias,
                    std::optional<Tensor> sample_bias, int64_t method, int64_t activation,
                    double act_param, bool all_states) {
  const cuda::TensorDeviceGuard guard(x0);
  OdeMlpCall c(x0, t_grid, weights, biases, time_bias, sample_bias, method, activation, act_param,
               all_states);
  FUSED_OPS_CHECK(x0.is_cuda(), "x0 must be a CUDA tensor, got ", device_str(x0));
  if (c.B == 0) return c.states;
  kOdeMlpPaths.run(c);
  return c.states;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) { m.impl("ode_mlp", TORCH_BOX(&ode_mlp_cuda)); }

}  // namespace fused_ops
