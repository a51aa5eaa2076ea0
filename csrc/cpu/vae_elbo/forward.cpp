// \brief CPU kernel of fused_ops::vae_elbo and vae_elbo_train (float32 and
// float64): the whole forward pass per block of samples, BLAS products with
// fused epilogues.  The only CPU path: no path table.
//
// The batch is cut into blocks of kRows samples (fixed, never derived from the
// thread count, so results are bitwise the same for any number of threads) and
// each block runs the whole forward pass while its activations are
// cache-resident: four BLAS products (mu and logvar share one, their weights
// stacked), each followed by a fused epilogue -- bias + ReLU, the
// reparameterisation and the KL row sums, and sigmoid + clamped BCE + the
// reconstruction row sums.  Neither the decoder output nor p is ever written
// out as a tensor, except by vae_elbo_train (the same kernel), which copies
// each block's activations into the buffer its backward reads.  Inside the
// parallel loop the BLAS calls run single-threaded on each block.
//
// The reconstruction row sums are cpu/vae_rows.h's (BCE exactly as PyTorch
// computes it, in SIMD lanes; the other likelihoods of common/likelihood.h
// likewise, with no target check).

// The targets must be probabilities, x in [0, 1], as binary_cross_entropy
// requires of its target: the BCE loop checks each element as it reads it
// (NaN fails the check) and the call raises, naming the first offending
// element, instead of returning a finite number for an invalid target.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <sstream>
#include <vector>

#include "common/bce.h"
#include "common/likelihood.h"
#include "common/low_precision.h"
#include "common/matmul.h"
#include "cpu/vae_rows.h"
#include "cpu/vec_math.h"
#include "vae_elbo.h"

namespace fused_ops {
namespace {

constexpr int64_t kRows = 64;  // samples per block

template <typename T>
struct Args {
  const T *x, *eps, *w_enc, *b_enc, *w_mulv, *b_mulv, *w_dec1, *b_dec1, *w_dec2, *b_dec2;
  int64_t B, I, H, L;
  T *elbo, *recon, *kl;
  T* saved;  // vae_elbo_train: the activations, laid out as VaeSavedLayout; else nullptr
  uint8_t* bad_target;  // [blocks]: set to 1 for a block with a target outside [0, 1] or NaN
  int64_t likelihood;   // common/likelihood.h; only kBernoulli checks the targets
};

// out[r, j] = in[r, :] . w[j, :] for r < rows, j < n (row-major, w is [n, k]),
// through torch's BLAS on views of the raw buffers (common/matmul.h).
template <typename T>
void linear_nobias(const T* in, const T* w, T* out, int64_t rows, int64_t n, int64_t k) {
  linear_nt(in, k, w, k, out, n, rows, n, k);
}

// v[i] = exp(v[i]): vector polynomial for float32 (libm outside its range
// and for the tail), libm for float64.
template <typename T, int VB>
FUSED_OPS_INLINE void exp_inplace(T* v, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    using V = cpu::Lanes<float, VB>;
    constexpr int NL = cpu::kLanes<float, VB>;
    for (; i + NL <= n; i += NL) {
      const V x = cpu::load_lanes<V>(v + i);
      bool ok = true;
      for (int j = 0; j < NL; ++j) ok &= x[j] >= -87.0f && x[j] <= 87.0f;
      if (ok) {
        cpu::store_lanes<V>(v + i, cpu::exp(x));
      } else {
        for (int j = 0; j < NL; ++j) v[i + j] = std::exp(v[i + j]);
      }
    }
  }
  for (; i < n; ++i) v[i] = std::exp(v[i]);
}

template <typename T, int VB>
FUSED_OPS_INLINE void block_range(const Args<T>& a, int64_t c0, int64_t c1) {
  using acc_t = double;
  const int64_t I = a.I, H = a.H, L = a.L;
  std::vector<T> h(kRows * H), ml(kRows * 2 * L), ex(kRows * 2 * L), z(kRows * L), g(kRows * H),
      logits(kRows * I);
  auto bias_relu = [](T* v, const T* b, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
      T* row = v + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const T t = row[j] + b[j];
        row[j] = t < T(0) ? T(0) : t;  // relu(NaN) = NaN
      }
    }
  };
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t r0 = c * kRows, rows = std::min(a.B, r0 + kRows) - r0;
    const T* x = a.x + r0 * I;
    linear_nobias(x, a.w_enc, h.data(), rows, H, I);
    bias_relu(h.data(), a.b_enc, rows, H);
    linear_nobias(h.data(), a.w_mulv, ml.data(), rows, 2 * L, H);
    // exp(0.5 logvar) and exp(logvar) for the whole block in vector loops.
    for (int64_t r = 0; r < rows; ++r) {
      T* m = ml.data() + r * 2 * L;
      for (int64_t l = 0; l < L; ++l) {
        m[l] += a.b_mulv[l];
        m[L + l] += a.b_mulv[L + l];
        ex[2 * (r * L + l)] = T(0.5) * m[L + l];
        ex[2 * (r * L + l) + 1] = m[L + l];
      }
    }
    exp_inplace<T, VB>(ex.data(), 2 * rows * L);
    for (int64_t r = 0; r < rows; ++r) {
      const T* m = ml.data() + r * 2 * L;
      const T* e = a.eps + (r0 + r) * L;
      const T* exr = ex.data() + 2 * r * L;
      T* zr = z.data() + r * L;
      acc_t kl_sum = 0;
      for (int64_t l = 0; l < L; ++l) {
        const T mu = m[l], lv = m[L + l];
        zr[l] = mu + exr[2 * l] * e[l];
        kl_sum += ((T(1) + lv) - mu * mu) - exr[2 * l + 1];
      }
      a.kl[r0 + r] = T(-0.5) * T(kl_sum);
    }
    linear_nobias(z.data(), a.w_dec1, g.data(), rows, H, L);
    bias_relu(g.data(), a.b_dec1, rows, H);
    linear_nobias(g.data(), a.w_dec2, logits.data(), rows, I, H);
    bool targets_ok = true;
    for (int64_t r = 0; r < rows; ++r) {
      T* lr = logits.data() + r * I;
      for (int64_t i = 0; i < I; ++i) lr[i] += a.b_dec2[i];
      const T recon = a.likelihood == kBernoulli ? T(cpu::bce_row<T, VB>(lr, x + r * I, I, targets_ok))
                                                 : T(cpu::recon_row<T, VB>(a.likelihood, lr, x + r * I, I));
      a.recon[r0 + r] = recon;
      a.elbo[r0 + r] = -(recon + a.kl[r0 + r]);
    }
    if (!targets_ok) a.bad_target[c] = 1;
    if (a.saved) {
      // Copied out after the block rather than computed in place: the BLAS
      // then sees the same buffers as for vae_elbo, so the losses are
      // bitwise the same (its rounding can depend on buffer alignment).
      const VaeSavedLayout lay(a.B, I, H, L);
      std::copy_n(h.data(), rows * H, a.saved + lay.h + r0 * H);
      std::copy_n(ml.data(), rows * 2 * L, a.saved + lay.ml + r0 * 2 * L);
      std::copy_n(z.data(), rows * L, a.saved + lay.z + r0 * L);
      std::copy_n(g.data(), rows * H, a.saved + lay.g + r0 * H);
      std::copy_n(logits.data(), rows * I, a.saved + lay.logits + r0 * I);
    }
  }
}

template <typename T>
void block_range_baseline(const Args<T>& a, int64_t c0, int64_t c1) {
  block_range<T, 16>(a, c0, c1);
}

#if FUSED_OPS_HAVE_AVX2_CLONE
template <typename T>
FUSED_OPS_TARGET_AVX2 void block_range_avx2(const Args<T>& a, int64_t c0, int64_t c1) {
  block_range<T, 32>(a, c0, c1);
}
#endif

// Raises for the first target (in row-major order) that is not a
// probability, in the first block the kernel flagged.
template <typename T>
void raise_for_bad_target(const VaeElboCall& c, const std::vector<uint8_t>& bad_target) {
  const auto block = std::find(bad_target.begin(), bad_target.end(), uint8_t(1));
  if (block == bad_target.end()) return;
  const T* x = cdata<T>(c.x);
  const int64_t begin = (block - bad_target.begin()) * kRows * c.I;
  const int64_t end = std::min(c.B * c.I, begin + kRows * c.I);
  int64_t k = begin;
  while (k < end - 1 && cpu::is_probability(x[k])) ++k;
  std::ostringstream value;
  value << std::setprecision(std::numeric_limits<T>::max_digits10) << x[k];
  FUSED_OPS_CHECK(false, "x must hold binary cross-entropy targets in [0, 1] (the range "
                  "torch.nn.functional.binary_cross_entropy requires of its target), got x[",
                  k / c.I, ", ", k % c.I, "] = ", value.str());
}

template <typename T>
void vae_elbo_kernel(const VaeElboCall& c, T* saved = nullptr) {
  if (c.B == 0) return;
  const int64_t blocks = (c.B + kRows - 1) / kRows;
  std::vector<uint8_t> bad_target(blocks, 0);
  const int64_t H = c.H, L = c.L;
  // mu and logvar in one product: their weights stacked as [2L, H].
  std::vector<T> w_mulv(2 * L * H), b_mulv(2 * L);
  std::copy_n(cdata<T>(c.w_mu), L * H, w_mulv.begin());
  std::copy_n(cdata<T>(c.w_logvar), L * H, w_mulv.begin() + L * H);
  std::copy_n(cdata<T>(c.b_mu), L, b_mulv.begin());
  std::copy_n(cdata<T>(c.b_logvar), L, b_mulv.begin() + L);
  const Args<T> a{cdata<T>(c.x),      cdata<T>(c.eps),    cdata<T>(c.w_enc), cdata<T>(c.b_enc),
                  w_mulv.data(),      b_mulv.data(),      cdata<T>(c.w_dec1), cdata<T>(c.b_dec1),
                  cdata<T>(c.w_dec2), cdata<T>(c.b_dec2), c.B,               c.I,
                  c.H,                c.L,                mdata<T>(c.elbo),  mdata<T>(c.recon),
                  mdata<T>(c.kl),     saved,             bad_target.data(), c.likelihood};
  auto* range = &block_range_baseline<T>;
#if FUSED_OPS_HAVE_AVX2_CLONE
  if (cpu::cpu_has_avx2()) range = &block_range_avx2<T>;
#endif
  torch::stable::parallel_for(0, blocks, 1, [&](int64_t c0, int64_t c1) { range(a, c0, c1); });
  raise_for_bad_target<T>(c, bad_target);
}

VaeElboResult vae_elbo_cpu(const Tensor& x, const Tensor& eps, const Tensor& w_enc,
                           const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu,
                           const Tensor& w_logvar, const Tensor& b_logvar, const Tensor& w_dec1,
                           const Tensor& b_dec1, const Tensor& w_dec2, const Tensor& b_dec2,
                           int64_t likelihood) {
  if (is_bfloat16(x)) {  // checked, then the float32 kernel on float32 copies
    check_vae_elbo_args(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1,
                        w_dec2, b_dec2, /*allow_bfloat16=*/true);
    check_vae_likelihood(likelihood);
    return low_precision::in_float32(ScalarType::BFloat16, vae_elbo_cpu, x, eps, w_enc, b_enc,
                                     w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2,
                                     b_dec2, likelihood);
  }
  VaeElboCall c(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2,
                b_dec2, /*allow_bfloat16=*/true);  // the messages of the bfloat16-taking op
  c.likelihood = check_vae_likelihood(likelihood);
  dispatch_float(x.scalar_type(), [&](auto zero) { vae_elbo_kernel<decltype(zero)>(c); });
  return c.result();
}

VaeElboTrainResult vae_elbo_train_cpu(const Tensor& x, const Tensor& eps, const Tensor& w_enc,
                                      const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu,
                                      const Tensor& w_logvar, const Tensor& b_logvar,
                                      const Tensor& w_dec1, const Tensor& b_dec1,
                                      const Tensor& w_dec2, const Tensor& b_dec2,
                                      int64_t likelihood) {
  VaeElboTrainCall c(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2,
                     b_dec2);
  c.likelihood = check_vae_likelihood(likelihood);
  dispatch_float(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    vae_elbo_kernel<T>(c, mdata<T>(c.saved));
  });
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("vae_elbo", TORCH_BOX(&vae_elbo_cpu));
  m.impl("vae_elbo_train", TORCH_BOX(&vae_elbo_train_cpu));
}

}  // namespace fused_ops
