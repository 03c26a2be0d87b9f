// Attention over packed segments on tensor cores, for bf16 heads of 64 and 128 (Qwen2.5-0.5B and
// SmolLM2; Qwen2.5 from 1.5B, Qwen3, Llama 3): the products S = Q Kᵀ, O = P V and the
// backward's dP, dV, dK and dQ run as 16 x 16 x 16 bf16 matrix multiply-accumulates with f32
// sums (WMMA); the softmax, its log-sum-exp, the mask and dS = P (dP - delta) run in f32 on the
// staged f32 scores. The rule, the inputs and the outputs are attention.cu's; P and dS are
// rounded to bf16 for their products, as FlashAttention rounds them. dK and dV come in two
// launches: each query head's share in f32, then the shares of each kv head's group added in
// order (`attn_tc_kv_sum`).
//
// Staged tiles are rows of D bf16 at a stride of LD = D + 8 (WMMA wants a multiple of 8; the
// extra 16 bytes move consecutive rows off the same shared-memory banks). Every warp owns 16 rows
// of a tile; lane pairs (lane / 2) own one row each of the warp's f32 scores for the scalar work.
// The tiles live in dynamic shared memory (up to 72 KB a block at D = 128, past the 48 KB of
// static shared memory): `attn_tc_shared_bytes` reports each kernel's need, and the host sets
// the kernel's limit to it before launching.

#include "common.cuh"

#ifndef SLUICE_CUDA_EMU
#include <mma.h>
#endif

using namespace nvcuda;

namespace tc {
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
// A right-hand operand staged transposed (its columns are the tile's rows).
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// `rows` slots of one head of a (N, stride) tensor from slot `slot0` into `dst`, zeros past
// `valid`: 16 bytes (8 values) a load where every row of the head starts on a 16-byte boundary
// (the staged rows always do: LD * 2 bytes is a multiple of 16), one value a load otherwise.
template <unsigned D, unsigned LD = D + 8>
__device__ __forceinline__ void stage(bf16 (*dst)[LD], const bf16* src, u64 slot0, unsigned valid,
                                      unsigned rows, unsigned stride, unsigned col0) {
  constexpr unsigned V = 8, PER_ROW = D / V;
  const u64 at = (u64)(const void*)(src + col0) | ((u64)stride * sizeof(bf16));
  if (at % 16 == 0) {
    for (unsigned e = threadIdx.x; e < rows * PER_ROW; e += blockDim.x) {
      const unsigned r = e / PER_ROW, c = (e % PER_ROW) * V;
      uint4 v = make_uint4(0, 0, 0, 0);  // bf16 zeros past `valid`
      if (r < valid) v = *reinterpret_cast<const uint4*>(src + (slot0 + r) * stride + col0 + c);
      *reinterpret_cast<uint4*>(&dst[r][c]) = v;
    }
    return;
  }
  for (unsigned e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const unsigned r = e / D, c = e % D;
    dst[r][c] = r < valid ? src[(slot0 + r) * stride + col0 + c] : __float2bfloat16(0.0f);
  }
}

// out (16 x 16 NT, f32, row stride ldo) = a (16 x D) times the transpose of bt's 16 NT rows.
template <unsigned D, unsigned NT, unsigned LD = D + 8>
__device__ __forceinline__ void product_t(float* out, unsigned ldo, const bf16* a, const bf16* bt) {
  for (unsigned n = 0; n < NT; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (unsigned k = 0; k < D / 16; ++k) {
      FragA fa;
      FragBt fb;
      wmma::load_matrix_sync(fa, a + k * 16, LD);
      wmma::load_matrix_sync(fb, bt + n * 16 * LD + k * 16, LD);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, ldo, wmma::mem_row_major);
  }
}

// acc[0..D/16) (16 x D) += a (16 x 16 KT, row stride lda) times b (16 KT x D, row stride LD):
// D columns of a tile of rows of LD, e.g. 64 of a staged tile's wider rows.
template <unsigned D, unsigned KT, unsigned LD = D + 8>
__device__ __forceinline__ void accumulate(FragC* acc, const bf16* a, unsigned lda, const bf16* b) {
  for (unsigned k = 0; k < KT; ++k) {
    FragA fa;
    wmma::load_matrix_sync(fa, a + k * 16, lda);
    for (unsigned n = 0; n < D / 16; ++n) {
      FragB fb;
      wmma::load_matrix_sync(fb, b + k * 16 * LD + n * 16, LD);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// Writes a warp's accumulators (16 x D, times `factor`) to rows row0.. of one head of `out`
// (bf16, or f32 partial sums; rows past `valid` are skipped), through the warp's 16 rows of
// `scratch` (f32, stride lds).
template <unsigned D, typename O>
__device__ __forceinline__ void write_rows(FragC* acc, float factor, float* scratch, unsigned lds,
                                           O* out, u64 slot0, unsigned valid, unsigned stride,
                                           unsigned col0) {
  const unsigned lane = threadIdx.x % 32;
  for (unsigned n = 0; n < D / 16; ++n) {
    __syncwarp();
    wmma::store_matrix_sync(scratch, acc[n], lds, wmma::mem_row_major);
    __syncwarp();
    const unsigned r = lane / 2, c0 = (lane % 2) * 8;
    if (r < valid)
      for (unsigned c = c0; c < c0 + 8; ++c)
        st(out, (slot0 + r) * stride + col0 + n * 16 + c, scratch[r * lds + c] * factor);
  }
}

// A block of queries' slot arrays and (for the backward) their log-sum-exps and deltas: where
// they are read from, and the block's staged copies.
struct QuerySource {
  const unsigned *first, *seg, *prefix;
  const float *lse, *delta;
};
struct QueryTiles {
  unsigned *first, *seg, *prefix;
  float *lse, *delta;
};

// `rows` queries' entries from slot `slot0` (slot arrays) and `head0` (lse and delta, when
// given) into `dst`; past `valid` a query sees nothing.
__device__ __forceinline__ void stage_queries(unsigned rows, unsigned valid,
                                              QuerySource src, u64 slot0, u64 head0,
                                              QueryTiles dst) {
  for (unsigned t = threadIdx.x; t < rows; t += blockDim.x) {
    const bool ok = t < valid;
    dst.first[t] = ok ? src.first[slot0 + t] : 0xffffffffu;
    dst.seg[t] = ok ? src.seg[slot0 + t] : 0;
    dst.prefix[t] = ok ? src.prefix[slot0 + t] : 0;
    if (dst.lse) dst.lse[t] = ok ? src.lse[head0 + t] : 0.0f;
    if (dst.delta) dst.delta[t] = ok ? src.delta[head0 + t] : 0.0f;
  }
}

// Each kernel's shared memory: tiles first, every one a multiple of 32 bytes long, so each
// starts 32-byte aligned as WMMA requires.
template <unsigned D, unsigned LD = D + 8>
struct FwdShared {
  bf16 qs[64][LD];
  bf16 ks[64][LD];  // also the P tile, once the scores are formed
  bf16 vs[64][LD];
  float ss[64][68];
  unsigned qfirst[64], qseg[64], qpre[64], kseg[64];
};

template <unsigned D, unsigned LD = D + 8>
struct KvShared {
  bf16 ks[64][LD];
  bf16 vs[64][LD];
  bf16 qs[32][LD];
  bf16 dos[32][LD];
  float ss[64][36];
  bf16 pt[64][40];
  bf16 dst[64][40];
  float qlse[32], qdelta[32];
  unsigned qfirst[32], qseg[32], qpre[32], kseg[64];
};

template <unsigned D, unsigned LD = D + 8>
struct QShared {
  bf16 qs[64][LD];
  bf16 dos[64][LD];
  bf16 ks[32][LD];
  bf16 vs[32][LD];
  float ss[64][36];
  bf16 dss[64][40];
  float qlse[64], qdelta[64];
  unsigned qfirst[64], qseg[64], qpre[64], kseg[32];
};
}  // namespace tc

__device__ __forceinline__ bool sees(unsigned i, unsigned j, unsigned first_i, unsigned seg_i,
                                     unsigned prefix_i, unsigned seg_j, int runs) {
  return j <= i && j >= first_i && (runs || seg_j == seg_i || (prefix_i != 0 && seg_j == prefix_i));
}

// Grid (ceil(L / 64), B * H), 128 threads: 64 queries of one (row, head), in one pass over the
// keys (an online softmax, as FlashAttention-2's forward): per tile, S = Q Kᵀ; each row's
// running max m and sum l; P = exp(S - m) rounded to bf16; then the tile's P V, which the lane
// pair owning a row adds to its share of the row's output (f32, in registers) after scaling
// that by exp(m_old - m). The output is divided by l at the end, and lse = m + ln l.
// (Until 2026-11-30 two passes: the statistics first, then P from the final log-sum-exp, each
// tile's keys staged and multiplied twice.)
template <unsigned D>
__device__ void attn_tc_fwd(const bf16* q, const bf16* k, const bf16* v, const unsigned* seg,
                            const unsigned* prefix, const unsigned* first, const unsigned* tiles,
                            int runs, bf16* o, float* lse, unsigned L, unsigned H, unsigned KV,
                            float scale) {
  using namespace tc;
  constexpr unsigned BQ = 64, BK = 64, LS = BK + 4;
  constexpr unsigned LD = D + 8;
  SLUICE_DYNAMIC_SHARED(smem);
  auto& sh = *reinterpret_cast<FwdShared<D>*>(smem);
  auto& qs = sh.qs;
  auto& ks = sh.ks;
  auto& vs = sh.vs;
  auto& ss = sh.ss;
  auto& qfirst = sh.qfirst;
  auto& qseg = sh.qseg;
  auto& qpre = sh.qpre;
  auto& kseg = sh.kseg;
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned i0 = blockIdx.x * BQ, nq = min(BQ, L - i0);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned r = warp * 16 + lane / 2, c0 = (lane % 2) * 32, i = i0 + r;
  const u64 row0 = (u64)b * L;
  stage<D>(qs, q, row0 + i0, nq, BQ, H * D, h * D);
  stage_queries(BQ, nq, {first, seg, prefix, nullptr, nullptr}, row0 + i0, 0,
                {qfirst, qseg, qpre, nullptr, nullptr});
  __syncthreads();
  unsigned lo = 0xffffffffu;
  for (unsigned t = 0; t < BQ; ++t) lo = min(lo, qfirst[t]);
  const unsigned hi = i0 + nq;
  float m = -INFINITY, l = 0.0f;
  // Row r's output, columns (lane % 2) * 32 + 64 * g + t for t < 32 of each group g of 64.
  constexpr unsigned G = D / 64;
  float out[G][32];
#pragma unroll
  for (unsigned g = 0; g < G; ++g)
#pragma unroll
    for (unsigned t = 0; t < 32; ++t) out[g][t] = 0.0f;
  // Key tiles no query of the block sees are skipped (a shared prompt's later completions skip
  // the earlier ones).
  for (unsigned j0 = lo; j0 < hi; j0 += BK) {
    const unsigned nk = min(BK, hi - j0);
    if (!tiles_meet(tiles, b, L, i0, hi - 1, j0, j0 + nk - 1)) continue;
    __syncthreads();
    stage<D>(ks, k, row0 + j0, nk, BK, KV * D, kh * D);
    stage<D>(vs, v, row0 + j0, nk, BK, KV * D, kh * D);
    for (unsigned t = threadIdx.x; t < BK; t += blockDim.x) kseg[t] = t < nk ? seg[row0 + j0 + t] : 0;
    __syncthreads();
    product_t<D, BK / 16>(&ss[warp * 16][0], LS, &qs[warp * 16][0], &ks[0][0]);
    __syncwarp();
    float mx = -INFINITY;
    for (unsigned c = c0; c < c0 + 32; ++c) {
      const bool ok = c < nk && r < nq && sees(i, j0 + c, qfirst[r], qseg[r], qpre[r], kseg[c], runs);
      const float s = ok ? ss[r][c] * scale : -INFINITY;
      ss[r][c] = s;
      mx = fmaxf(mx, s);
    }
    // Every lane shuffles (a pair's lanes agree on `mn`; rows without a visible key yet keep
    // m = -inf, l = 0 and a zero output).
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float mn = fmaxf(m, mx);
    const float alpha = mn > -INFINITY ? expf(m - mn) : 1.0f;
    __syncthreads();  // every warp is done with the keys: P takes their place
    float sum = 0.0f;
    for (unsigned c = c0; c < c0 + 32; ++c) {
      const float p = mn > -INFINITY ? expf(ss[r][c] - mn) : 0.0f;
      sum += p;
      ks[r][c] = __float2bfloat16(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = mn;
    __syncwarp();
    // The tile's P V, 64 columns at a time through the warp's rows of `ss` (the scores are
    // spent), into the rescaled output (unrolled, so that `out` stays in registers).
#pragma unroll
    for (unsigned g = 0; g < G; ++g) {
      FragC acc[4];
      for (unsigned n = 0; n < 4; ++n) wmma::fill_fragment(acc[n], 0.0f);
      accumulate<64, BK / 16, LD>(acc, &ks[warp * 16][0], LD, &vs[0][g * 64]);
      for (unsigned n = 0; n < 4; ++n)
        wmma::store_matrix_sync(&ss[warp * 16][n * 16], acc[n], LS, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (unsigned t = 0; t < 32; ++t) out[g][t] = out[g][t] * alpha + ss[r][c0 + t];
      __syncwarp();
    }
  }
  if (r < nq) {
    const float inv_l = 1.0f / l;
#pragma unroll
    for (unsigned g = 0; g < G; ++g)
#pragma unroll
      for (unsigned t = 0; t < 32; ++t)
        o[(row0 + i) * H * D + h * D + g * 64 + c0 + t] = __float2bfloat16(out[g][t] * inv_l);
    if (lane % 2 == 0) lse[((u64)b * H + h) * L + i] = m + logf(l);
  }
}

// dK, dV: one query head's share. Grid (ceil(L / 64), B * H), 128 threads: 64 keys of one
// (row, query head)'s kv head, over the queries of that head that see them, 32 at a time; the
// sums go to `dk_part` and `dv_part` (N, H, D, f32), which `attn_tc_kv_sum` adds up per kv head.
// A block per query head, not per kv head: with grouped queries (Qwen2.5-0.5B: 14 heads on 2)
// a block per kv head walked every head of its group in turn, so at 2,048 slots the blocks of
// the first keys ran 7 x 64 query tiles one after another, on a grid of B * 2 * 32 blocks.
template <unsigned D>
__device__ void attn_tc_bwd_kv(const bf16* q, const bf16* k, const bf16* v, const bf16* dout,
                               const float* lse, const float* delta, const unsigned* seg,
                               const unsigned* prefix, const unsigned* first,
                               const unsigned* tiles, int runs, float* dk_part, float* dv_part,
                               unsigned L, unsigned H, unsigned KV, float scale) {
  using namespace tc;
  constexpr unsigned BK = 64, BQ = 32, LS = BQ + 4, LP = BQ + 8;
  SLUICE_DYNAMIC_SHARED(smem);
  auto& sh = *reinterpret_cast<KvShared<D>*>(smem);
  auto& ks = sh.ks;
  auto& vs = sh.vs;
  auto& qs = sh.qs;
  auto& dos = sh.dos;
  auto& ss = sh.ss;
  auto& pt = sh.pt;
  auto& dst = sh.dst;
  auto& qlse = sh.qlse;
  auto& qdelta = sh.qdelta;
  auto& qfirst = sh.qfirst;
  auto& qseg = sh.qseg;
  auto& qpre = sh.qpre;
  auto& kseg = sh.kseg;
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned j0 = blockIdx.x * BK, nk = min(BK, L - j0), jlast = j0 + nk - 1;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned r = warp * 16 + lane / 2, c0 = (lane % 2) * 16, j = j0 + r;
  const u64 row0 = (u64)b * L;
  stage<D>(ks, k, row0 + j0, nk, BK, KV * D, kh * D);
  stage<D>(vs, v, row0 + j0, nk, BK, KV * D, kh * D);
  for (unsigned t = threadIdx.x; t < BK; t += blockDim.x) kseg[t] = t < nk ? seg[row0 + j0 + t] : 0;
  FragC gk[D / 16], gv[D / 16];
  for (unsigned n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(gk[n], 0.0f);
    wmma::fill_fragment(gv[n], 0.0f);
  }
  // The word of the tile mask (common.cuh, `tiles_meet`) that holds this block's key tile, in
  // the row of query tile 0; query tile t's is `mask_words` words on per tile.
  const unsigned mask_words = ((L + 63) / 64 + 31) / 32;
  const unsigned* mask = tiles + (u64)b * ((L + 63) / 64) * mask_words + j0 / 64 / 32;
  for (unsigned i0 = j0; i0 < L; i0 += BQ) {
    const unsigned nq = min(BQ, L - i0);
    // The block's keys are one tile of the mask, and 32 queries from i0 lie in one.
    if (!((mask[(u64)(i0 / 64) * mask_words] >> (j0 / 64 % 32)) & 1u)) continue;
    __syncthreads();
    stage_queries(BQ, nq, {first, seg, prefix, lse, delta}, row0 + i0,
                  ((u64)b * H + h) * L + i0, {qfirst, qseg, qpre, qlse, qdelta});
    __syncthreads();
    unsigned cmin = 0xffffffffu;
    for (unsigned t = 0; t < BQ; ++t) cmin = min(cmin, qfirst[t]);
    if (cmin > jlast) continue;  // the same for every thread: no query here sees these keys
    stage<D>(qs, q, row0 + i0, nq, BQ, H * D, h * D);
    stage<D>(dos, dout, row0 + i0, nq, BQ, H * D, h * D);
    __syncthreads();
    // Sᵀ (keys x queries) = K Qᵀ, then Pᵀ.
    product_t<D, BQ / 16>(&ss[warp * 16][0], LS, &ks[warp * 16][0], &qs[0][0]);
    __syncwarp();
    float p[16];
    for (unsigned c = 0; c < 16; ++c) {
      const unsigned qi = c0 + c;
      const bool ok = qi < nq && r < nk &&
                      sees(i0 + qi, j, qfirst[qi], qseg[qi], qpre[qi], kseg[r], runs);
      p[c] = ok ? expf(ss[r][qi] * scale - qlse[qi]) : 0.0f;
      pt[r][qi] = __float2bfloat16(p[c]);
    }
    __syncwarp();
    // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ (dPᵀ - delta).
    product_t<D, BQ / 16>(&ss[warp * 16][0], LS, &vs[warp * 16][0], &dos[0][0]);
    __syncwarp();
    for (unsigned c = 0; c < 16; ++c) {
      const unsigned qi = c0 + c;
      dst[r][qi] = __float2bfloat16(p[c] * (ss[r][qi] - qdelta[qi]));
    }
    __syncwarp();
    accumulate<D, BQ / 16>(gv, &pt[warp * 16][0], LP, &dos[0][0]);
    accumulate<D, BQ / 16>(gk, &dst[warp * 16][0], LP, &qs[0][0]);
  }
  const unsigned valid = nk > warp * 16 ? nk - warp * 16 : 0;
  const u64 at = row0 + j0 + warp * 16;
  write_rows<D>(gk, scale, &ss[warp * 16][0], LS, dk_part, at, valid, H * D, h * D);
  write_rows<D>(gv, 1.0f, &ss[warp * 16][0], LS, dv_part, at, valid, H * D, h * D);
}

// dK and dV (N, KV * D) from attn_tc_bwd_kv's partial sums (N, H * D, f32): each kv head's
// group of H / KV query heads added in head order, then rounded once, so the result does not
// depend on scheduling. A thread an element, n = N * KV * D.
__device__ void attn_tc_kv_sum(const float* dk_part, const float* dv_part, bf16* dk, bf16* dv,
                               unsigned H, unsigned KV, unsigned D, u64 n) {
  const unsigned g = H / KV;
  GRID_STRIDE(e, n) {
    const u64 slot = e / ((u64)KV * D);
    const unsigned col = (unsigned)(e % ((u64)KV * D)), kh = col / D, d = col % D;
    const u64 at = slot * H * D + (u64)kh * g * D + d;
    float sk = 0.0f, sv = 0.0f;
    for (unsigned gi = 0; gi < g; ++gi) {
      sk += dk_part[at + (u64)gi * D];
      sv += dv_part[at + (u64)gi * D];
    }
    st(dk, e, sk);
    st(dv, e, sv);
  }
}

// dQ. Grid (ceil(L / 64), B * H), 128 threads: 64 queries of one (row, head), over the keys
// they see, 32 at a time.
template <unsigned D>
__device__ void attn_tc_bwd_q(const bf16* q, const bf16* k, const bf16* v, const bf16* dout,
                              const float* lse, const float* delta, const unsigned* seg,
                              const unsigned* prefix, const unsigned* first,
                              const unsigned* tiles, int runs, bf16* dq, unsigned L, unsigned H,
                              unsigned KV, float scale) {
  using namespace tc;
  constexpr unsigned BQ = 64, BK = 32, LS = BK + 4, LP = BK + 8;
  SLUICE_DYNAMIC_SHARED(smem);
  auto& sh = *reinterpret_cast<QShared<D>*>(smem);
  auto& qs = sh.qs;
  auto& dos = sh.dos;
  auto& ks = sh.ks;
  auto& vs = sh.vs;
  auto& ss = sh.ss;
  auto& dss = sh.dss;
  auto& qlse = sh.qlse;
  auto& qdelta = sh.qdelta;
  auto& qfirst = sh.qfirst;
  auto& qseg = sh.qseg;
  auto& qpre = sh.qpre;
  auto& kseg = sh.kseg;
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned i0 = blockIdx.x * BQ, nq = min(BQ, L - i0);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned r = warp * 16 + lane / 2, c0 = (lane % 2) * 16, i = i0 + r;
  const u64 row0 = (u64)b * L;
  stage<D>(qs, q, row0 + i0, nq, BQ, H * D, h * D);
  stage<D>(dos, dout, row0 + i0, nq, BQ, H * D, h * D);
  stage_queries(BQ, nq, {first, seg, prefix, lse, delta}, row0 + i0, ((u64)b * H + h) * L + i0,
                {qfirst, qseg, qpre, qlse, qdelta});
  __syncthreads();
  unsigned lo = 0xffffffffu;
  for (unsigned t = 0; t < BQ; ++t) lo = min(lo, qfirst[t]);
  const unsigned hi = i0 + nq;
  FragC gq[D / 16];
  for (unsigned n = 0; n < D / 16; ++n) wmma::fill_fragment(gq[n], 0.0f);
  for (unsigned j0 = lo; j0 < hi; j0 += BK) {
    const unsigned nk = min(BK, hi - j0);
    if (!tiles_meet(tiles, b, L, i0, hi - 1, j0, j0 + nk - 1)) continue;
    __syncthreads();
    stage<D>(ks, k, row0 + j0, nk, BK, KV * D, kh * D);
    stage<D>(vs, v, row0 + j0, nk, BK, KV * D, kh * D);
    for (unsigned t = threadIdx.x; t < BK; t += blockDim.x) kseg[t] = t < nk ? seg[row0 + j0 + t] : 0;
    __syncthreads();
    product_t<D, BK / 16>(&ss[warp * 16][0], LS, &qs[warp * 16][0], &ks[0][0]);
    __syncwarp();
    float p[16];
    for (unsigned c = 0; c < 16; ++c) {
      const unsigned kj = c0 + c;
      const bool ok = kj < nk && r < nq && sees(i, j0 + kj, qfirst[r], qseg[r], qpre[r], kseg[kj], runs);
      p[c] = ok ? expf(ss[r][kj] * scale - qlse[r]) : 0.0f;
    }
    __syncwarp();
    product_t<D, BK / 16>(&ss[warp * 16][0], LS, &dos[warp * 16][0], &vs[0][0]);
    __syncwarp();
    for (unsigned c = 0; c < 16; ++c) {
      const unsigned kj = c0 + c;
      dss[r][kj] = __float2bfloat16(p[c] * (ss[r][kj] - qdelta[r]));
    }
    __syncwarp();
    accumulate<D, BK / 16>(gq, &dss[warp * 16][0], LP, &ks[0][0]);
  }
  write_rows<D>(gq, scale, &ss[warp * 16][0], LS, dq, row0 + i0 + warp * 16,
             nq > warp * 16 ? nq - warp * 16 : 0, H * D, h * D);
}

// The dK/dV kernel's blocks resident on one SM, as its shared memory allows (KvShared: about 47 KB
// at D = 64): the register budget ptxas is held to (at D = 64, 128 registers a thread, where
// it would otherwise take 130 and fit three blocks).
#define KV_BLOCKS_PER_SM(D) ((D) == 64 ? 4 : 2)
// The forward's, likewise (FwdShared: about 46 KB at D = 64). At D = 128 its rows of output in
// registers take 173 registers, two blocks an SM where the shared memory (71 KB) allows three:
// held to three, ptxas spills 32 bytes, so the bound stays at two there.
#define FWD_BLOCKS_PER_SM(D) ((D) == 64 ? 4 : 2)

#define TENSOR_CORE_ATTENTION(D)                                                                  \
  extern "C" __global__ void __launch_bounds__(128, FWD_BLOCKS_PER_SM(D)) attn_tc_fwd_bf16_##D(  \
      const bf16* q, const bf16* k, const bf16* v, const unsigned* seg, const unsigned* prefix,   \
      const unsigned* first, const unsigned* tiles, int runs, bf16* o, float* lse, unsigned L,    \
      unsigned H, unsigned KV, float scale) {                                                     \
    attn_tc_fwd<D>(q, k, v, seg, prefix, first, tiles, runs, o, lse, L, H, KV, scale);            \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(128, KV_BLOCKS_PER_SM(D)) attn_tc_bwd_kv_bf16_##D( \
      const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,            \
      const float* delta, const unsigned* seg, const unsigned* prefix, const unsigned* first,     \
      const unsigned* tiles, int runs, float* dk_part, float* dv_part, unsigned L, unsigned H,    \
      unsigned KV, float scale) {                                                                 \
    attn_tc_bwd_kv<D>(q, k, v, dout, lse, delta, seg, prefix, first, tiles, runs, dk_part,        \
                      dv_part, L, H, KV, scale);                                                  \
  }                                                                                               \
  extern "C" __global__ void attn_tc_bwd_q_bf16_##D(                                              \
      const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,            \
      const float* delta, const unsigned* seg, const unsigned* prefix, const unsigned* first,     \
      const unsigned* tiles, int runs, bf16* dq, unsigned L, unsigned H, unsigned KV,             \
      float scale) {                                                                              \
    attn_tc_bwd_q<D>(q, k, v, dout, lse, delta, seg, prefix, first, tiles, runs, dq, L, H, KV,    \
                     scale);                                                                      \
  }

TENSOR_CORE_ATTENTION(64)
TENSOR_CORE_ATTENTION(128)

extern "C" __global__ void attn_tc_kv_sum_bf16(const float* dk_part, const float* dv_part,
                                               bf16* dk, bf16* dv, unsigned H, unsigned KV,
                                               unsigned D, u64 n) {
  attn_tc_kv_sum(dk_part, dv_part, dk, dv, H, KV, D, n);
}

// The dynamic shared memory each kernel above takes, in bytes: fwd, bwd_kv, bwd_q at D = 64,
// then at D = 128 (read once by the host, which passes them at launch).
extern "C" __global__ void attn_tc_shared_bytes(unsigned* out) {
  out[0] = sizeof(tc::FwdShared<64>);
  out[1] = sizeof(tc::KvShared<64>);
  out[2] = sizeof(tc::QShared<64>);
  out[3] = sizeof(tc::FwdShared<128>);
  out[4] = sizeof(tc::KvShared<128>);
  out[5] = sizeof(tc::QShared<128>);
}
