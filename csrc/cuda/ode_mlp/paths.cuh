// \brief fused_ops::ode_mlp CUDA paths: predicate and launcher of every path
// (dispatch.cu holds the table that orders them).  docs/ode.md describes them.
#pragma once

#include "ode_mlp.h"

namespace fused_ops {
namespace ode_mlp_paths {

// stepwise: at least this many rows and multiply-adds per evaluation of the
// field over the batch (below, launches and small products cost more than the
// fused kernel's single launch).
constexpr int64_t kStepwiseMinRows = 512;
constexpr double kStepwiseMinMacs = 2.5e7;

bool stepwise_applies(const OdeMlpCall& c);
void launch_stepwise(const OdeMlpCall& c);  // cuBLAS products over the batch, float32 and float64
bool shared_applies(const OdeMlpCall& c);
void launch_shared(const OdeMlpCall& c);
void launch_general(const OdeMlpCall& c);  // any sizes, float32 and float64

}  // namespace ode_mlp_paths
}  // namespace fused_ops
