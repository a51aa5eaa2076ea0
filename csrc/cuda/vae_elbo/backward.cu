// CUDA implementation of fused_ops::vae_elbo_backward (the backward of vae_elbo).
//
// Two paths, chosen by the amount of work (multiply-adds of the products,
// about B H (6 I + 8 L)):
//
// * Persistent (up to kPersistentMaxMacs, i.e. training batches up to ~1000
//   rows at 784-256-32): ONE cooperative launch that runs the whole chain
//   below as nine phases separated by grid barriers, every product a set of
//   32 x 32 tiles dealt to the blocks (cuda/tile_gemm.cuh) with the
//   elementwise work fused into the tiles' epilogues.  At these sizes the
//   GPU work is tens of microseconds, and the cuBLAS path's 24 host calls
//   (each product a dispatcher call) cost more than that: a training step
//   was host-bound.
//     1  h   = relu(x @ w_enc^T + b_enc); [w_mu; w_logvar] copied side by side
//     2  mu, logvar = h @ w_mu^T + b_mu, h @ w_logvar^T + b_logvar
//     3  z   = mu + exp(0.5 logvar) eps
//     4  g   = relu(z @ w_dec1^T + b_dec1)
//     5  logits = g @ w_dec2^T + b_dec2 -> ga3 (BCE + sigmoid backward), gx = BCE target term
//     6  gw_dec2 = ga3^T @ g;  ga2 = (ga3 @ w_dec2) * [g > 0];  gb_dec2
//     7  gw_dec1 = ga2^T @ z;  gz = ga2 @ w_dec1 -> [gmu, glv], geps;  gb_dec1
//     8  gw_mu, gw_logvar = gmu^T @ h, glv^T @ h;  ga1 = ([gmu, glv] @ [w_mu; w_logvar]) * [h > 0];
//        gb_mu, gb_logvar
//     9  gw_enc = ga1^T @ x;  gx += ga1 @ w_enc;  gb_enc
//   Workspace: B (4H + I + 5L) elements plus 2 L H.
//
// * cuBLAS (larger): the same chain with the products on cuBLAS through
//   common/matmul.h (aten::mm.out on views of raw buffers, on torch's current
//   stream, no transposes copied) and small fused elementwise kernels between
//   them: 13 products, 9 kernels and 2 device copies.
//   Workspace: B * (I + 4H + 6L) elements plus [w_mu; w_logvar] (2 L H).
//
// Both paths: column (bias-gradient) sums in a fixed order in double, no
// atomics, so results are bitwise reproducible.  Numerics follow PyTorch's
// kernels: p = 1 / (1 + exp(-a)); BCE backward (p - x) / max((1 - p) p,
// 1e-12); sigmoid backward * (1 - p) * p; BCE target gradient -log(p / (1 - p)).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <optional>

#include "common/matmul.h"
#include "cuda/primitives/cooperative.cuh"
#include "cuda/primitives/runtime.cuh"
#include "cuda/primitives/tile_gemm.cuh"
#include "vae_elbo_backward.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
// Largest amount of work (multiply-adds, B H (6 I + 8 L)) for the persistent
// path: B = 1024 at 784-256-32 is 1.3e9.
constexpr double kPersistentMaxMacs = 1.5e9;

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

// Element (b, i) of the logits before their bias -> the gradient at the
// logits (BCE backward with PyTorch's clamp, then sigmoid backward) into ga3
// and BCE's target gradient -logit(p) * d_recon into gx (zero where d_recon
// is zero).  Both paths: a tile epilogue, and cuda::apply_epilogue after cuBLAS.
template <typename T>
struct BceBackward {
  const T *b_dec2, *x, *g_elbo, *g_recon;
  T *ga3, *gx;
  int64_t I;
  __device__ void operator()(int64_t b, int64_t i, T v) const {
    const T dr = upstream(g_elbo, g_recon, b);
    const T a = v + b_dec2[i];
    const T p = T(1) / (T(1) + dexp(-a));
    const T q = T(1) - p;
    const T qp = q * p;
    const T den = qp < T(1e-12) ? T(1e-12) : qp;
    const T gp = dr * (p - x[b * I + i]) / den;
    ga3[b * I + i] = gp * q * p;
    gx[b * I + i] = dr != T(0) ? -dlog(p / q) * dr : T(0);
  }
};

// Element (b, l) of the gradient at z, with mu/logvar (ml [B, 2L]) and eps
// -> gml [B, 2L] = [gmu, glv] and geps [B, L].  Both paths: a tile epilogue,
// and cuda::apply_epilogue after cuBLAS.
template <typename T>
struct LatentBackward {
  const T *ml, *eps, *g_elbo, *g_kl;
  T *gml, *geps;
  int64_t L;
  __device__ void operator()(int64_t b, int64_t l, T gz) const {
    const T dk = upstream(g_elbo, g_kl, b);
    const T mu = ml[b * 2 * L + l], lv = ml[b * 2 * L + L + l];
    const T s = dexp(T(0.5) * lv);
    gml[b * 2 * L + l] = gz + dk * mu;
    gml[b * 2 * L + L + l] = T(0.5) * (gz * eps[b * L + l] * s) + (T(-0.5) * dk) * (T(1) - dexp(lv));
    geps[b * L + l] = gz * s;
  }
};

// Tile epilogues: (m, n, value of the product at (m, n)).
template <typename T>
struct AddTo {
  T* c;
  int64_t ldc;
  __device__ void operator()(int64_t m, int64_t n, T v) const { c[m * ldc + n] += v; }
};

template <typename T>
struct AddBias {
  T* c;
  int64_t ldc;
  const T* bias;
  __device__ void operator()(int64_t m, int64_t n, T v) const { c[m * ldc + n] = v + bias[n]; }
};

template <typename T>
struct AddBiasRelu {
  T* c;
  int64_t ldc;
  const T* bias;
  __device__ void operator()(int64_t m, int64_t n, T v) const {
    const T u = v + bias[n];
    c[m * ldc + n] = u < T(0) ? T(0) : u;
  }
};

// ReLU backward on the ReLU's output `act` (same layout as c).
template <typename T>
struct ReluMask {
  T* c;
  int64_t ldc;
  const T* act;
  __device__ void operator()(int64_t m, int64_t n, T v) const {
    c[m * ldc + n] = act[m * ldc + n] > T(0) ? v : T(0);
  }
};

// z = mu + exp(logvar / 2) * eps from ml [B, 2L] (mu, logvar with biases).
template <typename T>
struct Reparameterize {
  const T *ml, *eps;
  T* z;
  int64_t L;
  __device__ void operator()(int64_t b, int64_t l, T) const {
    z[b * L + l] = ml[b * 2 * L + l] + dexp(T(0.5) * ml[b * 2 * L + L + l]) * eps[b * L + l];
  }
};

// The cuBLAS path's latent stage in one launch: ml [B, 2L] holds h @
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

// ---------------------------------------------------------------------------
// persistent path
// ---------------------------------------------------------------------------

template <typename T>
struct PersistentArgs {
  int64_t B, I, H, L;
  const T *x, *eps, *w_enc, *b_enc, *w_mu, *b_mu, *w_lv, *b_lv, *w_d1, *b_d1, *w_d2, *b_d2;
  const T *g_elbo, *g_recon, *g_kl;  // nullptr where None
  T *gx, *geps, *gw_enc, *gb_enc, *gw_mu, *gb_mu, *gw_lv, *gb_lv, *gw_d1, *gb_d1, *gw_d2, *gb_d2;
  // workspace: h, g, ga2, ga1 [B, H]; ml, gml [B, 2L]; z [B, L]; ga3 [B, I]; w_mulv [2L, H]
  T *h, *ml, *z, *g, *ga3, *ga2, *gml, *ga1, *w_mulv;
};

// The nine phases of the header comment; grid.sync() between them.
template <typename T>
__global__ void __launch_bounds__(cuda::kTileThreads)
    vae_elbo_backward_persistent_kernel(const PersistentArgs<T> p) {
  using cuda::ColumnSumJob;
  using cuda::gemm_job;
  using cuda::run_phase;
  using V = cuda::MatView<T>;
  const auto [smem, grid, tid, nthreads] = cuda::phase_context<T>();
  const int64_t B = p.B, I = p.I, H = p.H, L = p.L, L2 = 2 * p.L;

  for (int64_t k = tid; k < L * H; k += nthreads) {
    p.w_mulv[k] = p.w_mu[k];
    p.w_mulv[L * H + k] = p.w_lv[k];
  }
  run_phase(smem, gemm_job(V{p.x, I, 1}, V{p.w_enc, 1, I}, B, H, I, AddBiasRelu<T>{p.h, H, p.b_enc}));
  grid.sync();

  run_phase(smem, gemm_job(V{p.h, H, 1}, V{p.w_mu, 1, H}, B, L, H, AddBias<T>{p.ml, L2, p.b_mu}),
            gemm_job(V{p.h, H, 1}, V{p.w_lv, 1, H}, B, L, H, AddBias<T>{p.ml + L, L2, p.b_lv}));
  grid.sync();

  const Reparameterize<T> reparameterize{p.ml, p.eps, p.z, L};
  for (int64_t k = tid; k < B * L; k += nthreads) reparameterize(k / L, k % L, T(0));
  grid.sync();

  run_phase(smem, gemm_job(V{p.z, L, 1}, V{p.w_d1, 1, L}, B, H, L, AddBiasRelu<T>{p.g, H, p.b_d1}));
  grid.sync();

  run_phase(smem, gemm_job(V{p.g, H, 1}, V{p.w_d2, 1, H}, B, I, H,
                           BceBackward<T>{p.b_d2, p.x, p.g_elbo, p.g_recon, p.ga3, p.gx, I}));
  grid.sync();

  run_phase(smem, gemm_job(V{p.ga3, 1, I}, V{p.g, H, 1}, I, H, B, cuda::StoreEpilogue<T>{p.gw_d2, H}),
            gemm_job(V{p.ga3, I, 1}, V{p.w_d2, H, 1}, B, H, I, ReluMask<T>{p.ga2, H, p.g}),
            ColumnSumJob<T>{p.ga3, I, I, B, p.gb_d2});
  grid.sync();

  run_phase(smem, gemm_job(V{p.ga2, 1, H}, V{p.z, L, 1}, H, L, B, cuda::StoreEpilogue<T>{p.gw_d1, L}),
            gemm_job(V{p.ga2, H, 1}, V{p.w_d1, L, 1}, B, L, H,
                     LatentBackward<T>{p.ml, p.eps, p.g_elbo, p.g_kl, p.gml, p.geps, L}),
            ColumnSumJob<T>{p.ga2, H, H, B, p.gb_d1});
  grid.sync();

  run_phase(smem, gemm_job(V{p.gml, 1, L2}, V{p.h, H, 1}, L, H, B, cuda::StoreEpilogue<T>{p.gw_mu, H}),
            gemm_job(V{p.gml + L, 1, L2}, V{p.h, H, 1}, L, H, B, cuda::StoreEpilogue<T>{p.gw_lv, H}),
            gemm_job(V{p.gml, L2, 1}, V{p.w_mulv, H, 1}, B, H, L2, ReluMask<T>{p.ga1, H, p.h}),
            ColumnSumJob<T>{p.gml, L2, L, B, p.gb_mu}, ColumnSumJob<T>{p.gml + L, L2, L, B, p.gb_lv});
  grid.sync();

  run_phase(smem, gemm_job(V{p.ga1, 1, H}, V{p.x, I, 1}, H, I, B, cuda::StoreEpilogue<T>{p.gw_enc, I}),
            gemm_job(V{p.ga1, H, 1}, V{p.w_enc, I, 1}, B, I, H, AddTo<T>{p.gx, I}),
            ColumnSumJob<T>{p.ga1, H, H, B, p.gb_enc});
}

// Units (tiles and column strips) of the busiest phase: more blocks than
// that would only wait at the barriers.
inline int64_t persistent_max_units(int64_t B, int64_t I, int64_t H, int64_t L) {
  using cuda::tile_count;
  auto strips = [](int64_t n) { return (n + cuda::kTile - 1) / cuda::kTile; };
  const int64_t phases[] = {
      tile_count(B, H),
      2 * tile_count(B, L),
      tile_count(B, H),
      tile_count(B, I),
      tile_count(I, H) + tile_count(B, H) + strips(I),
      tile_count(H, L) + tile_count(B, L) + strips(H),
      2 * tile_count(L, H) + tile_count(B, H) + 2 * strips(L),
      tile_count(H, I) + tile_count(B, I) + strips(H),
  };
  return *std::max_element(std::begin(phases), std::end(phases));
}

template <typename T>
void vae_elbo_backward_persistent(const VaeElboBackwardCall& c, PersistentArgs<T>& a) {
  const int64_t B = c.B, I = c.I, H = c.H, L = c.L;
  auto up4 = [](int64_t n) { return (n + 3) / 4 * 4; };
  const int64_t n_bh = up4(B * H), n_ml = up4(B * 2 * L), n_z = up4(B * L), n_bi = up4(B * I),
                n_w = up4(2 * L * H);
  Tensor ws = empty_like_device(c.x, {4 * n_bh + 2 * n_ml + n_z + n_bi + n_w});
  T* w = mdata<T>(ws);
  a.h = w;
  a.g = a.h + n_bh;
  a.ga2 = a.g + n_bh;
  a.ga1 = a.ga2 + n_bh;
  a.ml = a.ga1 + n_bh;
  a.gml = a.ml + n_ml;
  a.z = a.gml + n_ml;
  a.ga3 = a.z + n_z;
  a.w_mulv = a.ga3 + n_bi;

  auto kernel = vae_elbo_backward_persistent_kernel<T>;
  // At most two blocks per SM: enough to cover the busy phases' latency; a
  // larger grid makes every barrier slower.
  const int64_t sms = cuda::multiprocessor_count(cuda::current_device());
  int64_t grid = std::min(cuda::max_resident_blocks(kernel, cuda::kTileThreads, 0), 2 * sms);
  grid = std::max<int64_t>(1, std::min(grid, persistent_max_units(B, I, H, L)));
  cuda::launch_cooperative(kernel, grid, cuda::kTileThreads, 0, a);
}

// ---------------------------------------------------------------------------
// cuBLAS path
// ---------------------------------------------------------------------------

template <typename T>
void vae_elbo_backward_launch(const VaeElboBackwardCall& c) {
  const int64_t B = c.B, I = c.I, H = c.H, L = c.L;
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  T* gw_enc = mdata<T>(c.gw_enc);
  T* gb_enc = mdata<T>(c.gb_enc);
  T* gw_mu = mdata<T>(c.gw_mu);
  T* gb_mu = mdata<T>(c.gb_mu);
  T* gw_lv = mdata<T>(c.gw_logvar);
  T* gb_lv = mdata<T>(c.gb_logvar);
  T* gw_d1 = mdata<T>(c.gw_dec1);
  T* gb_d1 = mdata<T>(c.gb_dec1);
  T* gw_d2 = mdata<T>(c.gw_dec2);
  T* gb_d2 = mdata<T>(c.gb_dec2);
  if (B == 0) {
    for (const Tensor* t : {&c.gw_enc, &c.gb_enc, &c.gw_mu, &c.gb_mu, &c.gw_logvar, &c.gb_logvar,
                            &c.gw_dec1, &c.gb_dec1, &c.gw_dec2, &c.gb_dec2})
      FUSED_OPS_CUDA_CHECK(
          cudaMemsetAsync(mdata<T>(*t), 0, size_t(t->numel()) * sizeof(T), stream));
    return;
  }
  const torch::stable::Device dev = c.x.device();
  const T* x = cdata<T>(c.x);
  const T* eps = cdata<T>(c.eps);
  const T* w_enc = cdata<T>(c.w_enc);
  const T* w_d1 = cdata<T>(c.w_dec1);
  const T* w_d2 = cdata<T>(c.w_dec2);
  const T* g_elbo = cdata_or_null<T>(c.g_elbo);
  const T* g_recon = cdata_or_null<T>(c.g_recon);
  const T* g_kl = cdata_or_null<T>(c.g_kl);
  T* gx = mdata<T>(c.gx);
  T* geps = mdata<T>(c.geps);

  if (double(B) * double(H) * (6.0 * double(I) + 8.0 * double(L)) <= kPersistentMaxMacs) {
    PersistentArgs<T> a{B, I, H, L, x, eps, w_enc, cdata<T>(c.b_enc),
                        cdata<T>(c.w_mu), cdata<T>(c.b_mu),
                        cdata<T>(c.w_logvar), cdata<T>(c.b_logvar), w_d1,
                        cdata<T>(c.b_dec1), w_d2, cdata<T>(c.b_dec2),
                        g_elbo, g_recon, g_kl, gx, geps, gw_enc, gb_enc, gw_mu, gb_mu, gw_lv,
                        gb_lv, gw_d1, gb_d1, gw_d2, gb_d2};  // workspace pointers set below
    vae_elbo_backward_persistent<T>(c, a);
    return;
  }

  // Workspace, each piece starting on a multiple of 4 elements.
  auto up4 = [](int64_t n) { return (n + 3) / 4 * 4; };
  const int64_t n_h = up4(B * H), n_ml = up4(B * 2 * L), n_z = up4(B * L), n_g = up4(B * H),
                n_a3 = up4(B * I), n_ga2 = up4(B * H), n_gz = up4(B * L), n_gml = up4(B * 2 * L),
                n_ga1 = up4(B * H), n_w = up4(2 * L * H);
  Tensor ws = empty_like_device(
      c.x, {n_h + n_ml + n_z + n_g + n_a3 + n_ga2 + n_gz + n_gml + n_ga1 + n_w});
  T* h = mdata<T>(ws);
  T* ml = h + n_h;
  T* z = ml + n_ml;
  T* g = z + n_z;
  T* a3 = g + n_g;
  T* ga2 = a3 + n_a3;
  T* gz = ga2 + n_ga2;
  T* gml = gz + n_gz;
  T* ga1 = gml + n_gml;
  T* w_mulv = ga1 + n_ga1;  // [w_mu; w_logvar], [2L, H]
  FUSED_OPS_CUDA_CHECK(cudaMemcpyAsync(w_mulv, cdata<T>(c.w_mu), size_t(L * H) * sizeof(T),
                                       cudaMemcpyDeviceToDevice, stream));
  FUSED_OPS_CUDA_CHECK(cudaMemcpyAsync(w_mulv + L * H, cdata<T>(c.w_logvar),
                                       size_t(L * H) * sizeof(T), cudaMemcpyDeviceToDevice, stream));

  // ---- forward recompute
  linear_nt(x, I, w_enc, I, h, H, B, H, I, dev);
  cuda::apply_epilogue(stream, h, H, B, H, AddBiasRelu<T>{h, H, cdata<T>(c.b_enc)});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  linear_nt(h, H, static_cast<const T*>(w_mulv), H, ml, 2 * L, B, 2 * L, H, dev);
  cuda::apply_epilogue(stream, ml, 2 * L, B, L,
                       LatentForward<T>{{ml, 2 * L, cdata<T>(c.b_mu)},
                                        {ml + L, 2 * L, cdata<T>(c.b_logvar)},
                                        {ml, eps, z, L}});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  linear_nt(static_cast<const T*>(z), L, w_d1, L, g, H, B, H, L, dev);
  cuda::apply_epilogue(stream, g, H, B, H, AddBiasRelu<T>{g, H, cdata<T>(c.b_dec1)});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  linear_nt(static_cast<const T*>(g), H, w_d2, H, a3, I, B, I, H, dev);

  // ---- decoder backward
  cuda::apply_epilogue(stream, a3, I, B, I,
                       BceBackward<T>{cdata<T>(c.b_dec2), x, g_elbo, g_recon, a3, gx, I});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(a3), 1, I, static_cast<const T*>(g), H, 1, gw_d2, H, I, H, B, dev);
  matmul(static_cast<const T*>(a3), I, 1, w_d2, H, 1, ga2, H, B, H, I, dev);
  cuda::apply_epilogue(stream, ga2, H, B, H, ReluMask<T>{ga2, H, g});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(ga2), 1, H, static_cast<const T*>(z), L, 1, gw_d1, L, H, L, B, dev);
  matmul(static_cast<const T*>(ga2), H, 1, w_d1, L, 1, gz, L, B, L, H, dev);

  // ---- reparameterisation + KL backward
  cuda::apply_epilogue(stream, gz, L, B, L, LatentBackward<T>{ml, eps, g_elbo, g_kl, gml, geps, L});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(gml), 1, 2 * L, static_cast<const T*>(h), H, 1, gw_mu, H, L, H, B, dev);
  matmul(static_cast<const T*>(gml + L), 1, 2 * L, static_cast<const T*>(h), H, 1, gw_lv, H, L, H, B,
         dev);

  // ---- encoder backward
  matmul(static_cast<const T*>(gml), 2 * L, 1, static_cast<const T*>(w_mulv), H, 1, ga1, H, B, H,
         2 * L, dev);
  cuda::apply_epilogue(stream, ga1, H, B, H, ReluMask<T>{ga1, H, h});
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
  const cuda::TensorDeviceGuard guard(x);
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
