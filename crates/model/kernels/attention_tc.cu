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
//
// The scalar work per score is kept short, since it, not the tensor cores, bounds these kernels:
// the scores stay unscaled in shared memory and every exponential is one `ex2.approx` of a
// fused multiply-add (the scale and log2(e) folded into one factor, the statistics kept in base
// 2 inside the kernels); and a lane whose span of keys (or, in the dK/dV pass, of queries) is
// visible whole, by one test of the span's shared segment (`tc::Span`), skips the per-score mask.

#include "attention_tc.cuh"

__device__ __forceinline__ bool sees(unsigned i, unsigned j, unsigned first_i, unsigned seg_i,
                                     unsigned prefix_i, unsigned seg_j, int runs) {
  return j <= i && j >= first_i && (runs || seg_j == seg_i || (prefix_i != 0 && seg_j == prefix_i));
}

// Grid (ceil(L / 64), B * H), 128 threads: 64 queries of one (row, head), in one pass over the
// keys (an online softmax, as FlashAttention-2's forward): per tile, S = Q Kᵀ; each row's
// running max m and sum l; P = exp(S - m) rounded to bf16 (in base 2: m is of the scores times
// scale * log2(e)); then the tile's P V, which the lane
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
  auto& kspan = sh.kspan;
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned i0 = blockIdx.x * BQ, nq = min(BQ, L - i0);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned r = warp * 16 + lane / 2, c0 = (lane % 2) * 32, i = i0 + r;
  const float sl2 = scale * LOG2E;
  const u64 row0 = (u64)b * L;
  stage<D>(qs, q, row0 + i0, nq, BQ, H * D, h * D);
  stage_queries(BQ, nq, {first, seg, prefix, nullptr, nullptr}, row0 + i0, 0,
                {qfirst, qseg, qpre, nullptr, nullptr});
  __syncthreads();
  unsigned lo = 0xffffffffu;
  for (unsigned t = 0; t < BQ; ++t) lo = min(lo, qfirst[t]);
  const unsigned hi = i0 + nq;
  // The row's running max of the scaled scores, in base 2, and its sum of exponentials.
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
    if (threadIdx.x < BK) {  // warps 0 and 1: a half of the tile's keys each
      const unsigned s = threadIdx.x < nk ? seg[row0 + j0 + threadIdx.x] : 0;
      kseg[threadIdx.x] = s;
      const unsigned common = group_common<32>(s);
      if (lane == 0) kspan[warp] = common;
    }
    __syncthreads();
    product_t<D, BK / 16>(&ss[warp * 16][0], LS, &qs[warp * 16][0], &ks[0][0]);
    __syncwarp();
    // The lane's 32 keys, seen whole by its query or masked one by one (to -inf in `ss`).
    const bool whole = r < nq && c0 + 32 <= nk && j0 + c0 + 31 <= i && j0 + c0 >= qfirst[r] &&
                       (runs || span_segment_seen(kspan[lane % 2], qseg[r], qpre[r]));
    float mx = -INFINITY;
    if (whole) {
#pragma unroll
      for (unsigned c = c0; c < c0 + 32; c += 4) {
        const float4 x = ld4(&ss[r][c]);
        mx = fmaxf(mx, fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)));
      }
    } else {
      for (unsigned c = c0; c < c0 + 32; ++c) {
        if (c < nk && r < nq && sees(i, j0 + c, qfirst[r], qseg[r], qpre[r], kseg[c], runs))
          mx = fmaxf(mx, ss[r][c]);
        else
          ss[r][c] = -INFINITY;
      }
    }
    // Every lane shuffles (a pair's lanes agree on `mn`; rows without a visible key yet keep
    // m = -inf, l = 0 and a zero output). The scale is positive, so the scaled max is the max
    // scaled.
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float mn = fmaxf(m, mx * sl2);
    const float alpha = mn > -INFINITY ? exp2_fast(m - mn) : 1.0f;
    __syncthreads();  // every warp is done with the keys: P takes their place
    float sum = 0.0f;
    if (mn > -INFINITY) {
#pragma unroll
      for (unsigned c = c0; c < c0 + 32; c += 4) {
        const float4 x = ld4(&ss[r][c]);
        const float p0 = exp2_fast(fmaf(x.x, sl2, -mn)), p1 = exp2_fast(fmaf(x.y, sl2, -mn));
        const float p2 = exp2_fast(fmaf(x.z, sl2, -mn)), p3 = exp2_fast(fmaf(x.w, sl2, -mn));
        sum += (p0 + p1) + (p2 + p3);
        st2(&ks[r][c], p0, p1);
        st2(&ks[r][c + 2], p2, p3);
      }
    } else {
      for (unsigned c = c0; c < c0 + 32; c += 2) st2(&ks[r][c], 0.0f, 0.0f);
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
      for (unsigned t = 0; t < 32; t += 4) {
        const float4 x = ld4(&ss[r][c0 + t]);
        out[g][t] = out[g][t] * alpha + x.x;
        out[g][t + 1] = out[g][t + 1] * alpha + x.y;
        out[g][t + 2] = out[g][t + 2] * alpha + x.z;
        out[g][t + 3] = out[g][t + 3] * alpha + x.w;
      }
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
    if (lane % 2 == 0) lse[((u64)b * H + h) * L + i] = (m + log2f(l)) * LN2;
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
  auto& qspan = sh.qspan;
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned j0 = blockIdx.x * BK, nk = min(BK, L - j0), jlast = j0 + nk - 1;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned r = warp * 16 + lane / 2, c0 = (lane % 2) * 16, j = j0 + r;
  const float sl2 = scale * LOG2E;
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
    if (warp == 0) {  // the lanes that staged the 32 queries: a half of them each 16
      const unsigned f = group_max<16>(qfirst[lane]), s = group_common<16>(qseg[lane]);
      const unsigned p = group_common<16>(qpre[lane]);
      if (lane % 16 == 0) qspan[lane / 16] = {s, p, f};
    }
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
    // The lane's key against its 16 queries: seen by all of them, or masked one by one.
    const Span span = qspan[lane % 2];
    const bool whole = r < nk && c0 + 16 <= nq && j <= i0 + c0 && span.first <= j &&
                       (runs || (span.seg != NONE && kseg[r] == span.seg) ||
                        (span.pre != NONE && span.pre != 0 && kseg[r] == span.pre));
    float p[16];
    if (whole) {
#pragma unroll
      for (unsigned c = 0; c < 16; c += 4) {
        const float4 x = ld4(&ss[r][c0 + c]);
        p[c] = exp2_fast(fmaf(x.x, sl2, -qlse[c0 + c]));
        p[c + 1] = exp2_fast(fmaf(x.y, sl2, -qlse[c0 + c + 1]));
        p[c + 2] = exp2_fast(fmaf(x.z, sl2, -qlse[c0 + c + 2]));
        p[c + 3] = exp2_fast(fmaf(x.w, sl2, -qlse[c0 + c + 3]));
      }
    } else {
#pragma unroll
      for (unsigned c = 0; c < 16; ++c) {
        const unsigned qi = c0 + c;
        const bool ok = qi < nq && r < nk &&
                        sees(i0 + qi, j, qfirst[qi], qseg[qi], qpre[qi], kseg[r], runs);
        p[c] = ok ? exp2_fast(fmaf(ss[r][qi], sl2, -qlse[qi])) : 0.0f;
      }
    }
#pragma unroll
    for (unsigned c = 0; c < 16; c += 2) st2(&pt[r][c0 + c], p[c], p[c + 1]);
    __syncwarp();
    // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ (dPᵀ - delta).
    product_t<D, BQ / 16>(&ss[warp * 16][0], LS, &vs[warp * 16][0], &dos[0][0]);
    __syncwarp();
#pragma unroll
    for (unsigned c = 0; c < 16; c += 4) {
      const float4 x = ld4(&ss[r][c0 + c]);
      st2(&dst[r][c0 + c], p[c] * (x.x - qdelta[c0 + c]), p[c + 1] * (x.y - qdelta[c0 + c + 1]));
      st2(&dst[r][c0 + c + 2], p[c + 2] * (x.z - qdelta[c0 + c + 2]),
          p[c + 3] * (x.w - qdelta[c0 + c + 3]));
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
  auto& kspan = sh.kspan;
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned i0 = blockIdx.x * BQ, nq = min(BQ, L - i0);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned r = warp * 16 + lane / 2, c0 = (lane % 2) * 16, i = i0 + r;
  const float sl2 = scale * LOG2E;
  const u64 row0 = (u64)b * L;
  stage<D>(qs, q, row0 + i0, nq, BQ, H * D, h * D);
  stage<D>(dos, dout, row0 + i0, nq, BQ, H * D, h * D);
  stage_queries(BQ, nq, {first, seg, prefix, lse, delta}, row0 + i0, ((u64)b * H + h) * L + i0,
                {qfirst, qseg, qpre, qlse, qdelta});
  __syncthreads();
  unsigned lo = 0xffffffffu;
  for (unsigned t = 0; t < BQ; ++t) lo = min(lo, qfirst[t]);
  const unsigned hi = i0 + nq;
  const float lse2 = qlse[r], delta_r = qdelta[r];
  FragC gq[D / 16];
  for (unsigned n = 0; n < D / 16; ++n) wmma::fill_fragment(gq[n], 0.0f);
  for (unsigned j0 = lo; j0 < hi; j0 += BK) {
    const unsigned nk = min(BK, hi - j0);
    if (!tiles_meet(tiles, b, L, i0, hi - 1, j0, j0 + nk - 1)) continue;
    __syncthreads();
    stage<D>(ks, k, row0 + j0, nk, BK, KV * D, kh * D);
    stage<D>(vs, v, row0 + j0, nk, BK, KV * D, kh * D);
    if (threadIdx.x < BK) {  // warp 0: a half of the tile's keys each 16 lanes
      const unsigned s = threadIdx.x < nk ? seg[row0 + j0 + threadIdx.x] : 0;
      kseg[threadIdx.x] = s;
      const unsigned common = group_common<16>(s);
      if (lane % 16 == 0) kspan[lane / 16] = common;
    }
    __syncthreads();
    product_t<D, BK / 16>(&ss[warp * 16][0], LS, &qs[warp * 16][0], &ks[0][0]);
    __syncwarp();
    // The lane's 16 keys, seen whole by its query or masked one by one.
    const bool whole = r < nq && c0 + 16 <= nk && j0 + c0 + 15 <= i && j0 + c0 >= qfirst[r] &&
                       (runs || span_segment_seen(kspan[lane % 2], qseg[r], qpre[r]));
    float p[16];
    if (whole) {
#pragma unroll
      for (unsigned c = 0; c < 16; c += 4) {
        const float4 x = ld4(&ss[r][c0 + c]);
        p[c] = exp2_fast(fmaf(x.x, sl2, -lse2));
        p[c + 1] = exp2_fast(fmaf(x.y, sl2, -lse2));
        p[c + 2] = exp2_fast(fmaf(x.z, sl2, -lse2));
        p[c + 3] = exp2_fast(fmaf(x.w, sl2, -lse2));
      }
    } else {
#pragma unroll
      for (unsigned c = 0; c < 16; ++c) {
        const unsigned kj = c0 + c;
        const bool ok =
            kj < nk && r < nq && sees(i, j0 + kj, qfirst[r], qseg[r], qpre[r], kseg[kj], runs);
        p[c] = ok ? exp2_fast(fmaf(ss[r][kj], sl2, -lse2)) : 0.0f;
      }
    }
    __syncwarp();
    product_t<D, BK / 16>(&ss[warp * 16][0], LS, &dos[warp * 16][0], &vs[0][0]);
    __syncwarp();
#pragma unroll
    for (unsigned c = 0; c < 16; c += 4) {
      const float4 x = ld4(&ss[r][c0 + c]);
      st2(&dss[r][c0 + c], p[c] * (x.x - delta_r), p[c + 1] * (x.y - delta_r));
      st2(&dss[r][c0 + c + 2], p[c + 2] * (x.z - delta_r), p[c + 3] * (x.w - delta_r));
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
// The forward's, likewise (FwdShared: about 46 KB at D = 64, 71 KB at D = 128): at D = 128
// three blocks, as the shared memory allows, in 168 registers without a spill (the scores'
// scalar work took 218 and two blocks until the one-pass softmax was made shorter).
#define FWD_BLOCKS_PER_SM(D) ((D) == 64 ? 4 : 3)

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
