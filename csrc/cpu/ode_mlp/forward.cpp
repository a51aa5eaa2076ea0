// CPU kernel of fused_ops::ode_mlp (csrc/ode_mlp.h for the math).
//
// Rows are cut into blocks of kRowBlock rows (fixed, never derived from the
// thread count) and each block runs through all steps and stages on its own
// (csrc/ode_mlp_core.h's step: one BLAS product per layer and stage, each
// followed by one fused pass adding the biases and applying the activation,
// and one pass per stage for the Runge-Kutta combination).  The block is
// 256 rows: every product repacks its weights (the BLAS packs the weight
// operand per call), so smaller blocks repack them more often per
// evaluation -- 64-row blocks ran the flow_matching field (five Linear of
// width 512) at B=1024 about 1.3x slower on one thread -- while the
// activations of 256 rows still stream through cache.  With all_states the block
// steps straight through its rows of the output; otherwise it ping-pongs
// between two block buffers.
//
// Determinism: a row's result depends only on its block's products, and a
// block's size only on B, so results are bitwise reproducible for any number
// of threads once B > kRowBlock; with one block the BLAS may thread the
// products itself (reproducible at a given thread count).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <vector>

#include "cpu/ode_mlp/ops.h"
#include "ode_mlp_core.h"

namespace fused_ops {
namespace {

constexpr int64_t kRowBlock = 256;

template <typename T>
void run_rows(const OdeMlpPtrs<T>& p, T* states, bool all_states, int64_t r0, int64_t rows) {
  std::vector<T> work(size_t(ode_mlp_forward_work(p, rows)));
  ode_mlp_forward_rows(p, cpu::OdeCpuOps<T>{}, states, all_states, r0, rows, work.data(), cpu_device());
}

// torchdiffeq refuses a grid that is not strictly monotone; the CPU kernel
// checks the values too (CUDA does not: it would cost a host synchronisation).
template <typename T>
void check_monotone(const T* t, int64_t S) {
  if (S < 1) return;
  const bool up = t[1] > t[0];
  for (int64_t k = 0; k < S; ++k) {
    FUSED_OPS_CHECK(up ? t[k + 1] > t[k] : t[k + 1] < t[k],
                    "t_grid must be strictly increasing or strictly decreasing, got t_grid[", k,
                    "] = ", t[k], " and t_grid[", k + 1, "] = ", t[k + 1]);
  }
}

}  // namespace

Tensor ode_mlp_cpu(const Tensor& x0, const Tensor& t_grid, OptTensors weights,
                   OptTensors biases, const Tensor& time_bias,
                   std::optional<Tensor> sample_bias, int64_t method, int64_t activation,
                   double act_param, bool all_states) {
  OdeMlpCall c(x0, t_grid, weights, biases, time_bias, sample_bias, method, activation, act_param,
               all_states);
  dispatch_float(c.x0.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const OdeMlpPtrs<T> p(c);
    check_monotone(p.t, p.S);
    if (c.B == 0) return;
    T* out = mdata<T>(c.states);
    const int64_t blocks = (c.B + kRowBlock - 1) / kRowBlock;
    if (blocks == 1) {
      run_rows(p, out, all_states, 0, c.B);
      return;
    }
    torch::stable::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t r0 = b * kRowBlock;
        run_rows(p, out, all_states, r0, std::min(c.B, r0 + kRowBlock) - r0);
      }
    });
  });
  return c.states;
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) { m.impl("ode_mlp", TORCH_BOX(&ode_mlp_cpu)); }

}  // namespace fused_ops
