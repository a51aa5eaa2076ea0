// \brief fused_ops::ode_mlp CUDA paths: predicate and launcher of every path
// (dispatch.cu holds the table that orders them).  docs/ode.md describes them.
#pragma once

#include "ode_mlp.h"

namespace fused_ops {
namespace ode_mlp_paths {

// stepwise (natural choice; forced, it runs any size): from
// kStepwiseMinRows rows where the forced sweep (tools/ode_path_sweep.py,
// H200, D=2, midpoint, 20 steps: bench/results/nvidia-h200-ode-path-sweep.md)
// measured it faster than tiled, else where tiled cannot run and the
// products beat the fused kernel:
// - wide layers on few row tiles: a row's evaluation >= kStepwiseFewTilesMacs
//   multiply-adds (four 512-wide layers) below kStepwiseFewTilesRows rows,
//   where tiled's blocks (32 rows each) do not fill the GPU and each streams
//   every weight from L2 (1024 rows at widths 512: 4.8 ms against 7.2);
// - narrow layers on very many rows: hidden widths <= kStepwiseNarrowWidth
//   from kStepwiseNarrowRows rows (65536 rows at width 64: 6.1 ms against 8.3);
// - where tiled does not apply (float64, in-place layers wider than 512):
//   a row's evaluation >= kStepwiseWideMacs multiply-adds, or from
//   kStepwiseManyRows rows at any width; below, the fused kernel's one
//   launch beats the products' launches.
constexpr int64_t kStepwiseMinRows = 512;
constexpr double kStepwiseFewTilesMacs = 4e5;
constexpr int64_t kStepwiseFewTilesRows = 2048;
constexpr int64_t kStepwiseNarrowWidth = 128;
constexpr int64_t kStepwiseNarrowRows = 32768;
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
