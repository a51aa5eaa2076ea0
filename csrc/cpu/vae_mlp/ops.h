// \brief The elementwise passes of vae_mlp_elbo's sequence on the CPU (the
// `Ops` of csrc/vae_mlp_core.h): the VAE's own passes -- the head with the
// reparameterisation and KL, the likelihood with its row sums, and their
// backward -- beside ode_mlp's bias/activation, activation-gradient, add and
// column-sum passes (cpu/ode_mlp/ops.h), which it inherits.  Plain loops over
// contiguous row-major buffers, on the calling thread; row sums accumulate in
// double, in feature order, but the reconstruction's without a learned
// variance, which are cpu/vae_rows.h's SIMD row sums.
#pragma once

#include <cmath>

#include "common/likelihood.h"
#include "cpu/ode_mlp/ops.h"
#include "cpu/vae_rows.h"
#include "vae_mlp.h"

namespace fused_ops {
namespace cpu {

// The reconstruction row sums in 4-lane (16-byte, SSE2 baseline) vectors:
// this file is not compiled in an AVX2 clone.
constexpr int kRowLanesBytes = 16;

template <typename T>
struct VaeMlpCpuOps : OdeCpuOps<T> {
  void head(T* ML, const T* b, const T* eps, T* Z, T* kl, int64_t rows, int64_t L) const {
    for (int64_t r = 0; r < rows; ++r) {
      T* mu = ML + r * 2 * L;
      T* lv = mu + L;
      double acc = 0;
      for (int64_t j = 0; j < L; ++j) {
        mu[j] += b[j];
        lv[j] += b[L + j];
        Z[r * L + j] = mu[j] + std::exp(T(0.5) * lv[j]) * eps[r * L + j];
        acc += double(T(1) + lv[j] - mu[j] * mu[j] - std::exp(lv[j]));
      }
      kl[r] = T(-0.5 * acc);
    }
  }

  void recon(T* A, const T* b, const T* x, const T* s, const T* kl, T* recon, T* elbo, int64_t rows,
             int64_t I, int64_t likelihood) const {
    for (int64_t r = 0; r < rows; ++r) {
      T* a = A + r * I;
      const T* xr = x + r * I;
      for (int64_t i = 0; i < I; ++i) a[i] += b[i];
      double acc = 0;
      if (s) {
        for (int64_t i = 0; i < I; ++i) acc += double(gaussian_nll_term(a[i], xr[i], s[i]));
      } else if (likelihood == kBernoulli) {
        bool ok = true;  // the targets were checked before the forward
        acc = bce_row<T, kRowLanesBytes>(a, xr, I, ok);
      } else {
        acc = recon_row<T, kRowLanesBytes>(likelihood, a, xr, I);
      }
      recon[r] = T(acc);
      elbo[r] = -(recon[r] + kl[r]);
    }
  }

  void recon_backward(T* GA, const T* A, const T* x, const T* s, const T* ge, const T* gr,
                      const T* gk, T* GX, T* GS, int64_t rows, int64_t I, int64_t likelihood) const {
    (void)gk;
    for (int64_t r = 0; r < rows; ++r) {
      const T d = (gr ? gr[r] : T(0)) - (ge ? ge[r] : T(0));
      for (int64_t i = 0; i < I; ++i) {
        const int64_t e = r * I + i;
        T gx;
        if (s) {
          gaussian_nll_backward(A[e], x[e], s[i], d, GA[e], GS[e]);
          gx = -GA[e];
        } else {
          ::fused_ops::recon_backward(likelihood, A[e], x[e], d, GA[e], gx);
        }
        if (GX) GX[e] = gx;
      }
    }
  }

  void head_backward(T* GML, const T* GZ, const T* ML, const T* eps, const T* ge, const T* gk,
                     T* GEPS, int64_t rows, int64_t L) const {
    for (int64_t r = 0; r < rows; ++r) {
      const T c = (gk ? gk[r] : T(0)) - (ge ? ge[r] : T(0));
      for (int64_t j = 0; j < L; ++j) {
        const T mu = ML[r * 2 * L + j], lv = ML[r * 2 * L + L + j];
        const T gz = GZ[r * L + j], e = eps[r * L + j], sd = std::exp(T(0.5) * lv);
        GML[r * 2 * L + j] = gz + c * mu;
        GML[r * 2 * L + L + j] = T(0.5) * gz * e * sd - T(0.5) * c * (T(1) - std::exp(lv));
        GEPS[r * L + j] = gz * sd;
      }
    }
  }
};

}  // namespace cpu
}  // namespace fused_ops
