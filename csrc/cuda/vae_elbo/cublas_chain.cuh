// \brief The one-hidden-layer VAE's forward chain on cuBLAS, shared by the
// forward's and the training op's `cublas` paths (cublas.cu) and the
// backward's recompute (backward_cublas.cu).
//
// Four products through common/matmul.h (aten mm.out on views of raw
// buffers, on torch's current stream; the head's mu and logvar in one
// product against [w_mu; w_logvar] [2L, H]), each followed by one fused
// elementwise kernel: bias + ReLU in place (backward_paths.cuh's functors,
// ReLU(NaN) = NaN as the other paths), then either the backward's latent
// stage (biases, z) and the logits left without their bias, or, for the
// losses, cuda/vae_mlp/ops.cuh's head kernel (biases, z, the KL row sums in
// double) and likelihood kernel (the logits' bias in place, the terms of
// common/likelihood.h, recon row sums in double, elbo).  Fixed shapes and
// fixed-order sums: deterministic.
//
// Buffers: h [B, H] | ml [B, 2L] | z [B, L] | g [B, H] | logits [B, I] --
// with the losses' bias added, csrc/vae_elbo.h's VaeSavedLayout, which the
// training op's path writes straight into its `saved` output.
#pragma once

#include "common/matmul.h"
#include "cuda/primitives/tile_gemm.cuh"
#include "cuda/vae_elbo/backward_paths.cuh"
#include "cuda/vae_mlp/ops.cuh"

namespace fused_ops {
namespace vae_elbo_chain {

using vae_elbo_backward_kernels::AddBias;
using vae_elbo_backward_kernels::AddBiasRelu;
using vae_elbo_backward_kernels::Reparameterize;

// Workspace pieces start on multiples of 4 elements (16-byte aligned float
// pieces, for the float4 and double views some kernels take of them).
constexpr int64_t up4(int64_t n) { return (n + 3) / 4 * 4; }

// The backward's latent stage in one launch: ml [B, 2L] holds h @
// [w_mu; w_logvar]^T; adds both biases in place, then z.
template <typename T>
struct LatentForward {
  AddBias<T> mu, lv;
  Reparameterize<T> reparameterize;
  __device__ void operator()(int64_t b, int64_t l, T) const {
    const int64_t L = reparameterize.L;
    mu(b, l, mu.c[b * 2 * L + l]);
    lv(b, l, lv.c[b * 2 * L + l]);
    reparameterize(b, l, T(0));
  }
};

// [w_mu; w_logvar] [2L, H] into w_mulv and, where b_mulv is given,
// [b_mu; b_logvar] [2L] into it (device copies on `stream`).
template <typename T>
void stack_heads(const VaeElboInputs& c, T* w_mulv, T* b_mulv, cudaStream_t stream) {
  auto copy = [&](T* dst, const Tensor& src, int64_t n) {
    FUSED_OPS_CUDA_CHECK(
        cudaMemcpyAsync(dst, cdata<T>(src), size_t(n) * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  };
  copy(w_mulv, c.w_mu, c.L * c.H);
  copy(w_mulv + c.L * c.H, c.w_logvar, c.L * c.H);
  if (b_mulv) {
    copy(b_mulv, c.b_mu, c.L);
    copy(b_mulv + c.L, c.b_logvar, c.L);
  }
}

// The encoder into h (bias + ReLU) and the head's product into ml.
template <typename T>
void encoder_and_head(const VaeElboInputs& c, const T* w_mulv, T* h, T* ml, cudaStream_t stream) {
  const int64_t B = c.B, I = c.I, H = c.H, L = c.L;
  const torch::stable::Device dev = c.x.device();
  linear_nt(cdata<T>(c.x), I, cdata<T>(c.w_enc), I, h, H, B, H, I, dev);
  cuda::apply_epilogue(stream, h, H, B, H, AddBiasRelu<T>{h, H, cdata<T>(c.b_enc)});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  linear_nt(static_cast<const T*>(h), H, w_mulv, H, ml, 2 * L, B, 2 * L, H, dev);
}

// The decoder from z: g (bias + ReLU), then the logits' product into a3.
template <typename T>
void decoder(const VaeElboInputs& c, const T* z, T* g, T* a3, cudaStream_t stream) {
  const int64_t B = c.B, I = c.I, H = c.H, L = c.L;
  const torch::stable::Device dev = c.x.device();
  linear_nt(z, L, cdata<T>(c.w_dec1), L, g, H, B, H, L, dev);
  cuda::apply_epilogue(stream, g, H, B, H, AddBiasRelu<T>{g, H, cdata<T>(c.b_dec1)});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  linear_nt(static_cast<const T*>(g), H, cdata<T>(c.w_dec2), H, a3, I, B, I, H, dev);
}

// The backward's recompute: h, ml (biases added), z, g and the logits
// before their bias in a3.
template <typename T>
void forward_chain(const VaeElboInputs& c, const T* w_mulv, T* h, T* ml, T* z, T* g, T* a3) {
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  encoder_and_head(c, w_mulv, h, ml, stream);
  cuda::apply_epilogue(stream, ml, 2 * c.L, c.B, c.L,
                       LatentForward<T>{{ml, 2 * c.L, cdata<T>(c.b_mu)},
                                        {ml + c.L, 2 * c.L, cdata<T>(c.b_logvar)},
                                        {ml, cdata<T>(c.eps), z, c.L}});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  decoder(c, static_cast<const T*>(z), g, a3, stream);
}

// The forward with its losses: acts in VaeSavedLayout (the logits with
// their bias), elbo / recon / kl [B].
template <typename T>
void forward_losses(const VaeElboInputs& c, const T* w_mulv, const T* b_mulv, T* acts, T* elbo, T* recon,
                    T* kl) {
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  const VaeSavedLayout lay(c.B, c.I, c.H, c.L);
  T *h = acts + lay.h, *ml = acts + lay.ml, *z = acts + lay.z, *g = acts + lay.g, *a = acts + lay.logits;
  const vae_mlp_cuda::VaeMlpCudaOps<T> ops(stream);
  encoder_and_head(c, w_mulv, h, ml, stream);
  ops.head(ml, b_mulv, cdata<T>(c.eps), z, kl, c.B, c.L);
  decoder(c, static_cast<const T*>(z), g, a, stream);
  ops.recon(a, cdata<T>(c.b_dec2), cdata<T>(c.x), nullptr, kl, recon, elbo, c.B, c.I, c.likelihood);
}

}  // namespace vae_elbo_chain
}  // namespace fused_ops
