// \brief fused_ops::vae_mlp_elbo on CUDA: the entry point and its path table
// (csrc/vae_mlp.h for the math).
//
// "cluster" (cuda/vae_mlp/cluster.cu) runs small float32 batches
// (B <= 512 unless forced) on sm_90 in one launch of thread-block clusters,
// every layer split across a cluster's CTAs by neurons.
//
// "cublas": csrc/vae_mlp_core.h's forward over all B rows at once,
// one cuBLAS product per layer (through common/matmul.h, on torch's current
// stream; the head's mu and logvar in one product, its weight [2L, H]), each
// followed by one fused kernel of cuda/vae_mlp/ops.cuh: bias + activation
// in place, the head's bias + reparameterisation + KL row sums, the last
// layer's bias + likelihood + recon row sums + elbo.  Launches: Le + Ld + 1
// products and as many kernels.  Workspace: B (sum of widths + 3L + I)
// elements, one allocation from torch's caching allocator.  float32 products
// follow torch.backends.cuda.matmul.allow_tf32 (off by default).
// Deterministic: cuBLAS products of fixed shapes, row sums in a fixed order.
// No value of x is checked (a Bernoulli target outside [0, 1] gives that
// row NaN): a check would cost a host synchronisation.
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <tuple>

#include "common/dispatch.h"
#include "cuda/primitives/runtime.cuh"
#include "cuda/vae_mlp/ops.cuh"
#include "vae_mlp_core.h"

namespace fused_ops {
namespace vae_mlp_paths {
// cluster.cu
bool cluster_applies(const VaeMlpCall& c);
void launch_cluster(const VaeMlpCall& c);
}  // namespace vae_mlp_paths

namespace {

void launch_cublas(const VaeMlpCall& c) {
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  dispatch_float(c.x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const VaeMlpPtrs<T> p(c);
    const Tensor work = empty_like_device(c.x, {VaeMlpActs<T>::size(p, c.B, false)});
    const VaeMlpActs<T> a(p, c.B, false, mdata<T>(work));
    vae_mlp_forward_rows(p, vae_mlp_cuda::VaeMlpCudaOps<T>(stream), 0, c.B, a, mdata<T>(c.elbo),
                         mdata<T>(c.recon), mdata<T>(c.kl), c.x.device());
  });
}

const dispatch::PathTable<VaeMlpCall, 2> kVaeMlpPaths(
    "vae_mlp_elbo", "cuda",
    {{
        {"cluster",
         "float32, sm_90, B <= 512 (any B when forced), a 16-row tile's activations fit shared memory, "
         "an 8- or 16-CTA cluster co-schedules",
         "small batches in one launch: layers split across a cluster's CTAs, activations exchanged in "
         "distributed shared memory",
         vae_mlp_paths::cluster_applies, vae_mlp_paths::launch_cluster},
        {"cublas", "anything",
         "any depth, widths, activation and likelihood: cuBLAS products with fused epilogue kernels",
         dispatch::always<VaeMlpCall>, launch_cublas},
    }});

std::tuple<Tensor, Tensor, Tensor> vae_mlp_elbo_cuda(
    const Tensor& x, const Tensor& eps, VaeOptTensors enc_weights, VaeOptTensors enc_biases,
    const Tensor& w_head, const Tensor& b_head, VaeOptTensors dec_weights, VaeOptTensors dec_biases,
    std::optional<Tensor> dec_logvar, int64_t activation, double act_param, int64_t likelihood) {
  const cuda::TensorDeviceGuard guard(x);
  VaeMlpCall c(x, eps, enc_weights, enc_biases, w_head, b_head, dec_weights, dec_biases, dec_logvar,
               activation, act_param, likelihood);
  FUSED_OPS_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", device_str(x));
  if (c.B > 0) kVaeMlpPaths.run(c);
  return {c.elbo, c.recon, c.kl};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) { m.impl("vae_mlp_elbo", TORCH_BOX(&vae_mlp_elbo_cuda)); }

}  // namespace fused_ops
