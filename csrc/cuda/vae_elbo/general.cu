// \brief General path of fused_ops::vae_elbo: any size, float32 or float64.
//
// Chosen when no other path applies: a likelihood other than the Bernoulli
// default (common/likelihood.h: the other paths compute BCE only), float64,
// GPUs below compute capability 8.0 (below 9.0 for batches under
// kTiledMinBatch), and float32 sizes whose
// activations fit in shared memory neither as a 16-row cluster tile nor as a
// 64-row tensor-core tile (e.g. B=64, I=4000, H=1500, L=40).
//
// Design: one CTA of kThreads per sample; its activations live in a global
// workspace row h [H] | z [L] | KL terms [L] | g [H]; every neuron is one
// warp's dot product (lanes stride over K, then a butterfly), neurons dealt
// to the warps round-robin.  The BCE terms are summed per warp in neuron
// order and then over the warps in order: a fixed order, no atomics.  The
// term is the call's likelihood's (common/likelihood.h's recon_term).

#include "common/likelihood.h"
#include "cuda/vae_elbo/paths.cuh"

namespace fused_ops {
namespace vae_elbo_kernels {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) vae_elbo_general_kernel(const Args<T> a, T* ws,
                                                                     int64_t likelihood) {
  __shared__ T scratch[kWarps];
  const int I = a.I, H = a.H, L = a.L;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int64_t row = blockIdx.x;
  const T* x = a.x + row * I;
  T* h = ws + row * (2 * int64_t(H) + 2 * L);
  T* z = h + H;
  T* terms = z + L;
  T* g = terms + L;
  auto dot = [&](const T* in, const T* w, int K) {
    T s = T(0);
    for (int k = lane; k < K; k += cuda::kWarpSize) s += in[k] * w[k];
    return cuda::group_allreduce(s, cuda::kWarpSize);
  };
  for (int n = warp; n < H; n += kWarps) {
    const T v = relu(dot(x, a.w_enc + int64_t(n) * I, I) + a.b_enc[n]);
    if (lane == 0) h[n] = v;
  }
  __syncthreads();
  for (int l = warp; l < L; l += kWarps) {
    const T mu = dot(h, a.w_mu + int64_t(l) * H, H) + a.b_mu[l];
    const T lv = dot(h, a.w_lv + int64_t(l) * H, H) + a.b_lv[l];
    if (lane == 0) {
      z[l] = mu + exp(T(0.5) * lv) * a.eps[row * L + l];
      terms[l] = ((T(1) + lv) - mu * mu) - exp(lv);
    }
  }
  __syncthreads();
  for (int n = warp; n < H; n += kWarps) {
    const T v = relu(dot(z, a.w_d1 + int64_t(n) * L, L) + a.b_d1[n]);
    if (lane == 0) g[n] = v;
  }
  __syncthreads();
  T part = T(0);  // lane 0 of each warp: its neurons' BCE terms, in order
  for (int i = warp; i < I; i += kWarps) {
    const T v = dot(g, a.w_d2 + int64_t(i) * H, H) + a.b_d2[i];
    if (lane == 0) part += recon_term(likelihood, v, x[i]);
  }
  const T recon = cuda::block_allreduce(part, scratch);
  if (threadIdx.x == 0) {
    T kl_sum = T(0);
    for (int l = 0; l < L; ++l) kl_sum += terms[l];
    store_losses(a, row, recon, kl_sum);
  }
}

template <typename T>
void run_general(const Args<T>& a, const Tensor& like, int64_t likelihood) {
  Tensor ws = empty_like_device(like, {int64_t(a.B) * (2 * int64_t(a.H) + 2 * a.L)});
  vae_elbo_general_kernel<T><<<unsigned(a.B), kThreads, 0,
                               cuda::current_stream(cuda::current_device())>>>(
      a, mdata<T>(ws), likelihood);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void launch_general(const Launch& l) {
  if (l.f32) {
    run_general<float>(l.a, l.c.x, l.c.likelihood);
  } else {
    run_general<double>(make_args<double>(l.c), l.c.x, l.c.likelihood);
  }
}

}  // namespace vae_elbo_kernels
}  // namespace fused_ops
