// \brief fused_ops::ode_mlp CUDA paths: predicate and launcher of every path
// (dispatch.cu holds the table that orders them).  docs/ode.md describes them.
#pragma once

#include "ode_mlp.h"

namespace fused_ops {
namespace ode_mlp_paths {

bool shared_applies(const OdeMlpCall& c);
void launch_shared(const OdeMlpCall& c);
void launch_general(const OdeMlpCall& c);  // any sizes, float32 and float64

}  // namespace ode_mlp_paths
}  // namespace fused_ops
