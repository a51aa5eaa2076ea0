// \brief CPU kernel of fused_ops::vae_mlp_elbo (float32 and float64; the only
// CPU path: no path table).  csrc/vae_mlp.h for the math.
//
// The batch is cut into blocks of kRows rows (fixed, never derived from the
// thread count) and each block runs csrc/vae_mlp_core.h's forward on its own
// inside torch's parallel loop -- one BLAS product per layer (the head's mu
// and logvar in one: its weight is [2L, H]), each followed by one fused pass
// (cpu/vae_mlp/ops.h) -- while its activations (kRows * (sum of widths + 3L
// + I) elements) stay in cache.  ATen runs each block's products on the
// calling thread, so a row's result depends only on its block: bitwise the
// same for any number of threads.
//
// The Bernoulli likelihood's targets must be probabilities, as
// binary_cross_entropy requires: one pass over x before the blocks raises,
// naming the first element outside [0, 1] (NaN included).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <iomanip>
#include <limits>
#include <sstream>
#include <tuple>
#include <vector>

#include "cpu/vae_mlp/ops.h"
#include "vae_mlp_core.h"

namespace fused_ops {
namespace {

constexpr int64_t kRows = 64;

template <typename T>
void check_targets(const T* x, int64_t B, int64_t I) {
  for (int64_t k = 0; k < B * I; ++k) {
    if (is_probability(x[k])) continue;
    std::ostringstream value;
    value << std::setprecision(std::numeric_limits<T>::max_digits10) << x[k];
    FUSED_OPS_CHECK(false, "x must hold binary cross-entropy targets in [0, 1] (the range "
                    "torch.nn.functional.binary_cross_entropy requires of its target), got x[",
                    k / I, ", ", k % I, "] = ", value.str());
  }
}

template <typename T>
void run_block(const VaeMlpPtrs<T>& p, const VaeMlpCall& c, int64_t r0, int64_t rows) {
  std::vector<T> work(size_t(VaeMlpActs<T>::size(p, rows, false)));
  const VaeMlpActs<T> a(p, rows, false, work.data());
  vae_mlp_forward_rows(p, cpu::VaeMlpCpuOps<T>{}, r0, rows, a, mdata<T>(c.elbo) + r0,
                       mdata<T>(c.recon) + r0, mdata<T>(c.kl) + r0, cpu_device());
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> vae_mlp_elbo_cpu(
    const Tensor& x, const Tensor& eps, VaeOptTensors enc_weights, VaeOptTensors enc_biases,
    const Tensor& w_head, const Tensor& b_head, VaeOptTensors dec_weights, VaeOptTensors dec_biases,
    std::optional<Tensor> dec_logvar, int64_t activation, double act_param, int64_t likelihood) {
  VaeMlpCall c(x, eps, enc_weights, enc_biases, w_head, b_head, dec_weights, dec_biases, dec_logvar,
               activation, act_param, likelihood);
  dispatch_float(c.x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const VaeMlpPtrs<T> p(c);
    if (c.likelihood == kBernoulli) check_targets(p.x, c.B, c.I);
    if (c.B == 0) return;
    const int64_t blocks = (c.B + kRows - 1) / kRows;
    if (blocks == 1) {
      run_block(p, c, 0, c.B);
      return;
    }
    torch::stable::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t r0 = b * kRows;
        run_block(p, c, r0, std::min(c.B, r0 + kRows) - r0);
      }
    });
  });
  return {c.elbo, c.recon, c.kl};
}

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) { m.impl("vae_mlp_elbo", TORCH_BOX(&vae_mlp_elbo_cpu)); }

}  // namespace fused_ops
