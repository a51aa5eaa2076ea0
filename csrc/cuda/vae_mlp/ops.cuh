// \brief The elementwise passes of vae_mlp_elbo's sequence on CUDA (the `Ops`
// of csrc/vae_mlp_core.h), each one small kernel on torch's current stream:
// the VAE's own passes below, beside ode_mlp's bias/activation,
// activation-gradient, add, zero and column-sum kernels
// (cuda/ode_mlp/ops.cuh), which it inherits.
//
// Launch geometry and numerics:
// - head: one thread per row, its L latent units in order (mu and logvar
//   read from the head product's [rows, 2L] rows); the KL row sum in double,
//   in order (as the CPU kernel sums it).
// - recon: one warp per row (8 rows per 256-thread block); lane j adds the
//   bias to features j, j + 32, ... of its row in place and sums their terms
//   in double, then a butterfly (cuda/primitives/reductions.cuh) gives the
//   row's sum: a fixed order, deterministic.
// - recon_backward, head_backward: grid-stride loops over the elements
//   ([rows, I] and [rows, L]), the row's upstream gradients read per element.
// No atomics: every sum has a fixed order.
#pragma once

#include <cuda_runtime.h>

#include "common/likelihood.h"
#include "cuda/ode_mlp/ops.cuh"
#include "cuda/primitives/reductions.cuh"
#include "vae_mlp.h"

namespace fused_ops {
namespace vae_mlp_cuda {

using ode_cuda::grid_for;
using ode_cuda::kThreads;
constexpr int kWarpsPerBlock = kThreads / 32;

#define VAE_FOR(e, n) \
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < (n); e += int64_t(gridDim.x) * blockDim.x)

template <typename T>
__global__ void head_kernel(T* ML, const T* b, const T* eps, T* Z, T* kl, int64_t rows, int64_t L) {
  VAE_FOR(r, rows) {
    T* mu = ML + r * 2 * L;
    T* lv = mu + L;
    double acc = 0;
    for (int64_t j = 0; j < L; ++j) {
      const T m = mu[j] + b[j], v = lv[j] + b[L + j];
      mu[j] = m;
      lv[j] = v;
      Z[r * L + j] = m + exp(T(0.5) * v) * eps[r * L + j];
      acc += double(T(1) + v - m * m - exp(v));
    }
    kl[r] = T(-0.5 * acc);
  }
}

template <typename T>
__global__ void recon_kernel(T* A, const T* b, const T* x, const T* s, const T* kl, T* recon, T* elbo,
                             int64_t rows, int64_t I, int64_t likelihood) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; r < rows;
       r += int64_t(gridDim.x) * kWarpsPerBlock) {
    T* a = A + r * I;
    const T* xr = x + r * I;
    double acc = 0;
    for (int64_t i = lane; i < I; i += 32) {
      const T v = a[i] + b[i];
      a[i] = v;
      acc += double(s ? gaussian_nll_term(v, xr[i], s[i]) : recon_term(likelihood, v, xr[i]));
    }
    acc = cuda::group_allreduce(acc, 32);
    if (lane == 0) {
      const T rec = T(acc);
      recon[r] = rec;
      elbo[r] = -(rec + kl[r]);
    }
  }
}

template <typename T>
__global__ void recon_backward_kernel(T* GA, const T* A, const T* x, const T* s, const T* ge, const T* gr,
                                      T* GX, T* GS, int64_t rows, int64_t I, int64_t likelihood) {
  VAE_FOR(e, rows * I) {
    const int64_t r = e / I, i = e - r * I;
    const T d = (gr ? gr[r] : T(0)) - (ge ? ge[r] : T(0));
    T ga, gx;
    if (s) {
      T gs;
      gaussian_nll_backward(A[e], x[e], s[i], d, ga, gs);
      gx = -ga;
      GS[e] = gs;
    } else {
      recon_backward(likelihood, A[e], x[e], d, ga, gx);
    }
    GA[e] = ga;
    if (GX) GX[e] = gx;
  }
}

template <typename T>
__global__ void head_backward_kernel(T* GML, const T* GZ, const T* ML, const T* eps, const T* ge, const T* gk,
                                     T* GEPS, int64_t rows, int64_t L) {
  VAE_FOR(e, rows * L) {
    const int64_t r = e / L, j = e - r * L;
    const T c = (gk ? gk[r] : T(0)) - (ge ? ge[r] : T(0));
    const T mu = ML[r * 2 * L + j], lv = ML[r * 2 * L + L + j];
    const T gz = GZ[e], sd = exp(T(0.5) * lv);
    GML[r * 2 * L + j] = gz + c * mu;
    GML[r * 2 * L + L + j] = T(0.5) * gz * eps[e] * sd - T(0.5) * c * (T(1) - exp(lv));
    GEPS[e] = gz * sd;
  }
}

#undef VAE_FOR

template <typename T>
struct VaeMlpCudaOps : ode_cuda::OdeCudaOps<T> {
  explicit VaeMlpCudaOps(cudaStream_t s) : ode_cuda::OdeCudaOps<T>{s} {}

  void head(T* ML, const T* b, const T* eps, T* Z, T* kl, int64_t rows, int64_t L) const {
    head_kernel<T><<<grid_for(rows), kThreads, 0, this->stream>>>(ML, b, eps, Z, kl, rows, L);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void recon(T* A, const T* b, const T* x, const T* s, const T* kl, T* recon, T* elbo, int64_t rows,
             int64_t I, int64_t likelihood) const {
    const unsigned blocks =
        unsigned(std::max<int64_t>(1, std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 65535)));
    recon_kernel<T><<<blocks, kThreads, 0, this->stream>>>(A, b, x, s, kl, recon, elbo, rows, I, likelihood);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void recon_backward(T* GA, const T* A, const T* x, const T* s, const T* ge, const T* gr, const T* gk,
                      T* GX, T* GS, int64_t rows, int64_t I, int64_t likelihood) const {
    (void)gk;
    recon_backward_kernel<T><<<grid_for(rows * I), kThreads, 0, this->stream>>>(GA, A, x, s, ge, gr, GX, GS,
                                                                                rows, I, likelihood);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
  void head_backward(T* GML, const T* GZ, const T* ML, const T* eps, const T* ge, const T* gk, T* GEPS,
                     int64_t rows, int64_t L) const {
    head_backward_kernel<T><<<grid_for(rows * L), kThreads, 0, this->stream>>>(GML, GZ, ML, eps, ge, gk, GEPS,
                                                                               rows, L);
    FUSED_OPS_CUDA_LAUNCH_CHECK();
  }
};

}  // namespace vae_mlp_cuda
}  // namespace fused_ops
