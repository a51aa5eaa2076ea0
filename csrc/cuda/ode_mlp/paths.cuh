// \brief fused_ops::ode_mlp CUDA paths: predicate and launcher of every path
// (dispatch.cu holds the table that orders them).  docs/ode.md describes them.
#pragma once

#include "ode_mlp.h"

namespace fused_ops {
namespace ode_mlp_paths {

// stepwise: from kStepwiseMinRows rows, when a row's evaluation of the field
// takes at least kStepwiseWideMacs multiply-adds (a 256 x 256 hidden layer),
// or from kStepwiseManyRows rows at any width.  Below, the fused kernel's one
// launch beats the products' launches: its tiles all run in one wave, so its
// time hardly grows with B until the grid passes a few waves (16 rows per
// block), while the products cost a launch each.  Measured crossovers (H200,
// D=2, midpoint, 20 steps: tools/ode_path_sweep.py,
// bench/results/nvidia-h200-ode-path-sweep.md): widths 256 and 512 favour
// stepwise from 512 rows (1.8-10x); widths 64 and 128 favour the fused
// kernel up to 4096 rows and stepwise from 16384 (1.5-4x).
constexpr int64_t kStepwiseMinRows = 512;
constexpr int64_t kStepwiseManyRows = 16384;
constexpr double kStepwiseWideMacs = 6e4;

// split: float32, sm_90, D = 64, widths 256, 256, 64, SiLU, 4 (or 2) blocks
// per row all resident (4B <= SMs, else 2B <= SMs) (split.cu).
bool split_applies(const OdeMlpCall& c);
void launch_split(const OdeMlpCall& c);
// cluster: float32, sm_90, B <= 32, the weight slices fit a 16- or 8-block cluster (cluster.cu).
bool cluster_applies(const OdeMlpCall& c);
void launch_cluster(const OdeMlpCall& c);
// tiled (tiled.cu): float32, sm_80+, a 32-row tile's working set and two
// or three 32 KB weight chunks fit shared memory, hidden layers after the
// first at most 512 wide.  Any B.
bool tiled_applies(const OdeMlpCall& c);
void launch_tiled(const OdeMlpCall& c);
bool stepwise_applies(const OdeMlpCall& c);
void launch_stepwise(const OdeMlpCall& c);  // cuBLAS products over the batch, float32 and float64
bool shared_applies(const OdeMlpCall& c);
void launch_shared(const OdeMlpCall& c);
void launch_general(const OdeMlpCall& c);  // any sizes, float32 and float64

}  // namespace ode_mlp_paths
}  // namespace fused_ops
