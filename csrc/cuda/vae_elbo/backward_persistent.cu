// \brief Persistent path of fused_ops::vae_elbo_backward: the whole
// backward of small and medium batches in ONE cooperative launch.
//
// Chosen when the products' work, B H (6 I + 8 L) multiply-adds, is at most
// kPersistentMaxMacs (training batches up to ~1000 rows at 784-256-32).  At
// these sizes the GPU work is tens of microseconds and the cuBLAS path's 24
// host calls (each product a dispatcher call) cost more than that: a
// training step would be host-bound.
//
// Design: the forward is recomputed and the chain below runs as nine phases
// separated by grid barriers (cuda/primitives/cooperative.cuh); every product is a set
// of 32 x 32 tiles dealt to the blocks (cuda/primitives/tile_gemm.cuh), with the
// elementwise work fused into the tiles' epilogues (backward_paths.cuh):
//   1  h   = relu(x @ w_enc^T + b_enc); [w_mu; w_logvar] copied side by side
//   2  mu, logvar = h @ w_mu^T + b_mu, h @ w_logvar^T + b_logvar
//   3  z   = mu + exp(0.5 logvar) eps
//   4  g   = relu(z @ w_dec1^T + b_dec1)
//   5  logits = g @ w_dec2^T + b_dec2 -> ga3 (BCE + sigmoid backward), gx = BCE target term
//   6  gw_dec2 = ga3^T @ g;  ga2 = (ga3 @ w_dec2) * [g > 0];  gb_dec2
//   7  gw_dec1 = ga2^T @ z;  gz = ga2 @ w_dec1 -> [gmu, glv], geps;  gb_dec1
//   8  gw_mu, gw_logvar = gmu^T @ h, glv^T @ h;  ga1 = ([gmu, glv] @ [w_mu; w_logvar]) * [h > 0];
//      gb_mu, gb_logvar
//   9  gw_enc = ga1^T @ x;  gx += ga1 @ w_enc;  gb_enc
// Workspace: B (4H + I + 5L) elements plus 2 L H.  The grid is at most two
// blocks per SM (enough to cover the busy phases' latency; a larger grid
// makes every barrier slower) and no more than the busiest phase's units.

#include <algorithm>
#include <iterator>

#include "cuda/primitives/cooperative.cuh"
#include "cuda/primitives/tile_gemm.cuh"
#include "cuda/vae_elbo/backward_paths.cuh"

namespace fused_ops {
namespace vae_elbo_backward_kernels {
namespace {

// Tile epilogues: (m, n, value of the product at (m, n)).
template <typename T>
struct AddTo {
  T* c;
  int64_t ldc;
  __device__ void operator()(int64_t m, int64_t n, T v) const { c[m * ldc + n] += v; }
};

template <typename T>
struct PersistentArgs {
  int64_t B, I, H, L;
  const T *x, *eps, *w_enc, *b_enc, *w_mu, *b_mu, *w_lv, *b_lv, *w_d1, *b_d1, *w_d2, *b_d2;
  const T *g_elbo, *g_recon, *g_kl;  // nullptr where None
  T *gx, *geps, *gw_enc, *gb_enc, *gw_mu, *gb_mu, *gw_lv, *gb_lv, *gw_d1, *gb_d1, *gw_d2, *gb_d2;
  // workspace: h, g, ga2, ga1 [B, H]; ml, gml [B, 2L]; z [B, L]; ga3 [B, I]; w_mulv [2L, H]
  T *h, *ml, *z, *g, *ga3, *ga2, *gml, *ga1, *w_mulv;
  int64_t likelihood;  // common/likelihood.h
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
                           BceBackward<T>{p.b_d2, p.x, p.g_elbo, p.g_recon, p.ga3, p.gx, I, p.likelihood}));
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

template <typename T>
void run_persistent(const VaeElboBackwardCall& c) {
  PersistentArgs<T> a{c.B, c.I, c.H, c.L, cdata<T>(c.x), cdata<T>(c.eps), cdata<T>(c.w_enc),
                      cdata<T>(c.b_enc), cdata<T>(c.w_mu), cdata<T>(c.b_mu),
                      cdata<T>(c.w_logvar), cdata<T>(c.b_logvar), cdata<T>(c.w_dec1),
                      cdata<T>(c.b_dec1), cdata<T>(c.w_dec2), cdata<T>(c.b_dec2),
                      cdata_or_null<T>(c.g_elbo), cdata_or_null<T>(c.g_recon), cdata_or_null<T>(c.g_kl),
                      mdata<T>(c.gx), mdata<T>(c.geps), mdata<T>(c.gw_enc), mdata<T>(c.gb_enc),
                      mdata<T>(c.gw_mu), mdata<T>(c.gb_mu), mdata<T>(c.gw_logvar), mdata<T>(c.gb_logvar),
                      mdata<T>(c.gw_dec1), mdata<T>(c.gb_dec1), mdata<T>(c.gw_dec2),
                      mdata<T>(c.gb_dec2)};  // workspace pointers set by vae_elbo_backward_persistent
  a.likelihood = c.likelihood;
  vae_elbo_backward_persistent<T>(c, a);
}

}  // namespace

bool persistent_applies(const BackwardLaunch& l) {
  const VaeElboBackwardCall& c = l.c;
  return double(c.B) * double(c.H) * (6.0 * double(c.I) + 8.0 * double(c.L)) <= kPersistentMaxMacs;
}

void launch_persistent(const BackwardLaunch& l) {
  if (l.f32) {
    run_persistent<float>(l.c);
  } else {
    run_persistent<double>(l.c);
  }
}

}  // namespace vae_elbo_backward_kernels
}  // namespace fused_ops
