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
// products, 10 kernels and 2 device copies.  All five bias gradients are one
// two-launch column sum (double accumulation, fixed order).
// Workspace: B * (I + 4H + 6L) elements plus [w_mu; w_logvar] (2 L H).
//
// vae_elbo_train_backward runs the same chain on the activations
// vae_elbo_train saved (no forward products: 9 products, or 8 without x's
// gradient; workspace B * (I + 2H + 3L) + 2 L H).  The forward chain is
// cublas_chain.cuh's, shared with the forward's cublas path.

#include <algorithm>

#include "cuda/vae_elbo/cublas_chain.cuh"

namespace fused_ops {
namespace vae_elbo_backward_kernels {
namespace {

using vae_elbo_chain::up4;

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535)));
}

template <typename T>
__global__ void add_kernel(T* out, const T* v, int64_t n) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x)
    out[k] += v[k];
}

// Column sums of several row-major matrices of B rows (the bias gradients),
// in two launches with a fixed order and no atomics.  Pass 1: job
// blockIdx.y, row split blockIdx.z (rows [z S, (z + 1) S), S = ceil(B /
// splits)), 32 columns per block; thread (tx, ty) of a (32, 8) block sums
// rows ty, ty + 8, ... of its split of column tx in double, the 8 partials
// are added in order and stored to part[(job splits + split) ld_part + j].
// Pass 2 adds each column's `splits` partials in split order.  Splitting the
// rows keeps the SMs busy: one block per 32 columns over all 8192 rows was a
// chain of 256 dependent loads per thread.
constexpr int kColSumJobs = 5;
constexpr int kColRows = 8;

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
__global__ void column_partials_kernel(const ColSumJobs<T> jobs, double* part, int64_t ld_part,
                                       int64_t split_rows) {
  __shared__ double acc_s[kColRows][32];
  const ColSumJob<T> jb = jobs.job[blockIdx.y];
  if (int64_t(blockIdx.x) * 32 >= jb.n) return;  // uniform over the block
  const int64_t j = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.z) * split_rows;
  const int64_t r1 = r0 + split_rows < jobs.rows ? r0 + split_rows : jobs.rows;
  double acc = 0;
  if (j < jb.n)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) acc += double(jb.in[r * jb.ld + j]);
  acc_s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < jb.n) {
    double s = 0;
    for (int k = 0; k < kColRows; ++k) s += acc_s[k][threadIdx.x];
    part[(int64_t(blockIdx.y) * gridDim.z + blockIdx.z) * ld_part + j] = s;
  }
}

template <typename T>
__global__ void column_finish_kernel(const ColSumJobs<T> jobs, const double* part, int64_t ld_part,
                                     int splits) {
  const ColSumJob<T> jb = jobs.job[blockIdx.y];
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= jb.n) return;
  double s = 0;
  for (int k = 0; k < splits; ++k) s += part[(int64_t(blockIdx.y) * splits + k) * ld_part + j];
  jb.out[j] = T(s);
}

// Row splits for B rows: about 256 rows each, at most 64.
inline int column_splits(int64_t rows) {
  return int(std::max<int64_t>(1, std::min<int64_t>(64, (rows + 255) / 256)));
}

// Workspace of the partials, in elements of T (doubles, 8-byte aligned).
template <typename T>
int64_t column_part_elems(int64_t rows, int64_t max_n) {
  return (int64_t(kColSumJobs) * column_splits(rows) * max_n * int64_t(sizeof(double)) + sizeof(T) - 1) /
         int64_t(sizeof(T));
}

template <typename T>
void column_sums(const ColSumJobs<T>& jobs, int64_t max_n, T* workspace, cudaStream_t stream) {
  const int splits = column_splits(jobs.rows);
  const int64_t split_rows = (jobs.rows + splits - 1) / splits;
  double* part = reinterpret_cast<double*>(workspace);
  column_partials_kernel<T><<<dim3(unsigned((max_n + 31) / 32), kColSumJobs, unsigned(splits)),
                              dim3(32, kColRows), 0, stream>>>(jobs, part, max_n, split_rows);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  column_finish_kernel<T><<<dim3(unsigned((max_n + 127) / 128), kColSumJobs), 128, 0, stream>>>(
      jobs, part, max_n, splits);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

// saved: vae_elbo_train's activations (VaeSavedLayout, logits with their
// bias), read instead of recomputing the forward; nullptr: recompute.  An
// empty c.gx (vae_elbo_train_backward without grad_x) skips x's gradient:
// BCE's target term and the [B, H] x [H, I] product.
template <typename T>
void run_cublas(const VaeElboBackwardCall& c, const T* saved) {
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
  const bool with_gx = c.gx.numel() > 0;
  T* gx = with_gx ? mdata<T>(c.gx) : nullptr;
  T* geps = mdata<T>(c.geps);

  // Workspace, each piece starting on a multiple of 4 elements; the forward's
  // activations only when they are recomputed.
  const int64_t n_fwd = saved ? 0 : up4(B * H) + up4(B * 2 * L) + up4(B * L) + up4(B * H);
  const int64_t max_n = std::max(I, std::max(H, L));
  const int64_t n_a3 = up4(B * I), n_ga2 = up4(B * H), n_gz = up4(B * L), n_gml = up4(B * 2 * L),
                n_ga1 = up4(B * H), n_w = up4(2 * L * H), n_part = up4(column_part_elems<T>(B, max_n));
  Tensor ws = empty_like_device(c.x, {n_fwd + n_a3 + n_ga2 + n_gz + n_gml + n_ga1 + n_w + n_part});
  T* a3 = mdata<T>(ws) + n_fwd;
  T* ga2 = a3 + n_a3;
  T* gz = ga2 + n_ga2;
  T* gml = gz + n_gz;
  T* ga1 = gml + n_gml;
  T* w_mulv = ga1 + n_ga1;  // [w_mu; w_logvar], [2L, H]
  T* col_part = w_mulv + n_w;  // the column sums' double partials (16-byte aligned: offsets up4)
  vae_elbo_chain::stack_heads(c, w_mulv, static_cast<T*>(nullptr), stream);

  const T *h, *ml, *z, *g, *logits, *b_logits;
  if (saved) {
    const VaeSavedLayout lay(B, I, H, L);
    h = saved + lay.h;
    ml = saved + lay.ml;
    z = saved + lay.z;
    g = saved + lay.g;
    logits = saved + lay.logits;
    b_logits = nullptr;  // saved with the bias
  } else {
    T* h_ = mdata<T>(ws);
    T* ml_ = h_ + up4(B * H);
    T* z_ = ml_ + up4(B * 2 * L);
    T* g_ = z_ + up4(B * L);
    vae_elbo_chain::forward_chain(c, static_cast<const T*>(w_mulv), h_, ml_, z_, g_, a3);
    h = h_, ml = ml_, z = z_, g = g_;
    logits = a3;  // BCE backward turns them into their gradient in place
    b_logits = cdata<T>(c.b_dec2);
  }

  // ---- decoder backward
  cuda::apply_epilogue(stream, logits, I, B, I,
                       BceBackward<T>{b_logits, x, g_elbo, g_recon, a3, gx, I, c.likelihood});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(a3), 1, I, g, H, 1, gw_d2, H, I, H, B, dev);
  matmul(static_cast<const T*>(a3), I, 1, w_d2, H, 1, ga2, H, B, H, I, dev);
  cuda::apply_epilogue(stream, ga2, H, B, H, ReluMask<T>{ga2, H, g});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(ga2), 1, H, z, L, 1, gw_d1, L, H, L, B, dev);
  matmul(static_cast<const T*>(ga2), H, 1, w_d1, L, 1, gz, L, B, L, H, dev);

  // ---- reparameterisation + KL backward
  cuda::apply_epilogue(stream, gz, L, B, L, LatentBackward<T>{ml, eps, g_elbo, g_kl, gml, geps, L});
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  matmul(static_cast<const T*>(gml), 1, 2 * L, h, H, 1, gw_mu, H, L, H, B, dev);
  matmul(static_cast<const T*>(gml + L), 1, 2 * L, h, H, 1, gw_lv, H, L, H, B, dev);

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
  column_sums(jobs, max_n, col_part, stream);
  if (!with_gx) return;
  T* t = a3;
  matmul(static_cast<const T*>(ga1), H, 1, w_enc, I, 1, t, I, B, I, H, dev);
  add_kernel<T><<<grid_for(B * I), kThreads, 0, stream>>>(gx, t, B * I);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void launch_cublas(const BackwardLaunch& l) {
  if (l.f32) {
    run_cublas<float>(l.c, l.saved ? cdata<float>(*l.saved) : nullptr);
  } else {
    run_cublas<double>(l.c, l.saved ? cdata<double>(*l.saved) : nullptr);
  }
}

}  // namespace vae_elbo_backward_kernels
}  // namespace fused_ops
