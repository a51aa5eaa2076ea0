// \brief The argument check of an activation code (common/activations.h),
// written once for the ops that take one (ode_mlp, vae_mlp_elbo); the fakes
// repeat its message (fused_ops/ops/_ode.py: check_activation_code).
#pragma once

#include <cstdint>

#include "common/activations.h"
#include "common/checks.h"

namespace fused_ops {

inline void check_activation_code(int64_t act) {
  FUSED_OPS_CHECK(act >= 0 && act < kNumActs,
                  "activation must be 0 .. 9 (silu, relu, leaky_relu, elu, selu, gelu, gelu_tanh, "
                  "softplus, tanh, sigmoid), got ", act);
}

}  // namespace fused_ops
