// \brief Tiled path of fused_ops::vae_elbo: large float32 batches on
// sm_80 and later GPUs, 3xTF32 mma.sync tensor-core products.
//
// Chosen for float32, B >= kTiledMinBatch, compute capability >= 8.0,
// H % 8 == 0, H <= 256 and a tile's activations within the device's shared
// memory (at H = 256 on an H200: L <= 72), when the wgmma path does not
// apply (an sm_80 GPU, H != 256, L > 32).
//
// One CTA per kTileRows = 64 samples runs the whole forward pass on chip:
// encoder (x streamed through shared memory in kChunk-wide column chunks),
// mu / logvar, z and KL, decoder hidden layer, then the decoder logits in
// 256-column passes whose BCE terms go straight into per-row sums.  Every
// product is a 3xTF32 tensor-core product (cuda/primitives/tf32x3.cuh) with float32
// accumulation: float32 accuracy at tensor-core speed.
//
// Operands are split into their TF32 big and small parts once, not at every
// use (the splits' conversions, repeated by each of the 8 warps reading the
// same A values, would otherwise outnumber the mma instructions):
// - A operands (x chunks, h, z, the decoder hidden layer) are stored split
//   in shared memory when they are produced (cuda::SplitRows, two planes)
//   and read with ldmatrix, two instructions per 16x8 fragment;
// - B operands (the weights) are packed split once per call, by one extra
//   launch before the kernel (cuda::pack_b_fragments with split: one 16-byte
//   load per fragment, 512 contiguous bytes per warp), and stream from L2
//   kDepth - 1 k-steps ahead of their use, in registers (each warp owns its
//   output columns, so no other warp reads them: nothing to share through
//   shared memory).
// Each chunk's products go into a fresh accumulator that is added to the
// layer's sums in float32 (the tensor cores' own accumulation over the whole
// K is far less accurate: see wgmma.cu).
// I and L may be anything (zero padding to whole k-steps on both sides);
// H % 8 == 0 and H <= 256 (8 warps x 32 columns cover the hidden layer).
// 8192 samples make 128 CTAs: one wave on an H100/H200.
//
// The tiled_bf16 path is the same kernel on bfloat16 operands (the Bf16
// format below, cuda/primitives/bf16_mma.cuh): x, eps and the weights are
// bfloat16 in global memory, the A operands one bfloat16 plane in shared
// memory (each activation rounded to bfloat16 when stored, as a bfloat16
// PyTorch program rounds it), the weights packed in m16n8k16 fragment order,
// and every product one bf16 mma.sync (k = 16) with float32 accumulation.
// Everything else stays float32: biases are added to float32 accumulators,
// mu, logvar, z's reparameterisation, the KL and BCE terms and all sums are
// float32; only the three outputs are rounded to bfloat16.  64-column x
// chunks (4 k-steps of 16, the same ring depth); H % 16 == 0 (whole k-steps
// over h and the decoder hidden layer), L padded to 16 with zeros.

#include <array>
#include <tuple>

#include "common/bce.h"
#include "cuda/primitives/bf16_mma.cuh"
#include "cuda/primitives/tf32x3.cuh"
#include "cuda/vae_elbo/paths.cuh"

namespace fused_ops {
namespace vae_elbo_kernels {
namespace {

constexpr int kTileRows = 64;
constexpr int kMT = kTileRows / 16;

// The operand formats the kernel is written for.  Each says how A operands
// sit in shared memory (Rows: stored with store(r, c, v), read through
// lane_base and mma), what a lane's B fragment of one k-step and n8-tile is
// (BFrag), the k of one step, the x columns staged per encoder chunk, the
// row padding (16 bytes: conflict-free ldmatrix), the shared bytes per A
// element, and how inputs are read and outputs written.
//
// float32 inputs, 3xTF32 products (cuda/primitives/tf32x3.cuh): A split in
// two float planes, B fragments {big, big, small, small}.
struct Tf32x3 {
  using In = float;
  using Rows = cuda::SplitRows;
  using BFrag = float4;
  static constexpr int kStep = 8, kChunk = 32, kPad = 4;
  // Floats of shared memory for n A elements: two float planes.
  __host__ __device__ static constexpr int floats(int n) { return 2 * n; }
  __device__ static Rows rows(float* p, int ld) { return {p, ld, kTileRows * ld}; }
  __device__ static const float* lane_base(const Rows& A) { return A.big + cuda::ldmatrix_lane_offset<float>(A.ld); }
  __device__ static BFrag zero_b() { return make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ static float load(const float* p) { return __ldg(p); }
  // part += A[rows, col..col+8) * B over one k-step.
  template <int NT>
  __device__ static void mma(float (&part)[kMT][NT][4], const Rows& A, const float* a_lane, int col,
                             const BFrag (&b)[NT]) {
    uint32_t bb[NT][2], bs[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      bb[nt][0] = __float_as_uint(b[nt].x);
      bb[nt][1] = __float_as_uint(b[nt].y);
      bs[nt][0] = __float_as_uint(b[nt].z);
      bs[nt][1] = __float_as_uint(b[nt].w);
    }
    uint32_t ab[kMT][4], as[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const float* p = a_lane + mt * 16 * A.ld + col;
      cuda::ldmatrix_x4(ab[mt], p);
      cuda::ldmatrix_x4(as[mt], p + A.plane_floats);
    }
    cuda::mma_3xtf32_tiles(part, ab, as, bb, bs);
  }
  __device__ static void store_row(const Args<float>& a, int row, float recon, float kl_sum) {
    store_losses(a, row, recon, kl_sum);
  }
};

// bfloat16 inputs, bf16 products with float32 accumulation
// (cuda/primitives/bf16_mma.cuh): A one bfloat16 plane, B fragments two
// bfloat16 pairs.
struct Bf16 {
  using In = __nv_bfloat16;
  using Rows = cuda::Bf16Rows;
  using BFrag = uint2;
  static constexpr int kStep = 16, kChunk = 64, kPad = 8;
  // Floats of shared memory for n A elements (n even: rows of a multiple of 8).
  __host__ __device__ static constexpr int floats(int n) { return n / 2; }
  __device__ static Rows rows(float* p, int ld) { return {reinterpret_cast<__nv_bfloat16*>(p), ld}; }
  __device__ static const __nv_bfloat16* lane_base(const Rows& A) {
    return A.p + cuda::ldmatrix_lane_offset<__nv_bfloat16>(A.ld);
  }
  __device__ static BFrag zero_b() { return make_uint2(0u, 0u); }
  __device__ static float load(const __nv_bfloat16* p) { return __bfloat162float(__ldg(p)); }
  template <int NT>
  __device__ static void mma(float (&part)[kMT][NT][4], const Rows& A, const __nv_bfloat16* a_lane, int col,
                             const BFrag (&b)[NT]) {
    uint32_t bb[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      bb[nt][0] = b[nt].x;
      bb[nt][1] = b[nt].y;
    }
    uint32_t af[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) cuda::ldmatrix_x4(af[mt], a_lane + mt * 16 * A.ld + col);
    cuda::mma_bf16_tiles(part, af, bb);
  }
  // The row's sums are float32; only the outputs are rounded.
  __device__ static void store_row(const Args<__nv_bfloat16>& a, int row, float recon, float kl_sum) {
    const float kl = -0.5f * kl_sum;
    a.recon[row] = __float2bfloat16_rn(recon);
    a.kl[row] = __float2bfloat16_rn(kl);
    a.elbo[row] = __float2bfloat16_rn(-(recon + kl));
  }
};

template <class Fmt>
constexpr int kDepth = Fmt::kChunk / Fmt::kStep;  // B fragments in flight per warp: a chunk's k-steps
static_assert(kDepth<Tf32x3> == 4 && kDepth<Bf16> == 4, "both formats keep 4 k-steps in flight");
static_assert(kTileRows * Tf32x3::kChunk % kThreads == 0 && kTileRows * Bf16::kChunk % kThreads == 0,
              "x chunks split evenly over the threads");

// Shared memory of the tiled kernel, in floats.  Row strides are kPad
// elements (16 bytes) past a multiple of 16 bytes, an odd number of 16-byte
// groups (conflict-free ldmatrix); mu / logvar, the KL row sums and the
// warps' BCE partial sums are float32 in both formats.
template <class Fmt>
struct TiledLayout {
  int Lp, ldx, ldh, ldz, ldm, xs, hs, zs, ms, klrow, wpart, total;
  __host__ __device__ TiledLayout(int H, int L) {
    Lp = (L + Fmt::kStep - 1) / Fmt::kStep * Fmt::kStep;
    ldx = Fmt::kChunk + Fmt::kPad;
    ldh = H + Fmt::kPad;
    ldz = Lp + Fmt::kPad;
    ldm = 2 * Lp + 4;
    xs = 0;
    hs = xs + Fmt::floats(kTileRows * ldx);
    zs = hs + Fmt::floats(kTileRows * ldh);
    ms = zs + Fmt::floats(kTileRows * ldz);
    klrow = ms + kTileRows * ldm;
    wpart = klrow + kTileRows;
    total = wpart + kWarps * kTileRows;
  }
};

// A weight packed in mma B-fragment order (cuda::pack_b_fragments split, or
// cuda::pack_b_fragments_bf16; one pass): the fragments of k-step s, n8-tile
// T at frag[(s * tiles + T) * 32 + lane], for s < ksteps + kDepth - 1 (the
// last kDepth - 1 k-steps zero).
template <class Fmt>
struct PackedWeight {
  const typename Fmt::BFrag* frag;
  int tiles, ksteps;  // ceil(N / 8), ceil(K / kStep)
};

// The five weights of the tiled kernel, packed once per call.
template <class Fmt>
struct TiledWeights {
  PackedWeight<Fmt> enc, mu, lv, d1, d2;
};

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[kMT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
}

// acc[mt][nt] += A[rows mt*16.., kStep s..) * W[8 (tile0 + nt).., kStep s..)^T
// over k-steps s < ksteps, for the 64 rows of A (shared, zero in the padded
// columns) and the packed weight W (tiles past W.tiles read as zero).
// With CHUNKED, A holds only the current kChunk columns and
// before_chunk(c) runs (in every thread of the CTA: it may hold barriers)
// before k-step c * kDepth, to stage them; otherwise A holds all columns.
// The B ring runs across chunk boundaries, so the weights' L2 latency is
// hidden there too.  A warp whose tiles are all past W.tiles only takes part
// in before_chunk.
template <class Fmt, int NT, bool CHUNKED, typename ChunkFn>
__device__ __forceinline__ void mma_rows64(float (&acc)[kMT][NT][4], const typename Fmt::Rows A,
                                           const PackedWeight<Fmt> W, int tile0, int ksteps,
                                           ChunkFn&& before_chunk) {
  constexpr int kD = kDepth<Fmt>;
  using BFrag = typename Fmt::BFrag;
  const int lane = threadIdx.x % cuda::kWarpSize;
  const bool active = tile0 < W.tiles;  // warp-uniform
  const auto* a_lane = Fmt::lane_base(A);
  // The packed weights hold kDepth - 1 zero k-steps past the last, so the
  // ring's look-ahead needs no bounds test; tiles past the weight's are
  // zero, tested once here.
  bool valid[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) valid[nt] = tile0 + nt < W.tiles;
  const BFrag* b_lane = W.frag + int64_t(tile0) * cuda::kWarpSize + lane;
  const int64_t b_step = int64_t(W.tiles) * cuda::kWarpSize;
  BFrag ring[kD][NT];
  auto load_b = [&](BFrag (&b)[NT], int s) {
    const BFrag* p = b_lane + s * b_step;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      b[nt] = valid[nt] ? __ldg(p + nt * cuda::kWarpSize) : Fmt::zero_b();
    }
  };
#pragma unroll
  for (int d = 0; d < kD - 1; ++d) load_b(ring[d], d);
  for (int s0 = 0; s0 < ksteps; s0 += kD) {
    if (CHUNKED) before_chunk(s0 / kD);
    // This chunk's kDepth k-steps into a fresh accumulator, added to acc in
    // float32 afterwards: the tensor cores' own accumulation over the whole
    // K is far less accurate (wgmma.cu's "Accuracy").
    float part[kMT][NT][4];
    zero_acc(part);
#pragma unroll
    for (int d = 0; d < kD; ++d) {
      const int s = s0 + d;
      if (s >= ksteps) break;  // uniform
      // Refill the slot consumed at step s - 1 with step s + kDepth - 1.
      load_b(ring[(d + kD - 1) % kD], s + kD - 1);
      if (!active) continue;
      const int col = CHUNKED ? d * Fmt::kStep : s * Fmt::kStep;
      Fmt::mma(part, A, a_lane, col, ring[d]);
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] += part[mt][nt][i];
  }
}

template <class Fmt, int NT>
__device__ __forceinline__ void mma_rows64(float (&acc)[kMT][NT][4], const typename Fmt::Rows A,
                                           const PackedWeight<Fmt> W, int tile0, int ksteps) {
  mma_rows64<Fmt, NT, false>(acc, A, W, tile0, ksteps, [](int) {});
}

// Calls f(row, col, value) for each accumulator element (fragment C layout)
// of the tiles at column n0.
template <int NT, typename F>
__device__ __forceinline__ void for_each_acc(const float (&acc)[kMT][NT][4], int n0, F f) {
  const int lane = threadIdx.x % cuda::kWarpSize, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f(mt * 16 + g + (i >= 2 ? 8 : 0), n0 + nt * 8 + 2 * t + (i & 1), acc[mt][nt][i]);
      }
}


// BCE terms of the decoder logits of one pass (tiles at tile0) into the
// per-row sums: lane (g, t) owns rows g + 8 j (j < 2 kMT), summed in a fixed
// order (passes in order, then columns in fragment order).
template <class Fmt, int NT>
__device__ __forceinline__ void decoder_pass(float (&rsum)[2 * kMT], const Args<typename Fmt::In>& a,
                                             const typename Fmt::Rows gs, const PackedWeight<Fmt> w,
                                             int tile0, int row0, int rows) {
  float acc[kMT][NT][4];
  zero_acc(acc);
  mma_rows64<Fmt, NT>(acc, gs, w, tile0, w.ksteps);
  // Row r = 16 mt + g + 8 j (g = lane / 4 < 8) lands in rsum[2 mt + j] = rsum[r / 8].
  // A branch, not a select as in the wgmma kernel: with selects ptxas
  // hoisted all 64 terms' x and bias loads and spilled (176 bytes, sm_80).
  for_each_acc(acc, tile0 * 8, [&](int r, int n, float v) {
    if (n < a.I && r < rows) {
      rsum[r / 8] += bce_term_or_nan(v + Fmt::load(a.b_d2 + n), Fmt::load(a.x + size_t(row0 + r) * a.I + n));
    }
  });
}

template <class Fmt>
__global__ void __launch_bounds__(kThreads, 1)
    vae_elbo_tiled_kernel(const Args<typename Fmt::In> a, const TiledWeights<Fmt> w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kChunk = Fmt::kChunk;
  extern __shared__ __align__(16) float smem[];
  const int I = a.I, H = a.H, L = a.L;
  const TiledLayout<Fmt> lay(H, L);
  const typename Fmt::Rows xs = Fmt::rows(smem + lay.xs, lay.ldx);
  const typename Fmt::Rows hs = Fmt::rows(smem + lay.hs, lay.ldh);  // h, later the decoder hidden layer
  const typename Fmt::Rows zs = Fmt::rows(smem + lay.zs, lay.ldz);
  float* ms = smem + lay.ms;  // mu [.., 0:L) and logvar [.., Lp:Lp+L)
  float* klrow = smem + lay.klrow;
  float* wpart = smem + lay.wpart;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int row0 = blockIdx.x * kTileRows;
  const int rows = min(kTileRows, a.B - row0);
  const int tile0 = warp * 4;  // this warp's 4 n8-tiles (32 columns) of the hidden layer

  // 1. Encoder.  x chunks go through registers one chunk ahead (the global
  //    loads of chunk c + 1 are in flight while the tensor cores work on
  //    chunk c) and are split into shared memory between two barriers.
  {
    float acc[kMT][4][4];
    zero_acc(acc);
    constexpr int kPer = kTileRows * kChunk / kThreads;
    float xr[kPer];
    auto load_x = [&](int kc) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int idx = threadIdx.x + j * kThreads, r = idx / kChunk, c = idx % kChunk;
        xr[j] = (r < rows && kc + c < I) ? Fmt::load(a.x + size_t(row0 + r) * I + kc + c) : 0.0f;
      }
    };
    load_x(0);
    mma_rows64<Fmt, 4, true>(acc, xs, w.enc, tile0, w.enc.ksteps, [&](int c) {
      __syncthreads();  // the previous chunk is consumed
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int idx = threadIdx.x + j * kThreads;
        xs.store(idx / kChunk, idx % kChunk, xr[j]);
      }
      __syncthreads();
      if ((c + 1) * kChunk < I) load_x((c + 1) * kChunk);
    });
    if (tile0 * 8 < H) {
      for_each_acc(acc, tile0 * 8, [&](int r, int n, float v) {
        if (n < H) hs.store(r, n, relu(v + Fmt::load(a.b_enc + n)));
      });
    }
  }
  // Zero the padding columns of z (read as A operand up to Lp).
  for (int idx = threadIdx.x; idx < kTileRows * (lay.Lp - L); idx += kThreads) {
    zs.store(idx / (lay.Lp - L), L + idx % (lay.Lp - L), 0.0f);
  }
  __syncthreads();

  // 2. mu and logvar: units of one n8-tile, mu units then logvar units.
  {
    const int nt_l = lay.Lp / 8;  // bfloat16: may hold one unit past the weight's tiles (idle)
    for (int u = warp; u < 2 * nt_l; u += kWarps) {
      const bool is_lv = u >= nt_l;
      const int t = is_lv ? u - nt_l : u;
      float acc[kMT][1][4];
      zero_acc(acc);
      const PackedWeight<Fmt> wl = is_lv ? w.lv : w.mu;
      mma_rows64<Fmt, 1>(acc, hs, wl, t, wl.ksteps);
      const typename Fmt::In* bias = is_lv ? a.b_lv : a.b_mu;
      for_each_acc(acc, t * 8, [&](int r, int n, float v) {
        if (n < L) ms[r * lay.ldm + (is_lv ? lay.Lp : 0) + n] = v + Fmt::load(bias + n);
      });
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kTileRows * L; idx += kThreads) {
    const int r = idx / L, l = idx % L;
    const float mu = ms[r * lay.ldm + l], lv = ms[r * lay.ldm + lay.Lp + l];
    const float e = r < rows ? Fmt::load(a.eps + size_t(row0 + r) * L + l) : 0.0f;
    zs.store(r, l, mu + expf(0.5f * lv) * e);
    ms[r * lay.ldm + l] = ((1.0f + lv) - mu * mu) - expf(lv);  // KL term
  }
  __syncthreads();
  if (threadIdx.x < kTileRows) {
    float s = 0.0f;
    for (int l = 0; l < L; ++l) s += ms[threadIdx.x * lay.ldm + l];
    klrow[threadIdx.x] = s;
  }

  // 3. Decoder hidden layer into hs (h is no longer needed: the barrier
  //    above follows the last read of h).
  {
    float acc[kMT][4][4];
    zero_acc(acc);
    mma_rows64<Fmt, 4>(acc, zs, w.d1, tile0, w.d1.ksteps);
    if (tile0 * 8 < H) {
      for_each_acc(acc, tile0 * 8, [&](int r, int n, float v) {
        if (n < H) hs.store(r, n, relu(v + Fmt::load(a.b_d1 + n)));
      });
    }
  }
  __syncthreads();

  // 4. Decoder logits into BCE row sums: passes of 4 n8-tiles per warp while
  //    more than one tile per warp is left, then one tile per warp, so the
  //    tail (784 = 3 x 256 + 16 columns) does not cost a whole pass of one
  //    busy warp.
  float rsum[2 * kMT];
#pragma unroll
  for (int j = 0; j < 2 * kMT; ++j) rsum[j] = 0.0f;
  int base = 0;
  for (; w.d2.tiles - base > kWarps; base += 4 * kWarps) {
    if (base + warp * 4 < w.d2.tiles) decoder_pass<Fmt, 4>(rsum, a, hs, w.d2, base + warp * 4, row0, rows);
  }
  for (; base < w.d2.tiles; base += kWarps) {
    if (base + warp < w.d2.tiles) decoder_pass<Fmt, 1>(rsum, a, hs, w.d2, base + warp, row0, rows);
  }
  // The four lanes of a row group (same lane / 4) hold disjoint columns.
#pragma unroll
  for (int j = 0; j < 2 * kMT; ++j) {
    float v = rsum[j];
    v += __shfl_xor_sync(cuda::kFullMask, v, 1);
    v += __shfl_xor_sync(cuda::kFullMask, v, 2);
    if (lane % 4 == 0) wpart[warp * kTileRows + (j / 2) * 16 + (j % 2) * 8 + lane / 4] = v;
  }
  __syncthreads();
  if (int(threadIdx.x) < rows) {
    float recon = 0.0f;
    for (int w = 0; w < kWarps; ++w) recon += wpart[w * kTileRows + threadIdx.x];
    Fmt::store_row(a, row0 + int(threadIdx.x), recon, klrow[threadIdx.x]);
  }
#else
  __trap();  // launched only on compute capability >= 8.0
#endif
}

template <class Fmt>
size_t tiled_smem_bytes(int H, int L) {
  return size_t(TiledLayout<Fmt>(H, L).total) * sizeof(float);
}

// (matrix, ld, N, K) of w_enc [H, I], w_mu / w_logvar [L, H], w_dec1 [H, L], w_dec2 [I, H].
template <typename T>
std::array<std::tuple<const T*, int, int, int>, 5> weight_shapes(const Args<T>& a) {
  return {{{a.w_enc, a.I, a.H, a.I}, {a.w_mu, a.H, a.L, a.H}, {a.w_lv, a.H, a.L, a.H},
           {a.w_d1, a.L, a.H, a.L}, {a.w_d2, a.H, a.I, a.H}}};
}

template <class Fmt>
void run_tiled_kernel(const Args<typename Fmt::In>& a, const TiledWeights<Fmt>& w, size_t smem,
                      cudaStream_t stream) {
  const int64_t tiles = (int64_t(a.B) + kTileRows - 1) / kTileRows;
  vae_elbo_tiled_kernel<Fmt><<<unsigned(tiles), kThreads, smem, stream>>>(a, w);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
}

}  // namespace

// One CTA per SM anyway (64 rows), so the tile may use up to the device's
// opt-in maximum: at I = 784, H = 256 that is L <= 72 on an H200 (227 KB).
bool tiled_applies(const Launch& l) {
  const Args<float>& a = l.a;
  return l.f32 && l.c.B >= kTiledMinBatch && cuda::compute_capability_major() >= 8 && a.H % 8 == 0 &&
         a.H <= kWarps * 32 && tiled_smem_bytes<Tf32x3>(a.H, a.L) <= cuda::max_shared_memory_per_block();
}

// Packs the weights (one launch), then runs the tiled kernel.
void launch_tiled(const Launch& l) {
  const Args<float>& a = l.a;
  const Tensor& like = l.c.x;  // the workspace's device
  const size_t smem = tiled_smem_bytes<Tf32x3>(a.H, a.L);
  cuda::allow_dynamic_smem(vae_elbo_tiled_kernel<Tf32x3>, smem);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  auto steps = [](int k) { return (k + 7) / 8; };
  auto packed_steps = [&](int k) { return steps(k) + kDepth<Tf32x3> - 1; };  // zero k-steps for the look-ahead
  const auto mats = weight_shapes(a);
  int64_t total = 0;
  for (const auto& [m, ld, N, K] : mats) total += cuda::b_fragment_size(N, packed_steps(K), true);
  Tensor packed = empty_like_device(like, {total});
  float* out = mdata<float>(packed);
  cuda::BFragmentsBatch batch{};
  PackedWeight<Tf32x3> pw[5];
  for (int i = 0; i < 5; ++i) {
    const auto& [m, ld, N, K] = mats[i];
    const int tiles = (N + 7) / 8;
    batch.m[i] = {m, ld, N, K, packed_steps(K), tiles, out, /*split=*/true};  // one pass: all tiles
    pw[i] = {reinterpret_cast<const float4*>(out), tiles, steps(K)};
    out += cuda::b_fragment_size(N, packed_steps(K), true);
  }
  cuda::pack_b_fragments(stream, batch, 5);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  run_tiled_kernel<Tf32x3>(a, {pw[0], pw[1], pw[2], pw[3], pw[4]}, smem, stream);
}

// The same kernel on bfloat16 operands: H % 16 == 0 (whole 16-wide k-steps
// over h and the decoder hidden layer), the tile's shared memory within the
// device's opt-in maximum (about half the float32 tile's: 784-256-32 needs
// 68 KB).
bool tiled_bf16_applies(const Launch& l) {
  const Args<__nv_bfloat16>& a = l.ab;
  return l.bf16 && l.c.B >= kTiledMinBatch && cuda::compute_capability_major() >= 8 && a.H % 16 == 0 &&
         a.H <= kWarps * 32 && tiled_smem_bytes<Bf16>(a.H, a.L) <= cuda::max_shared_memory_per_block();
}

// Packs the bfloat16 weights (one launch), then runs the tiled kernel.
void launch_tiled_bf16(const Launch& l) {
  const Args<__nv_bfloat16>& a = l.ab;
  const Tensor& like = l.c.x;  // bfloat16: the workspace holds two elements per 32-bit word
  const size_t smem = tiled_smem_bytes<Bf16>(a.H, a.L);
  cuda::allow_dynamic_smem(vae_elbo_tiled_kernel<Bf16>, smem);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  auto steps = [](int k) { return (k + 15) / 16; };
  auto packed_steps = [&](int k) { return steps(k) + kDepth<Bf16> - 1; };  // zero k-steps for the look-ahead
  const auto mats = weight_shapes(a);
  int64_t total = 0;  // uint2 fragments
  for (const auto& [m, ld, N, K] : mats) total += cuda::b_fragment_bf16_size(N, packed_steps(K));
  Tensor packed = empty_like_device(like, {4 * total});  // 8 bytes per fragment
  uint2* out = reinterpret_cast<uint2*>(mdata<__nv_bfloat16>(packed));
  cuda::BFragmentsBf16Batch batch{};
  PackedWeight<Bf16> pw[5];
  for (int i = 0; i < 5; ++i) {
    const auto& [m, ld, N, K] = mats[i];
    batch.m[i] = {reinterpret_cast<const uint16_t*>(m), ld, N, K, packed_steps(K), out};
    pw[i] = {out, (N + 7) / 8, steps(K)};
    out += cuda::b_fragment_bf16_size(N, packed_steps(K));
  }
  cuda::pack_b_fragments_bf16(stream, batch, 5);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  run_tiled_kernel<Bf16>(a, {pw[0], pw[1], pw[2], pw[3], pw[4]}, smem, stream);
}

}  // namespace vae_elbo_kernels
}  // namespace fused_ops
