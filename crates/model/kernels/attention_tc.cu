// Attention over packed segments on tensor cores, for bf16 heads of 64 and 128 (Qwen2.5-0.5B and
// SmolLM2; Qwen2.5 from 1.5B, Qwen3, Llama 3), as FlashAttention-2 computes it: the products
// S = Q Kᵀ, O = P V and the backward's dP, dV, dK and dQ run as PTX's 16 x 8 x 16 bf16 matrix
// multiply-accumulates with f32 sums (`mma.sync`), their operands loaded from shared memory by
// `ldmatrix`; the softmax, its log-sum-exp, the mask and dS = P (dP - delta) run in f32 on the
// products' accumulators, in registers. The rule, the inputs and the outputs are attention.cu's;
// P and dS are rounded to bf16 for their products, as FlashAttention rounds them. dK and dV
// come in two launches: each query head's share in f32, then the shares of each kv head's
// group added in order (`attn_tc_kv_sum`).
//
// Staged tiles are rows of D bf16 at a stride of LD = D + 8 (the extra 16 bytes move the 8 rows
// an `ldmatrix` reads onto different shared-memory banks). Every warp owns 16 rows of the
// block's tile (queries, or keys in the dK/dV pass), each lane two of them. The tiles live in
// dynamic shared memory (up to 70 KB a block at D = 128, past the 48 KB of static shared memory):
// `attn_tc_shared_bytes` reports each kernel's need, and the host sets the kernel's limit to it
// before launching.
//
// What a kernel streams (key tiles in the forward and the dQ pass, query tiles in the dK/dV
// pass) is staged by asynchronous copies (`cp.async`, `tc::stage`) while the block computes, as
// FlashAttention-2 pipelines its loads: the forward stages V's tile while S and P are formed and
// the next K's while P V is summed, in the same shared memory as before; the backward passes,
// whose tiles each product reads at both ends of a step, keep two buffers and stage the next
// tile into one while the other is used. A warp waits on global memory only where the compute of
// a whole phase did not cover its copies. (Until 2026-11-30 every tile was loaded into registers
// and stored to shared memory between two barriers, the block idle meanwhile.)
//
// The scalar work per score is kept short: every exponential is one `ex2.approx` of a fused
// multiply-add (the scale and log2(e) folded into one factor, the statistics kept in base 2
// inside the kernels), and a row whose tile is visible whole, by one test of the tile's shared
// segment (`tc::Span`), skips the per-score mask.

#include "attention_tc.cuh"

__device__ __forceinline__ bool sees(unsigned i, unsigned j, unsigned first_i, unsigned seg_i,
                                     unsigned prefix_i, unsigned seg_j, int runs) {
  return j <= i && j >= first_i && (runs || seg_j == seg_i || (prefix_i != 0 && seg_j == prefix_i));
}

// Grid (ceil(L / 64), B * H), 128 threads: 64 queries of one (row, head), 16 a warp, in one
// pass over the keys (an online softmax, as FlashAttention-2's forward), 64 keys a tile. The
// products are PTX's m16n8k16 (`mma16816`), so everything a warp computes stays in its
// registers: Q's fragments (loaded once), a tile's scores S = Q Kᵀ, P = exp(S - m) rounded to
// bf16 (S's accumulators are laid out as P's operand: no trip through shared memory), and the
// output, scaled by exp(m_old - m) when a row's max moves and divided by its sum l at the end;
// lse = m + ln l. The running max is of the scores times scale · log2(e) (base 2). A row whose
// tile of keys is visible whole (one test, `span_segment_seen` for the segment) skips the
// per-score mask. Two barriers a tile: after the first K's tile has landed and V's copies
// start; after the second V's has, and the next K's start (P is packed to bf16 before it, so
// its registers are free for the copies' addresses: held as f32 across, 8 spilled).
// (Until 2026-11-30 two passes, then one pass on WMMA, whose opaque layout sent the scores, P
// and each tile's P V through shared memory.)
template <unsigned D>
__device__ void attn_tc_fwd(const bf16* q, const bf16* k, const bf16* v, const unsigned* seg,
                            const unsigned* prefix, const unsigned* first, const unsigned* tiles,
                            int runs, bf16* o, float* lse, unsigned L, unsigned H, unsigned KV,
                            float scale) {
  using namespace tc;
  // KD: Q's 16-column fragments; NS: a tile's 8-key column groups of S; NO: the output's
  // 8-column groups.
  constexpr unsigned BQ = 64, BK = 64, KD = D / 16, NS = BK / 8, NO = D / 8;
  SLUICE_DYNAMIC_SHARED(smem);
  auto& sh = *reinterpret_cast<FwdShared<D>*>(smem);
  auto& qs = sh.qs;
  auto& ks = sh.ks;
  auto& vs = sh.vs;
  auto& qfirst = sh.qfirst;
  auto& qseg = sh.qseg;
  auto& qpre = sh.qpre;
  auto& kseg = sh.kseg;
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned i0 = blockIdx.x * BQ, nq = min(BQ, L - i0);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The lane's two rows (of the block's 64) and its columns 2t, 2t + 1 of every 8.
  const unsigned g = lane / 4, t2 = 2 * (lane % 4), rows[2] = {warp * 16 + g, warp * 16 + g + 8};
  const u64 row0 = (u64)b * L;
  const float sl2 = scale * LOG2E;
  stage<D>(qs, q, row0 + i0, nq, BQ, H * D, h * D);
  stage_queries(BQ, nq, {first, seg, prefix, nullptr, nullptr}, row0 + i0, 0,
                {qfirst, qseg, qpre, nullptr, nullptr});
  cp_async_wait();
  __syncthreads();
  unsigned qf[KD][4];
#pragma unroll
  for (unsigned kk = 0; kk < KD; ++kk) load_a(qf[kk], qs, warp * 16, kk * 16);
  unsigned lo = 0xffffffffu;
  for (unsigned t = 0; t < BQ; ++t) lo = min(lo, qfirst[t]);
  const unsigned hi = i0 + nq;
  const auto next = [&](unsigned j) { return next_key_tile(tiles, b, L, i0, hi, j, BK); };
  const auto stage_keys = [&](unsigned j) {
    stage<D>(ks, k, row0 + j, min(BK, hi - j), BK, KV * D, kh * D);
    stage_words(kseg, seg, row0 + j, min(BK, hi - j), BK);
  };
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, out[NO][4] = {};
  unsigned j0 = next(lo);
  if (j0 < hi) stage_keys(j0);
  while (j0 < hi) {
    const unsigned nk = min(BK, hi - j0), jn = next(j0 + BK);
    cp_async_wait();
    __syncthreads();  // K's tile has landed; every warp is done with the previous tile's V
    stage<D>(vs, v, row0 + j0, nk, BK, KV * D, kh * D);  // in flight while S and P are formed
    float s[NS][4] = {};  // S = Q Kᵀ
#pragma unroll
    for (unsigned kk = 0; kk < KD; ++kk) mma_rows_t(s, qf[kk], ks, kk * 16);
    const unsigned tile_seg = tile_segment<BK>(kseg);
#pragma unroll
    for (unsigned e = 0; e < 2; ++e) {  // row e: s[.][2e] and s[.][2e + 1]
      const unsigned r = rows[e], i = i0 + r;
      const bool whole = r < nq && nk == BK && j0 + BK - 1 <= i && j0 >= qfirst[r] &&
                         (runs || span_segment_seen(tile_seg, qseg[r], qpre[r]));
      if (!whole)
#pragma unroll
        for (unsigned n = 0; n < NS; ++n)
#pragma unroll
          for (unsigned x = 0; x < 2; ++x) {
            const unsigned c = n * 8 + t2 + x;
            if (!(c < nk && r < nq && sees(i, j0 + c, qfirst[r], qseg[r], qpre[r], kseg[c], runs)))
              s[n][2 * e + x] = -INFINITY;
          }
      // The row's max over the 4 lanes that hold it (the scale is positive: the scaled max is
      // the max scaled), then P, its sum, and the output's rescale. Rows without a visible
      // key yet keep m = -inf, l = 0 and a zero output.
      float mx = -INFINITY;
#pragma unroll
      for (unsigned n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * e], s[n][2 * e + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m[e], mx * sl2);
      const float alpha = mn > -INFINITY ? exp2_fast(m[e] - mn) : 1.0f;
      float sum = 0.0f;
#pragma unroll
      for (unsigned n = 0; n < NS; ++n)
#pragma unroll
        for (unsigned x = 0; x < 2; ++x) {
          const float p = mn > -INFINITY ? exp2_fast(fmaf(s[n][2 * e + x], sl2, -mn)) : 0.0f;
          s[n][2 * e + x] = p;
          sum += p;
        }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l[e] = l[e] * alpha + sum;
      m[e] = mn;
#pragma unroll
      for (unsigned n = 0; n < NO; ++n) {
        out[n][2 * e] *= alpha;
        out[n][2 * e + 1] *= alpha;
      }
    }
    // P rounded to bf16 as the left operand of P V: S's accumulators of keys 16kk.. are P's
    // operand for them (packed before the barrier, where they take half the registers).
    unsigned pa[BK / 16][4];
#pragma unroll
    for (unsigned kk = 0; kk < BK / 16; ++kk) operand(pa[kk], s[2 * kk], s[2 * kk + 1]);
    cp_async_wait();
    __syncthreads();  // V's tile has landed; every warp is done with K's and its segments
    if (jn < hi) stage_keys(jn);  // in flight while P V is summed
#pragma unroll
    for (unsigned kk = 0; kk < BK / 16; ++kk) mma_rows(out, pa[kk], vs, kk * 16);
    j0 = jn;
  }
#pragma unroll
  for (unsigned e = 0; e < 2; ++e) {
    const unsigned r = rows[e];
    if (r >= nq) continue;
    const float inv_l = 1.0f / l[e];
    bf16* row = o + (row0 + i0 + r) * H * D + h * D;
#pragma unroll
    for (unsigned n = 0; n < NO; ++n) st2(row + n * 8 + t2, out[n][2 * e] * inv_l, out[n][2 * e + 1] * inv_l);
    if (lane % 4 == 0) lse[((u64)b * H + h) * L + i0 + r] = (m[e] + log2f(l[e])) * LN2;
  }
}

// dK, dV: one query head's share. Grid (ceil(L / 64), B * H), 128 threads: 64 keys of one
// (row, query head)'s kv head, 16 a warp, over the queries of that head that see them, 32 at a
// time (the next tile's rows, slot arrays, log-sum-exps and deltas staged into a second buffer
// meanwhile); the sums go to `dk_part` and `dv_part` (N, H, D, f32), which `attn_tc_kv_sum`
// adds up per kv head. In registers, as the forward: with keys as rows, Sᵀ = K Qᵀ and dPᵀ = V dOᵀ,
// then Pᵀ and dSᵀ = Pᵀ (dPᵀ - delta) are the left operands of dV += Pᵀ dO and dK += dSᵀ Q.
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
  constexpr unsigned BK = 64, BQ = 32, KD = D / 16, NS = BQ / 8, NO = D / 8;
  SLUICE_DYNAMIC_SHARED(smem);
  auto& sh = *reinterpret_cast<KvShared<D>*>(smem);
  auto& ks = sh.ks;
  auto& vs = sh.vs;
  auto& kseg = sh.kseg;
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned j0 = blockIdx.x * BK, nk = min(BK, L - j0), jlast = j0 + nk - 1;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The lane's two key rows (of the block's 64) and its query columns 2t, 2t + 1 of every 8.
  const unsigned g = lane / 4, t2 = 2 * (lane % 4), rows[2] = {warp * 16 + g, warp * 16 + g + 8};
  const u64 row0 = (u64)b * L, head0 = ((u64)b * H + h) * L;
  const float sl2 = scale * LOG2E;
  stage<D>(ks, k, row0 + j0, nk, BK, KV * D, kh * D);
  stage<D>(vs, v, row0 + j0, nk, BK, KV * D, kh * D);
  stage_words(kseg, seg, row0 + j0, nk, BK);
  float dk[NO][4] = {}, dv[NO][4] = {};
  // The word of the tile mask (common.cuh, `tiles_meet`) that holds this block's key tile, in
  // the row of query tile 0; query tile t's is `mask_words` words on per tile.
  const unsigned mask_words = ((L + 63) / 64 + 31) / 32;
  const unsigned* mask = tiles + (u64)b * ((L + 63) / 64) * mask_words + j0 / 64 / 32;
  // The query tiles the block visits from slot i on: those whose tile of 64 (the block's keys
  // are one tile of the mask, and 32 queries from a multiple of 32 lie in one) sees its keys.
  const auto next = [&](unsigned i) {
    while (i < L && !((mask[(u64)(i / 64) * mask_words] >> (j0 / 64 % 32)) & 1u)) i += BQ;
    return i;
  };
  // Query tile i's rows of Q and dO and its slot arrays, log-sum-exps and deltas into buffer x.
  const auto stage_queries_at = [&](unsigned i, unsigned x) {
    const unsigned nq = min(BQ, L - i);
    stage<D>(sh.qs[x], q, row0 + i, nq, BQ, H * D, h * D);
    stage<D>(sh.dos[x], dout, row0 + i, nq, BQ, H * D, h * D);
    stage_words(sh.qfirst[x], first, row0 + i, nq, BQ);
    stage_words(sh.qseg[x], seg, row0 + i, nq, BQ);
    stage_words(sh.qpre[x], prefix, row0 + i, nq, BQ);
    stage_words(sh.qlse[x], lse, head0 + i, nq, BQ);
    stage_words(sh.qdelta[x], delta, head0 + i, nq, BQ);
  };
  unsigned i0 = next(j0), buf = 0;
  if (i0 < L) stage_queries_at(i0, 0);
  for (unsigned in; i0 < L; i0 = in, buf ^= 1) {
    const unsigned nq = min(BQ, L - i0);
    in = next(i0 + BQ);
    cp_async_wait();
    __syncthreads();  // this tile has landed; every warp is done with the other buffer
    if (in < L) stage_queries_at(in, buf ^ 1);  // in flight while this one is used
    const auto& qs = sh.qs[buf];
    const auto& dos = sh.dos[buf];
    const unsigned *qfirst = sh.qfirst[buf], *qseg = sh.qseg[buf], *qpre = sh.qpre[buf];
    const float *qlse = sh.qlse[buf], *qdelta = sh.qdelta[buf];
    // What the tile's queries share, by every warp on its own (lane l votes for query l): the
    // earliest and the latest of their first visible slots, their segment and prefix.
    const bool valid = lane < nq;
    if (warp_min(valid ? qfirst[lane] : 0xffffffffu) > jlast) continue;  // none sees these keys
    const Span span = {warp_common(qseg[lane]), warp_common(qpre[lane]),
                       warp_max(valid ? qfirst[lane] : 0u)};
    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: the warp's keys (K's and V's rows) on the left.
    float s[NS][4] = {}, dp[NS][4] = {};
#pragma unroll
    for (unsigned kk = 0; kk < KD; ++kk) {
      unsigned a[4];
      load_a(a, ks, warp * 16, kk * 16);
      mma_rows_t(s, a, qs, kk * 16);
      load_a(a, vs, warp * 16, kk * 16);
      mma_rows_t(dp, a, dos, kk * 16);
    }
    // Pᵀ into s and dSᵀ into dp, by each query column's log-sum-exp (base 2) and delta.
#pragma unroll
    for (unsigned e = 0; e < 2; ++e) {  // key row e: s[.][2e] and s[.][2e + 1]
      const unsigned r = rows[e], j = j0 + r;
      // Seen by every query of the tile, or masked one by one.
      const bool whole = r < nk && nq == BQ && j <= i0 && span.first <= j &&
                         (runs || (span.seg != NONE && kseg[r] == span.seg) ||
                          (span.pre != NONE && span.pre != 0 && kseg[r] == span.pre));
#pragma unroll
      for (unsigned n = 0; n < NS; ++n)
#pragma unroll
        for (unsigned x = 0; x < 2; ++x) {
          const unsigned c = n * 8 + t2 + x;
          const bool ok = whole || (c < nq && r < nk &&
                                    sees(i0 + c, j, qfirst[c], qseg[c], qpre[c], kseg[r], runs));
          const float p = ok ? exp2_fast(fmaf(s[n][2 * e + x], sl2, -qlse[c] * LOG2E)) : 0.0f;
          s[n][2 * e + x] = p;
          dp[n][2 * e + x] = p * (dp[n][2 * e + x] - qdelta[c]);
        }
    }
    // dV += Pᵀ dO and dK += dSᵀ Q: the queries are the products' inner dimension.
#pragma unroll
    for (unsigned kk = 0; kk < BQ / 16; ++kk) {
      unsigned a[4];
      operand(a, s[2 * kk], s[2 * kk + 1]);
      mma_rows(dv, a, dos, kk * 16);
      operand(a, dp[2 * kk], dp[2 * kk + 1]);
      mma_rows(dk, a, qs, kk * 16);
    }
  }
#pragma unroll
  for (unsigned e = 0; e < 2; ++e) {
    const unsigned r = rows[e];
    if (r >= nk) continue;
    const u64 at = (row0 + j0 + r) * H * D + h * D;
#pragma unroll
    for (unsigned n = 0; n < NO; ++n) {
      *reinterpret_cast<float2*>(dk_part + at + n * 8 + t2) =
          make_float2(dk[n][2 * e] * scale, dk[n][2 * e + 1] * scale);
      *reinterpret_cast<float2*>(dv_part + at + n * 8 + t2) =
          make_float2(dv[n][2 * e], dv[n][2 * e + 1]);
    }
  }
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

// dQ. Grid (ceil(L / 64), B * H), 128 threads: 64 queries of one (row, head), 16 a warp, over
// the keys they see, 32 at a time (the next tile staged into a second buffer meanwhile), in
// registers as the forward: S = Q Kᵀ and dP = dO Vᵀ, then
// dS = P (dP - delta) is the left operand of dQ += dS K.
template <unsigned D>
__device__ void attn_tc_bwd_q(const bf16* q, const bf16* k, const bf16* v, const bf16* dout,
                              const float* lse, const float* delta, const unsigned* seg,
                              const unsigned* prefix, const unsigned* first,
                              const unsigned* tiles, int runs, bf16* dq, unsigned L, unsigned H,
                              unsigned KV, float scale) {
  using namespace tc;
  constexpr unsigned BQ = 64, BK = 32, KD = D / 16, NS = BK / 8, NO = D / 8;
  SLUICE_DYNAMIC_SHARED(smem);
  auto& sh = *reinterpret_cast<QShared<D>*>(smem);
  auto& qs = sh.qs;
  auto& dos = sh.dos;
  auto& qlse = sh.qlse;
  auto& qdelta = sh.qdelta;
  auto& qfirst = sh.qfirst;
  auto& qseg = sh.qseg;
  auto& qpre = sh.qpre;
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned i0 = blockIdx.x * BQ, nq = min(BQ, L - i0);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned g = lane / 4, t2 = 2 * (lane % 4), rows[2] = {warp * 16 + g, warp * 16 + g + 8};
  const u64 row0 = (u64)b * L;
  const float sl2 = scale * LOG2E;
  stage<D>(qs, q, row0 + i0, nq, BQ, H * D, h * D);
  stage<D>(dos, dout, row0 + i0, nq, BQ, H * D, h * D);
  stage_queries(BQ, nq, {first, seg, prefix, lse, delta}, row0 + i0, ((u64)b * H + h) * L + i0,
                {qfirst, qseg, qpre, qlse, qdelta});
  cp_async_wait();
  __syncthreads();
  unsigned qf[KD][4], df[KD][4];
#pragma unroll
  for (unsigned kk = 0; kk < KD; ++kk) {
    load_a(qf[kk], qs, warp * 16, kk * 16);
    load_a(df[kk], dos, warp * 16, kk * 16);
  }
  unsigned lo = 0xffffffffu;
  for (unsigned t = 0; t < BQ; ++t) lo = min(lo, qfirst[t]);
  const unsigned hi = i0 + nq;
  const float lse2[2] = {qlse[rows[0]], qlse[rows[1]]};
  const float dl[2] = {qdelta[rows[0]], qdelta[rows[1]]};
  const auto next = [&](unsigned j) { return next_key_tile(tiles, b, L, i0, hi, j, BK); };
  // Key tile j's rows of K and V and its segments into buffer x.
  const auto stage_keys = [&](unsigned j, unsigned x) {
    const unsigned nk = min(BK, hi - j);
    stage<D>(sh.ks[x], k, row0 + j, nk, BK, KV * D, kh * D);
    stage<D>(sh.vs[x], v, row0 + j, nk, BK, KV * D, kh * D);
    stage_words(sh.kseg[x], seg, row0 + j, nk, BK);
  };
  float acc[NO][4] = {};
  unsigned j0 = next(lo), buf = 0;
  if (j0 < hi) stage_keys(j0, 0);
  for (unsigned jn; j0 < hi; j0 = jn, buf ^= 1) {
    const unsigned nk = min(BK, hi - j0);
    jn = next(j0 + BK);
    cp_async_wait();
    __syncthreads();  // this tile has landed; every warp is done with the other buffer
    if (jn < hi) stage_keys(jn, buf ^ 1);  // in flight while this one is used
    const auto& ks = sh.ks[buf];
    const auto& vs = sh.vs[buf];
    const unsigned* kseg = sh.kseg[buf];
    float s[NS][4] = {}, dp[NS][4] = {};  // S = Q Kᵀ, dP = dO Vᵀ
#pragma unroll
    for (unsigned kk = 0; kk < KD; ++kk) {
      mma_rows_t(s, qf[kk], ks, kk * 16);
      mma_rows_t(dp, df[kk], vs, kk * 16);
    }
    const unsigned tile_seg = tile_segment<BK>(kseg);
#pragma unroll
    for (unsigned e = 0; e < 2; ++e) {  // row e: s[.][2e] and s[.][2e + 1]
      const unsigned r = rows[e], i = i0 + r;
      const bool whole = r < nq && nk == BK && j0 + BK - 1 <= i && j0 >= qfirst[r] &&
                         (runs || span_segment_seen(tile_seg, qseg[r], qpre[r]));
#pragma unroll
      for (unsigned n = 0; n < NS; ++n)
#pragma unroll
        for (unsigned x = 0; x < 2; ++x) {
          const unsigned c = n * 8 + t2 + x;
          const bool ok = whole || (c < nk && r < nq &&
                                    sees(i, j0 + c, qfirst[r], qseg[r], qpre[r], kseg[c], runs));
          const float p = ok ? exp2_fast(fmaf(s[n][2 * e + x], sl2, -lse2[e])) : 0.0f;
          dp[n][2 * e + x] = p * (dp[n][2 * e + x] - dl[e]);
        }
    }
    // dQ += dS K: the keys are the product's inner dimension.
#pragma unroll
    for (unsigned kk = 0; kk < BK / 16; ++kk) {
      unsigned da[4];
      operand(da, dp[2 * kk], dp[2 * kk + 1]);
      mma_rows(acc, da, ks, kk * 16);
    }
  }
#pragma unroll
  for (unsigned e = 0; e < 2; ++e) {
    const unsigned r = rows[e];
    if (r >= nq) continue;
    bf16* row = dq + (row0 + i0 + r) * H * D + h * D;
#pragma unroll
    for (unsigned n = 0; n < NO; ++n)
      st2(row + n * 8 + t2, acc[n][2 * e] * scale, acc[n][2 * e + 1] * scale);
  }
}

// The blocks of each kernel resident on one SM, the register budget ptxas is held to: four at
// D = 64 (128 registers a thread; the shared memory, 28 to 38 KB a block, would allow five or
// more); at D = 128 three for the forward (166 registers, no spill; about 52 KB of shared memory
// a block) and two for the backward passes (240 and 218 registers; about 70 KB each). Read with
// `scripts/kernel-instructions` (docs/gpu.md).
#define KV_BLOCKS_PER_SM(D) ((D) == 64 ? 4 : 2)
#define FWD_BLOCKS_PER_SM(D) ((D) == 64 ? 4 : 3)
#define Q_BLOCKS_PER_SM(D) ((D) == 64 ? 4 : 2)

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
  extern "C" __global__ void __launch_bounds__(128, Q_BLOCKS_PER_SM(D)) attn_tc_bwd_q_bf16_##D(   \
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
