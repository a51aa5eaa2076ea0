// CUDA implementation of fused_ops::vae_elbo_backward (the backward of vae_elbo).
//
// The products run on cuBLAS through common/matmul.h (aten::mm.out on views of
// raw buffers, on torch's current stream, no transposes copied); between them
// small fused elementwise kernels apply the biases, activations and the
// chain rule, and a column-sum kernel forms the bias gradients.  Launches, in
// stream order (B rows, mm = one cuBLAS product):
//   h   = x @ w_enc^T (mm); bias_relu                          [B, H]
//   ml  = h @ [w_mu; w_logvar]^T (mm); latent_forward -> mu, logvar, z
//   g   = z @ w_dec1^T (mm); bias_relu                         [B, H]
//   a3  = g @ w_dec2^T (mm); bce_backward: a3 -> ga3 in place, gx = BCE target term
//   gw_dec2 = ga3^T @ g (mm)
//   ga2 = ga3 @ w_dec2 (mm); relu_mask(g)
//   gw_dec1 = ga2^T @ z (mm)
//   gz  = ga2 @ w_dec1 (mm); latent_backward -> [gmu, glv], geps
//   gw_mu, gw_logvar = gmu^T @ h, glv^T @ h (2 mm)
//   ga1 = [gmu, glv] @ [w_mu; w_logvar] (mm); relu_mask(h)
//   gw_enc = ga1^T @ x (mm)
//   column_sums: the five bias gradients (ga3, ga2, gmu, glv, ga1) in ONE launch
//   t   = ga1 @ w_enc (mm, into a3's buffer); add: gx += t
// 13 cuBLAS products, 9 kernels and 2 device copies ([w_mu; w_logvar]).
// Column sums run in a fixed order (32 strided row partials per column in
// double, then summed in order in shared memory), no atomics: results are
// bitwise reproducible.  Numerics follow PyTorch's kernels: p = 1 / (1 +
// exp(-a)); BCE backward (p - x) / max((1 - p) p, 1e-12); sigmoid backward
// * (1 - p) * p; BCE target gradient -log(p / (1 - p)).
//
// Workspace: B * (I + 4H + 6L) elements plus [w_mu; w_logvar] (2 L H).

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <optional>

#include "common/matmul.h"
#include "cuda/runtime.cuh"
#include "vae_elbo_backward.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float dexp(float v) { return expf(v); }
__device__ __forceinline__ double dexp(double v) { return exp(v); }
__device__ __forceinline__ float dlog(float v) { return logf(v); }
__device__ __forceinline__ double dlog(double v) { return log(v); }

// Upstream gradient of recon (which = 0) or kl (which = 1) for row b:
// grad_recon/kl - grad_elbo, a missing one counting as zero.
template <typename T>
__device__ __forceinline__ T upstream(const T* g_elbo, const T* g_other, int64_t b) {
  if (g_elbo && g_other) return -g_elbo[b] + g_other[b];
  if (g_elbo) return -g_elbo[b];
  if (g_other) return g_other[b];
  return T(0);
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535)));
}

// v[r, j] = max(v[r, j] + b[j], 0) for r < rows, j < n.
template <typename T>
__global__ void bias_relu_kernel(T* v, const T* b, int64_t rows, int64_t n) {
  const int64_t total = rows * n;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const T u = v[k] + b[k % n];
    v[k] = u < T(0) ? T(0) : u;
  }
}

// ml [B, 2L] holds h @ [w_mu; w_logvar]^T; adds the biases in place (mu,
// logvar) and writes z = mu + exp(0.5 logvar) * eps.
template <typename T>
__global__ void latent_forward_kernel(T* ml, const T* b_mu, const T* b_lv, const T* eps, T* z,
                                      int64_t B, int64_t L) {
  const int64_t total = B * L;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = k / L, l = k % L;
    T* m = ml + b * 2 * L;
    const T mu = m[l] + b_mu[l];
    const T lv = m[L + l] + b_lv[l];
    m[l] = mu;
    m[L + l] = lv;
    z[k] = mu + dexp(T(0.5) * lv) * eps[k];
  }
}

// a3 [B, I] holds g @ w_dec2^T: replaces it by the gradient at the logits
// (BCE backward with PyTorch's clamp, then sigmoid backward) and writes BCE's
// target gradient -logit(p) * d_recon to gx (zero where d_recon is zero).
template <typename T>
__global__ void bce_backward_kernel(T* a3, const T* b_dec2, const T* x, const T* g_elbo,
                                    const T* g_recon, T* gx, int64_t B, int64_t I) {
  const int64_t total = B * I;
  const T kEps = T(1e-12);
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = k / I, i = k % I;
    const T dr = upstream(g_elbo, g_recon, b);
    const T a = a3[k] + b_dec2[i];
    const T p = T(1) / (T(1) + dexp(-a));
    const T q = T(1) - p;
    const T qp = q * p;
    const T den = qp < kEps ? kEps : qp;
    const T gp = dr * (p - x[k]) / den;
    a3[k] = gp * q * p;
    gx[k] = dr != T(0) ? -dlog(p / q) * dr : T(0);
  }
}

// v[k] = 0 where act[k] <= 0 (ReLU backward on the ReLU's output).
template <typename T>
__global__ void relu_mask_kernel(T* v, const T* act, int64_t n) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    if (!(act[k] > T(0))) v[k] = T(0);
  }
}

// From gz [B, L] (gradient at z), mu/logvar (ml [B, 2L]) and eps: gml [B, 2L]
// = [gmu, glv] and geps [B, L].
template <typename T>
__global__ void latent_backward_kernel(const T* gz, const T* ml, const T* eps, const T* g_elbo,
                                       const T* g_kl, T* gml, T* geps, int64_t B, int64_t L) {
  const int64_t total = B * L;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = k / L, l = k % L;
    const T dk = upstream(g_elbo, g_kl, b);
    const T mu = ml[b * 2 * L + l], lv = ml[b * 2 * L + L + l];
    const T s = dexp(T(0.5) * lv);
    const T g = gz[k];
    gml[b * 2 * L + l] = g + dk * mu;
    gml[b * 2 * L + L + l] = T(0.5) * (g * eps[k] * s) + (T(-0.5) * dk) * (T(1) - dexp(lv));
    geps[k] = g * s;
  }
}

template <typename T>
__global__ void add_kernel(T* out, const T* v, int64_t n) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x)
    out[k] += v[k];
}

// Column sums of several row-major matrices of B rows in one launch (the bias
// gradients): job blockIdx.y computes out[j] = sum_r in[r * ld + j], j < n.
// Block (32, 32) per 32 columns; thread (tx, ty) sums rows ty, ty + 32, ...
// of column tx in double, then row 0 adds the 32 partials in order.  Fixed
// order, no atomics.
constexpr int kColSumJobs = 5;

template <typename T>
struct ColSumJob {
  const T* in;
  int64_t ld, n;
  T* out;
};

template <typename T>
struct ColSumJobs {
  ColSumJob<T> job[kColSumJobs];
  int64_t rows;
};

template <typename T>
__global__ void column_sums_kernel(const ColSumJobs<T> jobs) {
  __shared__ double part[32][33];
  const ColSumJob<T> jb = jobs.job[blockIdx.y];
  if (int64_t(blockIdx.x) * 32 >= jb.n) return;  // uniform over the block
  const int64_t j = int64_t(blockIdx.x) * 32 + threadIdx.x;
  double acc = 0;
  if (j < jb.n)
    for (int64_t r = threadIdx.y; r < jobs.rows; r += 32) acc += double(jb.in[r * jb.ld + j]);
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < jb.n) {
    double s = 0;
    for (int k = 0; k < 32; ++k) s += part[k][threadIdx.x];
    jb.out[j] = T(s);
  }
}

template <typename T>
void vae_elbo_backward_launch(const VaeElboBackwardCall& c) {
  const int64_t B = c.B, I = c.I, H = c.H, L = c.L;
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  T* gw_enc = c.gw_enc.mutable_data_ptr<T>();
  T* gb_enc = c.gb_enc.mutable_data_ptr<T>();
  T* gw_mu = c.gw_mu.mutable_data_ptr<T>();
  T* gb_mu = c.gb_mu.mutable_data_ptr<T>();
  T* gw_lv = c.gw_logvar.mutable_data_ptr<T>();
  T* gb_lv = c.gb_logvar.mutable_data_ptr<T>();
  T* gw_d1 = c.gw_dec1.mutable_data_ptr<T>();
  T* gb_d1 = c.gb_dec1.mutable_data_ptr<T>();
  T* gw_d2 = c.gw_dec2.mutable_data_ptr<T>();
  T* gb_d2 = c.gb_dec2.mutable_data_ptr<T>();
  if (B == 0) {
    for (const Tensor* t : {&c.gw_enc, &c.gb_enc, &c.gw_mu, &c.gb_mu, &c.gw_logvar, &c.gb_logvar,
                            &c.gw_dec1, &c.gb_dec1, &c.gw_dec2, &c.gb_dec2})
      FUSED_OPS_CUDA_CHECK(
          cudaMemsetAsync(t->mutable_data_ptr<T>(), 0, size_t(t->numel()) * sizeof(T), stream));
    return;
  }
  const torch::stable::Device dev = c.x.device();
  const T* x = c.x.const_data_ptr<T>();
  const T* eps = c.eps.const_data_ptr<T>();
  const T* w_enc = c.w_enc.const_data_ptr<T>();
  const T* w_d1 = c.w_dec1.const_data_ptr<T>();
  const T* w_d2 = c.w_dec2.const_data_ptr<T>();
  const T* g_elbo = VaeElboBackwardCall::ptr<T>(c.g_elbo);
  const T* g_recon = VaeElboBackwardCall::ptr<T>(c.g_recon);
  const T* g_kl = VaeElboBackwardCall::ptr<T>(c.g_kl);
  T* gx = c.gx.mutable_data_ptr<T>();
  T* geps = c.geps.mutable_data_ptr<T>();

  // Workspace, each piece starting on a multiple of 4 elements.
  auto up4 = [](int64_t n) { return (n + 3) / 4 * 4; };
  const int64_t n_h = up4(B * H), n_ml = up4(B * 2 * L), n_z = up4(B * L), n_g = up4(B * H),
                n_a3 = up4(B * I), n_ga2 = up4(B * H), n_gz = up4(B * L), n_gml = up4(B * 2 * L),
                n_ga1 = up4(B * H), n_w = up4(2 * L * H);
  Tensor ws = empty_like_device(
      c.x, {n_h + n_ml + n_z + n_g + n_a3 + n_ga2 + n_gz + n_gml + n_ga1 + n_w});
  T* h = ws.mutable_data_ptr<T>();
  T* ml = h + n_h;
  T* z = ml + n_ml;
  T* g = z + n_z;
  T* a3 = g + n_g;
  T* ga2 = a3 + n_a3;
  T* gz = ga2 + n_ga2;
  T* gml = gz + n_gz;
  T* ga1 = gml + n_gml;
  T* w_mulv = ga1 + n_ga1;  // [w_mu; w_logvar], [2L, H]
  FUSED_OPS_CUDA_CHECK(cudaMemcpyAsync(w_mulv, c.w_mu.const_data_ptr<T>(), size_t(L * H) * sizeof(T),
                                       cudaMemcpyDeviceToDevice, stream));
  FUSED_OPS_CUDA_CHECK(cudaMemcpyAsync(w_mulv + L * H, c.w_logvar.const_data_ptr<T>(),
                                       size_t(L * H) * sizeof(T), cudaMemcpyDeviceToDevice, stream));

  // ---- forward recompute
  linear_nt(x, I, w_enc, I, h, H, B, H, I, dev);
  bias_relu_kernel<T><<<grid_for(B * H), kThreads, 0, stream>>>(h, c.b_enc.const_data_ptr<T>(), B, H);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  linear_nt(h, H, static_cast<const T*>(w_mulv), H, ml, 2 * L, B, 2 * L, H, dev);
  latent_forward_kernel<T><<<grid_for(B * L), kThreads, 0, stream>>>(
      ml, c.b_mu.const_data_ptr<T>(), c.b_logvar.const_data_ptr<T>(), eps, z, B, L);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  linear_nt(static_cast<const T*>(z), L, w_d1, L, g, H, B, H, L, dev);
  bias_relu_kernel<T><<<grid_for(B * H), kThreads, 0, stream>>>(g, c.b_dec1.const_data_ptr<T>(), B, H);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  linear_nt(static_cast<const T*>(g), H, w_d2, H, a3, I, B, I, H, dev);

  // ---- decoder backward
  bce_backward_kernel<T><<<grid_for(B * I), kThreads, 0, stream>>>(
      a3, c.b_dec2.const_data_ptr<T>(), x, g_elbo, g_recon, gx, B, I);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(a3), 1, I, static_cast<const T*>(g), H, 1, gw_d2, H, I, H, B, dev);
  matmul(static_cast<const T*>(a3), I, 1, w_d2, H, 1, ga2, H, B, H, I, dev);
  relu_mask_kernel<T><<<grid_for(B * H), kThreads, 0, stream>>>(ga2, g, B * H);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(ga2), 1, H, static_cast<const T*>(z), L, 1, gw_d1, L, H, L, B, dev);
  matmul(static_cast<const T*>(ga2), H, 1, w_d1, L, 1, gz, L, B, L, H, dev);

  // ---- reparameterisation + KL backward
  latent_backward_kernel<T><<<grid_for(B * L), kThreads, 0, stream>>>(gz, ml, eps, g_elbo, g_kl,
                                                                       gml, geps, B, L);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(gml), 1, 2 * L, static_cast<const T*>(h), H, 1, gw_mu, H, L, H, B, dev);
  matmul(static_cast<const T*>(gml + L), 1, 2 * L, static_cast<const T*>(h), H, 1, gw_lv, H, L, H, B,
         dev);

  // ---- encoder backward
  matmul(static_cast<const T*>(gml), 2 * L, 1, static_cast<const T*>(w_mulv), H, 1, ga1, H, B, H,
         2 * L, dev);
  relu_mask_kernel<T><<<grid_for(B * H), kThreads, 0, stream>>>(ga1, h, B * H);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(ga1), 1, H, x, I, 1, gw_enc, I, H, I, B, dev);

  // ---- every bias gradient in one launch, then t = ga1 @ w_enc reuses a3's buffer
  const ColSumJobs<T> jobs{{{a3, I, I, gb_d2},
                            {ga2, H, H, gb_d1},
                            {gml, 2 * L, L, gb_mu},
                            {gml + L, 2 * L, L, gb_lv},
                            {ga1, H, H, gb_enc}},
                           B};
  const int64_t max_n = std::max(I, std::max(H, L));
  column_sums_kernel<T><<<dim3(unsigned((max_n + 31) / 32), kColSumJobs), dim3(32, 32), 0, stream>>>(jobs);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  T* t = a3;
  matmul(static_cast<const T*>(ga1), H, 1, w_enc, I, 1, t, I, B, I, H, dev);
  add_kernel<T><<<grid_for(B * I), kThreads, 0, stream>>>(gx, t, B * I);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

VaeElboBackwardResult vae_elbo_backward_cuda(
    const std::optional<Tensor>& grad_elbo, const std::optional<Tensor>& grad_recon,
    const std::optional<Tensor>& grad_kl, const Tensor& x, const Tensor& eps, const Tensor& w_enc,
    const Tensor& b_enc, const Tensor& w_mu, const Tensor& b_mu, const Tensor& w_logvar,
    const Tensor& b_logvar, const Tensor& w_dec1, const Tensor& b_dec1, const Tensor& w_dec2,
    const Tensor& b_dec2) {
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  if (x.is_cuda()) guard.emplace(x.get_device_index());
  VaeElboBackwardCall c(grad_elbo, grad_recon, grad_kl, x, eps, w_enc, b_enc, w_mu, b_mu,
                        w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2);
  FUSED_OPS_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", device_str(x));
  dispatch_float(x.scalar_type(), [&](auto zero) { vae_elbo_backward_launch<decltype(zero)>(c); });
  return c.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("vae_elbo_backward", TORCH_BOX(&vae_elbo_backward_cuda));
}

}  // namespace fused_ops
