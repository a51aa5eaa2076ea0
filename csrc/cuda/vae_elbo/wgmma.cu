// \brief wgmma path of fused_ops::vae_elbo: large float32 batches on
// sm_90a (H100 / H200), 3xTF32 warpgroup tensor-core products.
//
// Chosen for float32, B >= kTiledMinBatch, H == 256, L <= 32, any I, on a
// compute capability 9.0 device with the sm_90a code built (FUSED_OPS_SM90A,
// setup.py).  The large benchmark size (B=8192, 784-256-32) runs here; the
// tiled path (tiled.cu) covers the rest of the large batches.
//
// The tiled path's work (one CTA per 64 samples, the whole pass on chip,
// 3xTF32 products) with Hopper's warpgroup products: two warpgroups each
// own half of a layer's output columns, both A (the activations, split into
// big and small planes by the threads) and B (the weights, packed split in
// the operand layout of wgmma.cuh once per call, by one extra launch before
// the kernel) are read by the tensor cores straight from shared memory, and
// the weights arrive by bulk copies (one thread issues them) through a
// three-stage ring of chunks of four k-steps, each stage completing on its
// own mbarrier (the ring, the packer and the chunk loop are
// cuda/primitives/wgmma_stream.cuh's, shared with the flow kernel).  Chunk c + 1's
// products are issued before chunk c's are waited for; meanwhile the
// threads load the x chunk after next (encoder); after chunk c the threads
// meet at one block barrier (its stage and x buffer are free again) and
// refill the stage.
//
// Accuracy: each chunk's products go into a fresh accumulator, added to
// the layer's running sums with ordinary float32 adds.  The tensor cores'
// own accumulation is not float32 round-to-nearest: with the whole K summed
// in the wgmma accumulators the outputs land an order of magnitude further
// from a float64 reference than the float32 reference does, with per-chunk
// sums (32 k) within the 2x the contract allows (docs/vae_elbo.md).  Two
// fresh accumulators alternate, so the adds of one chunk overlap the next
// chunk's products (cuda::wgs::add_chunks).
//
// Shape: H == 256 (the encoder and the decoder's hidden layer are one m64n128
// product per warpgroup), 1 <= L <= 32 (mu | logvar: n32 per warpgroup, the
// latent padded to 32 columns), any I (K padded with zeros to whole chunks;
// the decoder's logits in passes of 128 columns, then passes of 16).  The
// weights stream from L2 once per CTA.
//
// vae_elbo_train's wgmma path is this kernel with kSave: each activation is
// also stored to global memory where it is formed (h and g from the
// hidden-layer epilogue, mu / logvar / z from the head's, the logits from
// the BCE epilogue), B (2H + 3L + I) floats, for a backward that then needs
// no forward products.

#include <algorithm>
#include <type_traits>

#include "common/bce.h"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/wgmma_stream.cuh"
#include "cuda/vae_elbo/paths.cuh"

namespace fused_ops {
namespace vae_elbo_kernels {
namespace {

namespace wg {

using cuda::wgs::chunk_floats;
using cuda::wgs::kBlock;
using cuda::wgs::kKChunk;
using cuda::wgs::kS;
using cuda::wgs::kStages;

constexpr int kThreadsWg = 256;  // two warpgroups
constexpr int kRowsWg = 64;      // samples per CTA: the wgmma M
constexpr int kH = 256;
constexpr int kLp = 32;
constexpr int kPass = 128;      // decoder columns per full pass (64 per warpgroup)
constexpr int kTailPass = 16;   // ... per tail pass (8 per warpgroup)
constexpr int kDecChunks = kH / kKChunk;
// A tail pass's K chunks (4 KB each) travel together in one 32 KB ring
// chunk (add_chunks' kSub), as a full pass's chunks do one by one: eight
// 4 KB copies three at a time left its products waiting on L2 latency.
constexpr int kSubTail = kDecChunks;
static_assert(kSubTail * chunk_floats(kTailPass) == chunk_floats(kPass), "a tail pass fills one ring stage");

// Sizes in floats (kBlock: a 64-row operand's k-step block; chunk_floats:
// a chunk of packed weights, cuda/primitives/wgmma_stream.cuh).
constexpr int kXChunk = 2 * kS * kBlock;   // x: 64 rows x 32 columns, two planes
constexpr int kHPlane = kH / 8 * kBlock;   // one plane of h or g (64 x 256)
constexpr int kZPlane = kLp / 8 * kBlock;  // one plane of z (64 x 32)
constexpr int kMsLd = kLp + 1;

// Shared memory, in floats, phase by phase (every phase ends with a block
// barrier, after which its regions are free):
//   encoder   ring of 3 x 64 KB weight chunks at 0, two x chunks at kXs
//   mu|logvar h at 0 (both planes), ring of 3 x 32 KB at kRingM (over the
//             x chunks; two 16 KB K chunks to a stage), then, its products
//             done, logvar handed from warpgroup 1 to 0 at kMs and z at kZ
//             (inside that ring, above decoder 2's first stage)
//   decoder 1 its one weight chunk (L <= 32) at 0, z; g written over h
//   decoder 2 g at 0, ring of 3 x 32 KB at kRingD2
//   all       BCE partial sums, KL row sums, the stages' mbarriers at kMisc
// Each phase's first weight chunks are issued as soon as their stages are
// free: mu|logvar's when the encoder's products end, decoder 1's chunk and
// decoder 2's first when the mu|logvar products end.
constexpr int kXs = kStages * chunk_floats(kH);
constexpr int kRingM = 2 * kHPlane;
constexpr int kSubM = 2;                                // mu|logvar K chunks per ring chunk
constexpr int kStageM = kSubM * chunk_floats(2 * kLp);  // 32 KB
constexpr int kMs = kRingM + chunk_floats(kPass);       // above decoder 2's first stage
constexpr int kZ = kMs + (kRowsWg * kMsLd + 3) / 4 * 4;  // 16-byte aligned
constexpr int kRingD2 = 2 * kHPlane;
constexpr int kMisc = kXs + 2 * kXChunk;
constexpr int kWpart = kMisc, kKlrow = kWpart + 2 * kRowsWg, kBars = kKlrow + kRowsWg;
constexpr size_t kSmemBytes = sizeof(float) * kBars + kStages * sizeof(uint64_t);
static_assert(kZ + 2 * kZPlane <= kMisc && kRingD2 + kStages * chunk_floats(kPass) <= kMisc, "phase regions");
static_assert(kRingM >= 2 * kHPlane && kRingM + kStages * kStageM <= kMisc && kDecChunks % kSubM == 0,
              "mu|logvar's ring between h and the misc region");
static_assert(kRingD2 + chunk_floats(kPass) <= kMs && chunk_floats(kH) <= kHPlane,
              "decoder 1's chunk and decoder 2's first stage clear of ms and z");
static_assert(kBars % 2 == 0, "mbarriers are 8-byte aligned");

// The weights packed by cuda::wgs::pack_core: encoder, mu|logvar, decoder 1,
// decoder 2's full passes, its tail passes.
constexpr int kPacks = 5;
static_assert(kPacks <= cuda::wgs::kMaxPacks, "one packer launch");

// Where vae_elbo_train's activations go: the sections of its `saved` output
// (VaeSavedLayout); all null for vae_elbo.
struct Saved {
  float *h = nullptr, *ml = nullptr, *z = nullptr, *g = nullptr, *logits = nullptr;
};

inline Saved saved_sections(const VaeElboTrainCall* train) {
  if (!train) return {};
  const VaeSavedLayout lay(train->B, train->I, train->H, train->L);
  float* s = mdata<float>(train->saved);
  return Saved{s + lay.h, s + lay.ml, s + lay.z, s + lay.g, s + lay.logits};
}

struct WgWeights {
  const float *enc, *mulv, *d1, *d2, *d2_tail;
  int enc_chunks, full_passes, tail_passes;
};

// kSave (vae_elbo_train): also stores h, mu | logvar, z, g and the logits
// (with their bias) into s, the values the products and terms use; the
// losses are the same (the stores change no arithmetic).
template <bool kSave>
__global__ void __launch_bounds__(kThreadsWg, 1)
    vae_elbo_wgmma_kernel(const Args<float> a, const WgWeights w, const Saved s) {
#if defined(FUSED_OPS_WGMMA)
  using cuda::wgs::add_chunks;
  using cuda::wgs::ChunkStream;
  using cuda::wgs::for_each_pair;
  using cuda::wgs::store_split_pair;
  using cuda::wgs::zero;
  extern __shared__ __align__(128) float smem[];
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + kBars);
  const int tid = int(threadIdx.x), wgi = tid / 128, lane = tid % cuda::kWarpSize;
  const int row0 = int(blockIdx.x) * kRowsWg, rows = min(kRowsWg, a.B - row0);
  const int I = a.I, L = a.L;
  cuda::wgs::init_ring_barriers(bars);
  __syncthreads();
  // Stores relu(acc + bias) of this warpgroup's 128 columns as the next
  // A operand (split, over h's place) and publishes it to the tensor cores;
  // kSave: also into `save` [B, H].
  auto store_hidden = [&](const float(&acc)[kH / 4], const float* bias, float* save) {
    for_each_pair<kH / 2>(acc, [&](int r, int, int c, float v0, float v1) {
      const int n = wgi * (kH / 2) + c;
      const float h0 = relu(v0 + __ldg(bias + n)), h1 = relu(v1 + __ldg(bias + n + 1));
      store_split_pair(smem, kHPlane, r, n, h0, h1);
      if constexpr (kSave) {
        if (r < rows) {
          float* at = save + int64_t(row0 + r) * kH + n;
          at[0] = h0;
          at[1] = h1;
        }
      }
    });
    cuda::fence_proxy_async();
    __syncthreads();
  };

  // 1. Encoder: h = relu(x W_enc^T + b_enc).  x chunks (64 rows x 32
  //    columns) are loaded, split and stored by all threads, one chunk ahead
  //    of the products; a quarter warp's eight float4 stores cover eight rows
  //    of one core matrix column (conflict-free).
  float hacc[kH / 4];  // this warpgroup's 128 columns
  // Phase 2's weight stream: its first chunks are issued when the encoder's
  // products end (below).
  const ChunkStream mulv_stream{w.mulv, kStageM, kDecChunks / kSubM, nullptr, 0, 0,
                                smem + kRingM, kStageM, kStages, w.enc_chunks};
  {
    const ChunkStream st{w.enc, chunk_floats(kH), w.enc_chunks, nullptr, 0, 0, smem, chunk_floats(kH), kStages, 0};
    st.prologue(bars);
    float xv[2][4];
    auto load_x = [&](int c) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int f = tid + kThreadsWg * j, r = (f / 64) * 8 + f % 8, col = c * kKChunk + 4 * (f / 8 % 8);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          xv[j][e] = (r < rows && col + e < I) ? __ldg(a.x + int64_t(row0 + r) * I + col + e) : 0.0f;
        }
      }
    };
    auto store_x = [&](int buf) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int f = tid + kThreadsWg * j, r = (f / 64) * 8 + f % 8, kq = f / 8 % 8;
        float* at = smem + kXs + buf * kXChunk + (kq / 2) * kBlock + cuda::core_offset(r, (kq % 2) * 4);
        cuda::SplitTf32 s[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) s[e] = cuda::split_tf32(xv[j][e]);
        *reinterpret_cast<float4*>(at) = make_float4(__uint_as_float(s[0].big), __uint_as_float(s[1].big),
                                                     __uint_as_float(s[2].big), __uint_as_float(s[3].big));
        *reinterpret_cast<float4*>(at + kS * kBlock) =
            make_float4(__uint_as_float(s[0].small), __uint_as_float(s[1].small), __uint_as_float(s[2].small),
                        __uint_as_float(s[3].small));
      }
    };
    // x chunks 0 and 1 first; chunk c + 2 is loaded while chunks c and c + 1
    // are in the tensor cores and stored over chunk c's buffer once every
    // warpgroup is done with it (a block barrier after the stores, as the
    // next products read rows of every thread).
    const int chunks = st.total();
    load_x(0);
    store_x(0);
    if (chunks > 1) {
      load_x(1);
      store_x(1);
    }
    cuda::fence_proxy_async();
    __syncthreads();
    zero(hacc);
    add_chunks<kH / 2>(
        hacc, st, 0, chunks, [&](int c) { return smem + kXs + (c % 2) * kXChunk; }, kS * kBlock, bars,
        [&](int c) {
          if (c + 2 < chunks) load_x(c + 2);
        },
        [&](int c) {
          if (c + 2 < chunks) {
            store_x(c % 2);
            cuda::fence_proxy_async();
            __syncthreads();
          }
        });
    // Every chunk has been consumed (the last release's barrier): h may
    // overwrite the ring, and phase 2's first chunks (their ring above h,
    // over the x chunks) travel while h is stored.
    mulv_stream.prologue(bars);
    store_hidden(hacc, a.b_enc, s.h);
  }

  // 2. mu (warpgroup 0) and logvar (warpgroup 1), 32 padded columns each;
  //    then z and the KL terms in warpgroup 0.
  float* const klrow = smem + kKlrow;
  // The decoder's weight streams (phases 3 and 4), whose first chunks are
  // issued at the end of phase 2's products (below).
  const ChunkStream d1_stream{w.d1, chunk_floats(kH), 1, nullptr, 0, 0, smem, chunk_floats(kH), 1,
                              w.enc_chunks + kDecChunks / kSubM};
  const ChunkStream d2_stream{w.d2, chunk_floats(kPass), w.full_passes * kDecChunks,
                              w.d2_tail, chunk_floats(kPass), w.tail_passes,
                              smem + kRingD2, chunk_floats(kPass), kStages,
                              w.enc_chunks + kDecChunks / kSubM + 1};
  {
    const ChunkStream& st = mulv_stream;
    // macc[i]: row rb + 8 ((i / 2) % 2), column lb + 8 (i / 4) + i % 2
    // (for_each_pair's layout).  Warpgroup 0's global loads for the z / KL
    // epilogue (eps, b_mu) are issued before the products, so their latency
    // hides behind them (loaded next to each term, every load stalled the
    // warp: see the decoder passes below).
    const int rb = 16 * (tid / 32 % 4) + lane / 4, lb = 2 * (lane % 4);
    float ep[kLp / 2], bmu[kLp / 4];
    if (wgi == 0) {
#pragma unroll
      for (int i = 0; i < kLp / 2; ++i) {
        const int r = rb + 8 * ((i / 2) % 2), l = lb + 8 * (i / 4) + i % 2;
        ep[i] = (r < rows && l < L) ? __ldg(a.eps + int64_t(row0 + r) * L + l) : 0.0f;
        if ((i / 2) % 2 == 0) bmu[i / 4 * 2 + i % 2] = l < L ? __ldg(a.b_mu + l) : 0.0f;
      }
    }
    float macc[kLp / 2];
    zero(macc);
    add_chunks<kLp, kSubM>(macc, st, 0, kDecChunks, smem, kHPlane, bars);
    // h and this phase's ring are free now (add_chunks' last release is a
    // block barrier after every warpgroup's products), so decoder 1's chunk
    // (over h's big plane) and decoder 2's first (its ring's stage 0, below
    // ms and z) travel during the z / KL epilogue instead of after it.
    // Their mbarriers' previous phases were this phase's ring chunks 1 and
    // 2, consumed; decoder 2's chunks 1 and 2 wait for phase 4 (stage 1
    // holds ms and z, and chunk 2's mbarrier is decoder 1's).
    if (tid == 0) {
      d1_stream.issue(0, bars);
      d2_stream.issue(0, bars);
    }
    float* const ms = smem + kMs;
    if (wgi == 1) {
      for_each_pair<kLp>(macc, [&](int r, int, int l, float v0, float v1) {
        const float lv0 = l < L ? v0 + __ldg(a.b_lv + l) : 0.0f;
        const float lv1 = l + 1 < L ? v1 + __ldg(a.b_lv + l + 1) : 0.0f;
        ms[r * kMsLd + l] = lv0;
        ms[r * kMsLd + l + 1] = lv1;
        if constexpr (kSave) {
          float* at = s.ml + int64_t(row0 + r) * 2 * L + L + l;  // logvar: ml's columns L..2L
          if (r < rows && l < L) at[0] = lv0;
          if (r < rows && l + 1 < L) at[1] = lv1;
        }
      });
    }
    __syncthreads();
    if (wgi == 0) {
      float kl[2] = {0.0f, 0.0f};  // rows g and g + 8 of this warp
#pragma unroll
      for (int i = 0; i < kLp / 2; i += 2) {  // column pairs in for_each_pair's order
        const int h = (i / 2) % 2, r = rb + 8 * h, l = lb + 8 * (i / 4);
        float zz[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          zz[e] = 0.0f;
          if (l + e < L) {
            const float mu = macc[i + e] + bmu[i / 4 * 2 + e], lv = ms[r * kMsLd + l + e];
            zz[e] = mu + expf(0.5f * lv) * ep[i + e];
            kl[h] += ((1.0f + lv) - mu * mu) - expf(lv);  // the reference's order
            if constexpr (kSave) {
              if (r < rows) {
                s.ml[int64_t(row0 + r) * 2 * L + l + e] = mu;
                s.z[int64_t(row0 + r) * L + l + e] = zz[e];
              }
            }
          }
        }
        store_split_pair(smem + kZ, kZPlane, r, l, zz[0], zz[1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = kl[h];
        v += __shfl_xor_sync(cuda::kFullMask, v, 1);
        v += __shfl_xor_sync(cuda::kFullMask, v, 2);
        if (lane % 4 == 0) klrow[16 * (tid / 32 % 4) + lane / 4 + 8 * h] = v;
      }
    }
    cuda::fence_proxy_async();
    __syncthreads();
  }

  // 3. Decoder hidden layer g = relu(z W_dec1^T + b_dec1) over h's place
  //    (after every warpgroup's products: the chunk sits there too).
  {
    cuda::wgs::chunk_products<kH / 2>(hacc, d1_stream, 0, smem + kZ, kZPlane, bars);
    cuda::wgmma_wait<0>();
    __syncthreads();
    store_hidden(hacc, a.b_d1, s.g);
  }

  // 4. Decoder logits into BCE sums, pass by pass: 128 columns (64 per
  //    warpgroup), then 16 (8 per warpgroup).  rsum[h]: rows g + 8 h of this
  //    warp, terms added in a fixed order.
  float rsum[2] = {0.0f, 0.0f};
  {
    const ChunkStream& st = d2_stream;
    st.prologue(bars, 1);  // (chunk 0 issued in phase 2)
    // One decoder pass of NP columns (NP / 2 per warpgroup) from column n0.
    // The epilogue loads its x and b_dec2 values for all of this thread's
    // logits first (0 where masked), then adds the BCE terms in
    // for_each_pair's order: loaded next to each term, every load's L2
    // latency would stall the warp (the branches inside each term's exp /
    // log kept the compiler from hoisting them).  The terms are branch-free
    // (common/bce.h) and masked by a select, so the compiler interleaves
    // them.
    int q = 0;
    auto decoder_pass = [&](auto np, int n0) {
      constexpr int NP = decltype(np)::value;
      float dacc[NP / 4];
      zero(dacc);
      constexpr int kSub = NP == kTailPass ? kSubTail : 1;
      add_chunks<NP / 2, kSub>(dacc, st, q, kDecChunks, smem, kHPlane, bars);
      q += kDecChunks / kSub;
      // dacc[i]: row r0 + 8 ((i / 2) % 2), column n0 + 8 (i / 4) + i % 2 (for_each_pair).
      const int r0 = 16 * (tid / 32 % 4) + lane / 4;
      n0 += wgi * (NP / 2) + 2 * (lane % 4);
      float xin[NP / 4], bias[NP / 8];  // bias: one per column (rows r0 and r0 + 8 share it)
#pragma unroll
      for (int i = 0; i < NP / 4; ++i) {
        const int r = r0 + 8 * ((i / 2) % 2), n = n0 + 8 * (i / 4) + i % 2;
        xin[i] = (r < rows && n < I) ? __ldg(a.x + int64_t(row0 + r) * I + n) : 0.0f;
        if ((i / 2) % 2 == 0) bias[i / 4 * 2 + i % 2] = n < I ? __ldg(a.b_d2 + n) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < NP / 4; ++i) {
        const int r = r0 + 8 * ((i / 2) % 2), n = n0 + 8 * (i / 4) + i % 2;
        const float logit = dacc[i] + bias[i / 4 * 2 + i % 2];
        const float t = bce_term_or_nan(logit, xin[i]);
        rsum[(i / 2) % 2] += (r < rows && n < I) ? t : 0.0f;  // a select: the terms interleave
        if constexpr (kSave) {
          if (r < rows && n < I) s.logits[int64_t(row0 + r) * I + n] = logit;
        }
      }
    };
    for (int p = 0; p < w.full_passes; ++p) decoder_pass(std::integral_constant<int, kPass>{}, p * kPass);
    for (int p = 0; p < w.tail_passes; ++p) {
      decoder_pass(std::integral_constant<int, kTailPass>{}, w.full_passes * kPass + p * kTailPass);
    }
  }
  float* const wpart = smem + kWpart;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v = rsum[h];
    v += __shfl_xor_sync(cuda::kFullMask, v, 1);
    v += __shfl_xor_sync(cuda::kFullMask, v, 2);
    if (lane % 4 == 0) wpart[wgi * kRowsWg + 16 * (tid / 32 % 4) + lane / 4 + 8 * h] = v;
  }
  __syncthreads();
  if (tid < rows) store_losses(a, row0 + tid, wpart[tid] + wpart[kRowsWg + tid], klrow[tid]);
  cuda::wgs::inval_ring_barriers(bars);
#else
  __trap();  // launched only where the sm_90a code was built (FUSED_OPS_SM90A)
#endif
}

}  // namespace wg

}  // namespace

bool wgmma_applies(const Launch& l) {
#if defined(FUSED_OPS_SM90A)
  return l.f32 && l.c.B >= kTiledMinBatch && l.a.H == wg::kH && l.a.L <= wg::kLp &&
         cuda::wgs::device_runs_sm90a() && wg::kSmemBytes <= cuda::max_shared_memory_per_block();
#else
  (void)l;
  return false;
#endif
}

// Packs the weights (one launch), then runs the wgmma kernel.
void launch_wgmma(const Launch& l) {
#if defined(FUSED_OPS_SM90A)
  const Args<float>& a = l.a;
  const Tensor& like = l.c.x;  // the workspace's device
  const wg::Saved saved = wg::saved_sections(l.train);
  const bool save = saved.h != nullptr;
  const auto kernel = save ? wg::vae_elbo_wgmma_kernel<true> : wg::vae_elbo_wgmma_kernel<false>;
  cuda::allow_dynamic_smem(kernel, wg::kSmemBytes);
  const cudaStream_t stream = cuda::current_stream(cuda::current_device());
  const int enc_chunks = (a.I + wg::kKChunk - 1) / wg::kKChunk;
  const int full = a.I / wg::kPass, tail = (a.I - full * wg::kPass + wg::kTailPass - 1) / wg::kTailPass;
  using cuda::wgs::CorePack;
  // (w0, w1, ld, rows, K, np, n_start, passes, kchunks)
  CorePack packs[wg::kPacks] = {
      {a.w_enc, nullptr, a.I, a.H, a.I, wg::kH, 0, 1, enc_chunks, nullptr},
      {a.w_mu, a.w_lv, a.H, a.L, a.H, 2 * wg::kLp, 0, 1, wg::kDecChunks, nullptr},
      {a.w_d1, nullptr, a.L, a.H, a.L, wg::kH, 0, 1, 1, nullptr},
      {a.w_d2, nullptr, a.H, a.I, a.H, wg::kPass, 0, full, wg::kDecChunks, nullptr},
      {a.w_d2, nullptr, a.H, a.I, a.H, wg::kTailPass, full * wg::kPass, tail, wg::kDecChunks, nullptr}};
  int64_t total = 0;
  for (const CorePack& p : packs) total += p.size();
  Tensor packed = empty_like_device(like, {std::max<int64_t>(total, 1)});
  float* out = mdata<float>(packed);
  cuda::wgs::CorePackBatch batch{};
  for (int i = 0; i < wg::kPacks; ++i) {
    packs[i].out = out;
    out += packs[i].size();
    batch.p[i] = packs[i];
  }
  cuda::wgs::pack_core(stream, batch, wg::kPacks);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
  const wg::WgWeights w{packs[0].out, packs[1].out, packs[2].out, packs[3].out, packs[4].out,
                        enc_chunks, full, tail};
  const int64_t tiles = (int64_t(a.B) + wg::kRowsWg - 1) / wg::kRowsWg;
  kernel<<<unsigned(tiles), wg::kThreadsWg, wg::kSmemBytes, stream>>>(a, w, saved);
  FUSED_OPS_CUDA_LAUNCH_CHECK();
#else
  (void)l;
#endif
}

}  // namespace vae_elbo_kernels
}  // namespace fused_ops
