// \brief cuBLAS path of fused_ops::vae_elbo_backward: large batches, the
// products on cuBLAS, the elementwise stages as small fused kernels.
//
// Chosen when the persistent path does not apply (more than
// kPersistentMaxMacs multiply-adds: the tile products of one cooperative
// launch would be slower than cuBLAS's).
//
// Design: the same chain as backward_persistent.cu (the forward recomputed,
// then the decoder, reparameterisation / KL and encoder backward), with the
// products through common/matmul.h (aten::mm.out on views of raw buffers, on
// torch's current stream, no transposes copied) and the elementwise stages
// (backward_paths.cuh) as cuda::apply_epilogue launches between them: 13
// products, 9 kernels and 2 device copies.  All five bias gradients are one
// column-sum launch (double accumulation, fixed order).
// Workspace: B * (I + 4H + 6L) elements plus [w_mu; w_logvar] (2 L H).

#include <algorithm>

#include "common/matmul.h"
#include "cuda/primitives/tile_gemm.cuh"
#include "cuda/vae_elbo/backward_paths.cuh"

namespace fused_ops {
namespace vae_elbo_backward_kernels {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535)));
}

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

template <typename T>
void run_cublas(const VaeElboBackwardCall& c) {
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
                       BceBackward<T>{cdata<T>(c.b_dec2), x, g_elbo, g_recon, a3, gx, I, c.likelihood});
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

}  // namespace

void launch_cublas(const BackwardLaunch& l) {
  if (l.f32) {
    run_cublas<float>(l.c);
  } else {
    run_cublas<double>(l.c);
  }
}

}  // namespace vae_elbo_backward_kernels
}  // namespace fused_ops
