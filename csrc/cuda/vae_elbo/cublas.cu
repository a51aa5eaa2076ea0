// \brief cublas path of fused_ops::vae_elbo (and vae_elbo_train): large
// batches that no tensor-core path takes -- hidden widths above 256 (the
// pytorch/examples VAE's 400), float64, the likelihoods other than
// Bernoulli.
//
// Chosen for B >= kTiledMinBatch after wgmma and tiled: there the
// cluster path's CUDA-core products (every weight read once per CTA of every
// 16-row tile) and the general path's one CTA per sample are slower than
// four cuBLAS products with fused epilogues (cublas_chain.cuh: bias + ReLU,
// the head's biases + z + KL row sums, the likelihood's row sums + elbo; row
// sums in double, fixed order).  Workspace: the activations, B (2H + 3L + I)
// elements, and [w_mu; w_logvar], [b_mu; b_logvar]; the training op's path
// of the same name writes the activations into its `saved` output instead.
// float32 products follow torch.backends.cuda.matmul.allow_tf32 (off by
// default).  No value of x is checked: a Bernoulli target outside [0, 1]
// gives its row NaN, as on every CUDA path.

#include "cuda/vae_elbo/cublas_chain.cuh"
#include "cuda/vae_elbo/paths.cuh"

namespace fused_ops {
namespace vae_elbo_kernels {

bool cublas_applies(const Launch& l) { return !l.bf16 && l.c.B >= kTiledMinBatch; }

void launch_cublas(const Launch& l) {
  const VaeElboCall& c = l.c;
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  dispatch_float(c.x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n_w = vae_elbo_chain::up4(2 * c.L * c.H);  // the stacked biases aligned
    const int64_t n_acts = l.train ? 0 : VaeSavedLayout(c.B, c.I, c.H, c.L).total;
    const Tensor work = empty_like_device(c.x, {n_w + 2 * c.L + n_acts});
    T* w_mulv = mdata<T>(work);
    T* b_mulv = w_mulv + n_w;
    T* acts = l.train ? mdata<T>(l.train->saved) : b_mulv + 2 * c.L;
    vae_elbo_chain::stack_heads(c, w_mulv, b_mulv, stream);
    vae_elbo_chain::forward_losses(c, static_cast<const T*>(w_mulv), static_cast<const T*>(b_mulv), acts,
                                   mdata<T>(c.elbo), mdata<T>(c.recon), mdata<T>(c.kl));
  });
}

}  // namespace vae_elbo_kernels
}  // namespace fused_ops
