// \brief CUDA entry points of fused_ops::vae_elbo and vae_elbo_train:
// argument checks, the kernel-path tables, and the ops' CUDA registrations.
//
// The table (common/dispatch.h) lists the paths in order of preference; a
// call takes the first whose condition holds (or the one forced through
// fused_ops._paths / FUSED_OPS_FORCE_PATH).  Each path is one file of this
// folder (tiled_bf16 is tiled.cu's kernel on bfloat16 operands);
// docs/vae_elbo.md describes them and the variants they replaced.
// All-bfloat16 calls take tiled_bf16 or the float32 table on float32 copies
// (vae_elbo_cuda below).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <climits>
#include <cstring>
#include <type_traits>

#include "common/dispatch.h"
#include "common/low_precision.h"
#include "cuda/vae_elbo/paths.cuh"

namespace fused_ops {
namespace {

using vae_elbo_kernels::Launch;

// What the CUDA kernels need beyond the op's checks: a CUDA x (the rest
// is checked against it) and sizes their 32-bit indices hold.
void check_cuda_call(const VaeElboInputs& c, const char* op) {
  FUSED_OPS_CHECK(c.x.is_cuda(), "x must be a CUDA tensor, got ", device_str(c.x));
  FUSED_OPS_CHECK(c.B <= INT_MAX && c.I * c.H <= INT_MAX && c.H * c.L <= INT_MAX, op,
                  ": sizes too large for the CUDA kernels (B <= 2^31 - 1 and weight ",
                  "matrices below 2^31 elements), got B=", c.B, ", I=", c.I, ", H=", c.H,
                  ", L=", c.L);
}

// The fast paths compute the Bernoulli term only (their BCE epilogues);
// other likelihoods take the general path.
template <bool (*Applies)(const Launch&)>
bool bernoulli_and(const Launch& l) {
  return l.c.likelihood == kBernoulli && Applies(l);
}

const dispatch::PathTable<Launch, 6> kPaths("vae_elbo", "cuda", {{
    {"tiled_bf16",
     "Bernoulli likelihood, bfloat16, B >= 2048, sm_80+, H % 16 == 0, H <= 256, a 64-row tile fits "
     "in shared memory",
     "bf16 mma.sync with float32 accumulation, bfloat16 operands in memory: large bfloat16 batches",
     bernoulli_and<vae_elbo_kernels::tiled_bf16_applies>, vae_elbo_kernels::launch_tiled_bf16},
    {"wgmma",
     "Bernoulli likelihood, float32, B >= 2048, H == 256, L <= 32, sm_90a build on a compute "
     "capability 9.0 GPU",
     "3xTF32 warpgroup products from shared memory, weights by bulk copies: the fastest large batches",
     bernoulli_and<vae_elbo_kernels::wgmma_applies>, vae_elbo_kernels::launch_wgmma},
    {"tiled",
     "Bernoulli likelihood, float32, B >= 2048, sm_80+, H % 8 == 0, H <= 256, a 64-row tile fits "
     "in shared memory",
     "3xTF32 mma.sync, 64 rows per CTA on chip: large batches the wgmma path does not take",
     bernoulli_and<vae_elbo_kernels::tiled_applies>, vae_elbo_kernels::launch_tiled},
    {"cublas", "B >= 2048 (float32 or float64, any likelihood) where no tensor-core path applies",
     "four cuBLAS products with fused epilogues: large batches of wide layers, float64 and the other "
     "likelihoods, where the CUDA-core and per-sample paths fall behind",
     vae_elbo_kernels::cublas_applies, vae_elbo_kernels::launch_cublas},
    {"cluster",
     "Bernoulli likelihood, float32, sm_90+, a 16-row tile's activations fit in shared memory "
     "(<= 200 KB), 8 or 16 CTAs fit a cluster",
     "one launch, each layer split over a thread-block cluster: small batches are latency-bound",
     bernoulli_and<vae_elbo_kernels::cluster_applies>, vae_elbo_kernels::launch_cluster},
    {"general",
     "anything else (other likelihoods, float64, older GPUs, activations too large for shared "
     "memory)",
     "correctness first: one CTA per sample, activations in a global workspace",
     dispatch::always<Launch>, vae_elbo_kernels::launch_general},
}});

VaeElboResult vae_elbo_cuda(const Tensor& x, const Tensor& eps, const Tensor& w_enc,
                            const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu,
                            const Tensor& w_logvar, const Tensor& b_logvar, const Tensor& w_dec1,
                            const Tensor& b_dec1, const Tensor& w_dec2, const Tensor& b_dec2,
                            int64_t likelihood) {
  const cuda::TensorDeviceGuard guard(x);
  const bool bf16 = is_bfloat16(x);
  VaeElboCall c(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2,
                b_dec2, /*allow_bfloat16=*/true);
  c.likelihood = check_vae_likelihood(likelihood);
  check_cuda_call(c, "vae_elbo");
  if (c.B == 0) return c.result();
  if (bf16) {
    // bfloat16 reaches the table only for tiled_bf16: chosen (no path
    // forced) or forced (then the table refuses it where it does not
    // apply).  Any other call, a forced float32 path included, runs the
    // float32 table on float32 copies (common/low_precision.h), outputs
    // rounded to bfloat16.
    Launch l{c, false, {}};
    l.bf16 = true;
    l.ab = vae_elbo_kernels::make_args<__nv_bfloat16>(c);
    const char* forced = kPaths.forced_name();
    const bool take = forced ? std::strcmp(forced, "tiled_bf16") == 0
                             : bernoulli_and<vae_elbo_kernels::tiled_bf16_applies>(l);
    if (take) {
      kPaths.run(l);
      return c.result();
    }
    return low_precision::in_float32(ScalarType::BFloat16, vae_elbo_cuda, c.x, c.eps, c.w_enc,
                                     c.b_enc, c.w_mu, c.b_mu, c.w_logvar, c.b_logvar, c.w_dec1,
                                     c.b_dec1, c.w_dec2, c.b_dec2, likelihood);
  }
  dispatch_float(x.scalar_type(), [&](auto zero) {
    if constexpr (std::is_same_v<decltype(zero), float>) {
      kPaths.run(Launch{c, true, vae_elbo_kernels::make_args<float>(c)});
    } else {
      kPaths.run(Launch{c, false, {}});
    }
  });
  return c.result();
}

// vae_elbo_train: vae_elbo's losses plus the activations its backward reads
// (csrc/vae_elbo.h, VaeSavedLayout).  fused_ops.vae_elbo sends CUDA calls
// that need gradients here where vae_elbo_backward would take its cuBLAS
// path and no path is forced (fused_ops/ops/_vae_elbo.py): those skip the
// backward's forward products, and x's gradient when x needs none.
const dispatch::PathTable<Launch, 2> kTrainPaths("vae_elbo_train", "cuda", {{
    {"wgmma", "the wgmma forward's conditions (Bernoulli likelihood, float32, B >= 2048, H == 256, "
              "L <= 32, sm_90a build on a compute capability 9.0 GPU)",
     "the wgmma kernel storing each activation where it forms it: the forward's speed plus "
     "B (2H + 3L + I) stores",
     bernoulli_and<vae_elbo_kernels::wgmma_applies>, vae_elbo_kernels::launch_wgmma},
    {"cublas", "anything else",
     "the forward's cublas chain with its activations in the saved buffer (their products are "
     "the ones the recomputing backward would run)",
     dispatch::always<Launch>, vae_elbo_kernels::launch_cublas},
}});

// The checks of the CPU wrapper (csrc/cpu/vae_elbo/forward.cpp): no bfloat16.
VaeElboTrainResult vae_elbo_train_cuda(const Tensor& x, const Tensor& eps, const Tensor& w_enc,
                                       const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu,
                                       const Tensor& w_logvar, const Tensor& b_logvar,
                                       const Tensor& w_dec1, const Tensor& b_dec1,
                                       const Tensor& w_dec2, const Tensor& b_dec2, int64_t likelihood) {
  const cuda::TensorDeviceGuard guard(x);
  VaeElboTrainCall c(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2,
                     b_dec2);
  c.likelihood = check_vae_likelihood(likelihood);
  check_cuda_call(c, "vae_elbo_train");
  if (c.B == 0) return c.result();
  dispatch_float(x.scalar_type(), [&](auto zero) {
    if constexpr (std::is_same_v<decltype(zero), float>) {
      Launch l{c, true, vae_elbo_kernels::make_args<float>(c)};
      l.train = &c;
      kTrainPaths.run(l);
    } else {
      Launch l{c, false, {}};
      l.train = &c;
      kTrainPaths.run(l);
    }
  });
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("vae_elbo", TORCH_BOX(&vae_elbo_cuda));
  m.impl("vae_elbo_train", TORCH_BOX(&vae_elbo_train_cuda));
}

}  // namespace fused_ops
