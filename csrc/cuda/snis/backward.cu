// \brief CUDA entry point and kernels of fused_ops::snis_backward: path
// "twopass" (its only path; table snis_backward/cuda).
//
// Math (csrc/cpu/snis/backward.cpp states it in full): with w_j =
// exp(lnw_j) / W (W = sum exp(lnw), renormalised) and Q = sum w^2,
//   g_j   = gL_j - w_j sum gL + gE 2 w_j (Q - w_j) / Q^2 + gZ w_j
//           + w_j sum_d [gM_d (x_jd - mean_d) + gV_d ((x_jd - mean_d)^2 - var_d)]
//   gx_jd = w_j (gM_d + 2 gV_d (x_jd - mean_d)).
//
// Design.  The forward's chunking (kernels.cuh, split_chunk): a 1-D grid of
// B * C blocks of kThreads threads.
//   partials  per chunk, sum gL, W and sum exp(2 lnw) in double (block sums
//             in a fixed pattern) -> workspace [B * C, 3];
//   grads     every block merges its problem's C partials in chunk order,
//             then one thread per row j: w_j and the ESS term in double (Q -
//             w_j cancels near a dominant sample), the row's dot products
//             over D, gx row.  Rows are read whole by one thread: coalesced
//             across the warp only for small D (the samples are typically
//             D <= 64; the row stays in L1 between the two uses).
// No atomics: bitwise reproducible.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <climits>

#include "common/dispatch.h"
#include "cuda/snis/kernels.cuh"

namespace fused_ops {
namespace {

using Call = SnisBackwardCall;
using snis_paths::kThreads;
using snis_paths::kWarps;

template <typename T>
struct BwdArgs {
  const T *lnw, *x, *mean, *var, *gL, *gE, *gZ, *gM, *gV;
  T *glw, *gx;
  int64_t B, N, C, chunk;
  int D;
  double* part;  // [B * C, 3]
};

__device__ __forceinline__ double block_sum(double v, double* scratch) {
  return cuda::block_allreduce(v, scratch);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) snis_bwd_partials(const BwdArgs<T> a) {
  __shared__ double scratch[kWarps];
  const int64_t b = blockIdx.x / a.C, c = blockIdx.x % a.C;
  const int64_t n0 = c * a.chunk, n1 = n0 + a.chunk < a.N ? n0 + a.chunk : a.N;
  double sg = 0, w = 0, q = 0;
  for (int64_t i = n0 + threadIdx.x; i < n1; i += kThreads) {
    const double e = exp(double(a.lnw[b * a.N + i]));
    if (a.gL) sg += double(a.gL[b * a.N + i]);
    w += e;
    q += e * e;
  }
  sg = block_sum(sg, scratch);
  w = block_sum(w, scratch);
  q = block_sum(q, scratch);
  if (threadIdx.x == 0) {
    double* p = a.part + blockIdx.x * 3;
    p[0] = sg, p[1] = w, p[2] = q;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) snis_bwd_grads(const BwdArgs<T> a) {
  __shared__ double scratch[kWarps];
  const int64_t b = blockIdx.x / a.C, c = blockIdx.x % a.C;
  const int64_t n0 = c * a.chunk, n1 = n0 + a.chunk < a.N ? n0 + a.chunk : a.N;
  double sg = 0, W = 0, q = 0;
  for (int64_t k = threadIdx.x; k < a.C; k += kThreads) {
    const double* p = a.part + (b * a.C + k) * 3;
    sg += p[0], W += p[1], q += p[2];
  }
  sg = block_sum(sg, scratch);
  W = block_sum(W, scratch);
  q = block_sum(q, scratch);
  const double Q = q / (W * W);
  const double ge = a.gE ? double(a.gE[b]) : 0.0, gz = a.gZ ? double(a.gZ[b]) : 0.0;
  const int D = a.D;
  for (int64_t n = n0 + threadIdx.x; n < n1; n += kThreads) {
    const int64_t j = b * a.N + n;
    const double w = exp(double(a.lnw[j])) / W;
    double g = (a.gL ? double(a.gL[j]) : 0.0) - w * sg + w * gz;
    if (a.gE) g += ge * 2.0 * w * (Q - w) / (Q * Q);
    if (a.x) {
      const T* xj = a.x + j * D;
      T* gxj = a.gx + j * D;
      double dot = 0;
      for (int d = 0; d < D; ++d) {
        const double z = double(xj[d]) - double(a.mean[b * D + d]);
        const double gm = a.gM ? double(a.gM[b * D + d]) : 0.0, gv = a.gV ? double(a.gV[b * D + d]) : 0.0;
        dot += gm * z;
        if (a.gV) dot += gv * (z * z - double(a.var[b * D + d]));
        gxj[d] = T(w * (gm + 2.0 * gv * z));
      }
      g += w * dot;
    }
    a.glw[j] = T(g);
  }
}

template <typename T>
void launch_twopass_typed(const Call& c) {
  BwdArgs<T> a{};
  a.lnw = cdata<T>(c.lnw);
  a.x = c.has_samples ? cdata<T>(c.x) : nullptr;
  a.mean = c.has_samples ? cdata<T>(c.mean) : nullptr;
  a.var = c.variance.defined() ? cdata<T>(c.variance) : nullptr;
  a.gL = cdata_or_null<T>(c.g_lw), a.gE = cdata_or_null<T>(c.g_ess), a.gZ = cdata_or_null<T>(c.g_logz);
  a.gM = cdata_or_null<T>(c.g_mean), a.gV = cdata_or_null<T>(c.g_var);
  a.glw = mdata<T>(c.grad_log_weights);
  a.gx = c.has_samples ? mdata<T>(c.grad_samples) : nullptr;
  a.B = c.B, a.N = c.N, a.D = int(c.D);
  const int device = cuda::current_device();
  a.chunk = snis_paths::split_chunk(c.B, c.N, cuda::multiprocessor_count(device));
  a.C = (c.N + a.chunk - 1) / a.chunk;
  const int64_t parts = c.B * a.C;
  Tensor ws = float64_workspace(c.lnw, parts * 3, "snis");
  a.part = mdata<double>(ws);
  const cudaStream_t stream = cuda::current_stream(device);
  snis_bwd_partials<T><<<unsigned(parts), kThreads, 0, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  snis_bwd_grads<T><<<unsigned(parts), kThreads, 0, stream>>>(a);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

void launch_twopass(const Call& c) {
  dispatch_float(c.lnw.scalar_type(), [&](auto zero) { launch_twopass_typed<decltype(zero)>(c); });
}

const dispatch::PathTable<Call, 1> kPaths("snis_backward", "cuda", {{
    {"twopass", "anything (any B, N, D)",
     "per-chunk sums merged in a fixed order, then one thread per row", dispatch::always<Call>, launch_twopass},
}});

SnisGrads snis_backward_cuda(const std::optional<Tensor>& grad_log_norm_weights,
                             const std::optional<Tensor>& grad_ess, const std::optional<Tensor>& grad_log_evidence,
                             const std::optional<Tensor>& grad_mean, const std::optional<Tensor>& grad_variance,
                             const Tensor& log_norm_weights, const std::optional<Tensor>& samples,
                             const Tensor& mean, const Tensor& variance) {
  const cuda::TensorDeviceGuard guard(log_norm_weights);
  Call c(grad_log_norm_weights, grad_ess, grad_log_evidence, grad_mean, grad_variance, log_norm_weights, samples,
         mean, variance);
  FUSED_OPS_CHECK(log_norm_weights.is_cuda(), "log_norm_weights must be a CUDA tensor, got ",
                  device_str(log_norm_weights));
  FUSED_OPS_CHECK(c.D <= INT_MAX, "snis_backward: D must fit in int32, got D=", c.D);
  if (c.B == 0) return c.result();
  kPaths.run(c);
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("snis_backward", TORCH_BOX(&snis_backward_cuda));
}

}  // namespace fused_ops
