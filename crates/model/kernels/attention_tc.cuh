// The tensor-core attention's building blocks (attention_tc.cu): PTX's matrix fragments and
// their loads from shared memory, the staging of tiles and of queries' slot arrays, the spans a
// tile's mask is tested by whole, and each kernel's shared memory.
#pragma once

#include "common.cuh"

namespace tc {
// The products use PTX's own 16 x 8 x 16 fragments (`mma.sync ... m16n8k16`), whose layout is
// specified where WMMA's is not, so scores, P, dS and the sums stay in registers: lane
// l = 4 g + t holds rows g and g + 8 of a 16-row operand or result, columns 2t and 2t + 1 of
// each 8 (emu.h spells the layout out). `ldsm_x4` loads four 8 x 8 bf16 matrices, lanes
// 8m..8m+7 pointing at matrix m's rows (`ldmatrix`; `TRANS` gives them transposed).
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const bf16* p) {
#ifdef SLUICE_CUDA_EMU
  emu::ldmatrix_x4(r, p, TRANS);
#else
#define TC_LDSM(OP)                                                                               \
  asm volatile(OP " {%0, %1, %2, %3}, [%4];"                                                      \
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                                   \
               : "r"((unsigned)__cvta_generic_to_shared(p))                                       \
               : "memory")
  if constexpr (TRANS)
    TC_LDSM("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16");
  else
    TC_LDSM("ldmatrix.sync.aligned.m8n8.x4.shared.b16");
#undef TC_LDSM
#endif
}

// d (16 x 8, f32) += a (16 x 16, bf16) b (16 x 8, bf16: b0 its rows 0..8, b1 rows 8..16).
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
#ifdef SLUICE_CUDA_EMU
  emu::mma_bf16_16816(d, a, b0, b1);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two f32 rounded to bf16, `lo` in the low half (a fragment's register of two columns).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}

// The tile products every kernel takes, over tiles staged as rows of LD bf16. Each warp's
// operand is 16 rows; `ldmatrix` addresses follow from the lane.

// a: the left operand, the 16 x 16 block at row `row0`, column `col0` of the tile.
template <unsigned LD>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const bf16 (*t)[LD], unsigned row0,
                                       unsigned col0) {
  const unsigned lane = threadIdx.x % 32;
  ldsm_x4<false>(a, &t[row0 + lane % 8 + 8 * (lane / 8 % 2)][col0 + 8 * (lane / 16)]);
}

// acc[0..N) (16 x 8N) += a times the transpose of the tile's rows 0..8N, columns col0..col0+16:
// the tile's rows are the product's columns (S = Q Kᵀ: a is Q's, the tile K).
template <unsigned N, unsigned LD>
__device__ __forceinline__ void mma_rows_t(float (&acc)[N][4], const unsigned (&a)[4],
                                           const bf16 (*t)[LD], unsigned col0) {
  const unsigned lane = threadIdx.x % 32;
#pragma unroll
  for (unsigned n = 0; n < N; n += 2) {
    unsigned b[4];
    ldsm_x4<false>(b, &t[n * 8 + lane % 8 + 8 * (lane / 16)][col0 + 8 * (lane / 8 % 2)]);
    mma16816(acc[n], a, b[0], b[1]);
    mma16816(acc[n + 1], a, b[2], b[3]);
  }
}

// acc[0..N) (16 x 8N) += a times the tile's rows row0..row0+16, columns 0..8N: the tile's rows
// are the product's inner dimension (O += P V: a is P's, the tile V).
template <unsigned N, unsigned LD>
__device__ __forceinline__ void mma_rows(float (&acc)[N][4], const unsigned (&a)[4],
                                         const bf16 (*t)[LD], unsigned row0) {
  const unsigned lane = threadIdx.x % 32;
#pragma unroll
  for (unsigned n = 0; n < N; n += 2) {
    unsigned b[4];
    ldsm_x4<true>(b, &t[row0 + lane % 8 + 8 * (lane / 8 % 2)][n * 8 + 8 * (lane / 16)]);
    mma16816(acc[n], a, b[0], b[1]);
    mma16816(acc[n + 1], a, b[2], b[3]);
  }
}

// a: a product's result as the next product's left operand, rounded to bf16: `lo` and `hi` are
// the accumulators of its columns 0..8 and 8..16 (P from S, dS from dP).
__device__ __forceinline__ void operand(unsigned (&a)[4], const float (&lo)[4],
                                        const float (&hi)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
}

// Two bf16 at an even column, in one store.
__device__ __forceinline__ void st2(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// No segment: a span whose slots do not all share one. (A real segment of this id only takes the
// per-score path.)
constexpr unsigned NONE = 0xffffffffu;

// What every slot of a span of a tile shares: its segment and its prefix segment (NONE where
// they differ), and the latest of their first visible slots.
struct Span {
  unsigned seg, pre, first;
};

// The value every lane of the warp holds, or NONE where they differ. Every lane calls.
__device__ __forceinline__ unsigned warp_common(unsigned v) {
  const unsigned v0 = __shfl_sync(0xffffffffu, v, 0);
  return __ballot_sync(0xffffffffu, v != v0) ? NONE : v0;
}

// The largest and the smallest value of the warp's lanes (every lane calls).
__device__ __forceinline__ unsigned warp_max(unsigned v) {
  for (unsigned o = 1; o < 32; o *= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ unsigned warp_min(unsigned v) {
  for (unsigned o = 1; o < 32; o *= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Whether a query of segment `seg` and prefix `pre` sees every key of a span of segment `span`
// (by segment alone; NONE sees nothing here).
__device__ __forceinline__ bool span_segment_seen(unsigned span, unsigned seg, unsigned pre) {
  return span != NONE && (span == seg || (pre != 0 && span == pre));
}

// The first tile of `bk` keys from slot j on (up to `hi`, the block's last query + 1) that some
// query of slots i0..hi sees by the tile mask, or `hi`: the key tiles the forward and the dQ
// pass visit (a shared prompt's later completions skip the earlier ones).
__device__ __forceinline__ unsigned next_key_tile(const unsigned* tiles, unsigned b, unsigned L,
                                                  unsigned i0, unsigned hi, unsigned j,
                                                  unsigned bk) {
  while (j < hi && !tiles_meet(tiles, b, L, i0, hi - 1, j, min(j + bk, hi) - 1)) j += bk;
  return j;
}

// Copies of N bytes (16, or 4 for slot arrays) from global to shared memory that run while the
// block computes (`cp.async`, sm_80 on): a thread issues them, and sees its own landed after
// `cp_async_wait`; the block sees them all after the barrier that follows. `ok` false writes
// zeros and reads nothing (`src` must still be an address of the tensor). 16-byte copies bypass
// L1 (`.cg`: tiles are read once from it); 4-byte ones can only go through it (`.ca`).
template <unsigned N>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool ok) {
  static_assert(N == 16 || N == 4, "16 bytes, or a 4-byte word");
#ifdef SLUICE_CUDA_EMU
  emu::cp_async(dst, src, ok ? N : 0, N);
#else
  const unsigned to = (unsigned)__cvta_generic_to_shared(dst), n = ok ? N : 0;
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(src), "r"(n)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(to), "l"(src), "r"(n)
                 : "memory");
#endif
}
// Every copy this thread has issued has landed.
__device__ __forceinline__ void cp_async_wait() {
#ifdef SLUICE_CUDA_EMU
  emu::cp_async_wait_all();
#else
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// `n` words (4 bytes: slot arrays, log-sum-exps, deltas) from `src + slot0` into `dst`, zeros
// past `valid` (at least 1), asynchronously: threads 0..n.
template <class T>
__device__ __forceinline__ void stage_words(T* dst, const T* src, u64 slot0, unsigned valid,
                                            unsigned n) {
  static_assert(sizeof(T) == 4, "words");
  const unsigned t = threadIdx.x;
  if (t < n) cp_async<4>(dst + t, src + slot0 + min(t, valid - 1), t < valid);
}

// The segment every key of a staged tile of BK shares, or NONE: one vote a 32 keys, by every
// warp on its own (every lane calls).
template <unsigned BK>
__device__ __forceinline__ unsigned tile_segment(const unsigned* kseg) {
  static_assert(BK % 32 == 0, "whole warps vote");
  const unsigned lane = threadIdx.x % 32;
  unsigned s = warp_common(kseg[lane]);
#pragma unroll
  for (unsigned k = 32; k < BK; k += 32)
    if (warp_common(kseg[k + lane]) != s) s = NONE;
  return s;
}

// `rows` slots of one head of a (N, stride) tensor from slot `slot0` into `dst`, zeros past
// `valid` (at least 1). Where every row of the head starts on a 16-byte boundary (the staged
// rows always do: LD * 2 bytes is a multiple of 16), 16 bytes (8 values) a copy, asynchronously
// (`cp_async`: the caller waits before the block reads them); otherwise one value a load and
// a store, at once.
template <unsigned D, unsigned LD = D + 8>
__device__ __forceinline__ void stage(bf16 (*dst)[LD], const bf16* src, u64 slot0, unsigned valid,
                                      unsigned rows, unsigned stride, unsigned col0) {
  constexpr unsigned V = 8, PER_ROW = D / V;
  const u64 at = (u64)(const void*)(src + col0) | ((u64)stride * sizeof(bf16));
  if (at % 16 == 0) {
    for (unsigned e = threadIdx.x; e < rows * PER_ROW; e += blockDim.x) {
      const unsigned r = e / PER_ROW, c = (e % PER_ROW) * V;
      cp_async<16>(&dst[r][c], src + (slot0 + min(r, valid - 1)) * stride + col0 + c, r < valid);
    }
    return;
  }
  for (unsigned e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const unsigned r = e / D, c = e % D;
    dst[r][c] = r < valid ? src[(slot0 + r) * stride + col0 + c] : __float2bfloat16(0.0f);
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
// given) into `dst`, the log-sum-exps in base 2 (times log2(e)); past `valid` a query sees
// nothing.
__device__ __forceinline__ void stage_queries(unsigned rows, unsigned valid,
                                              QuerySource src, u64 slot0, u64 head0,
                                              QueryTiles dst) {
  for (unsigned t = threadIdx.x; t < rows; t += blockDim.x) {
    const bool ok = t < valid;
    dst.first[t] = ok ? src.first[slot0 + t] : 0xffffffffu;
    dst.seg[t] = ok ? src.seg[slot0 + t] : 0;
    dst.prefix[t] = ok ? src.prefix[slot0 + t] : 0;
    if (dst.lse) dst.lse[t] = ok ? src.lse[head0 + t] * LOG2E : 0.0f;
    if (dst.delta) dst.delta[t] = ok ? src.delta[head0 + t] : 0.0f;
  }
}

// Each kernel's shared memory: tiles first, every one a multiple of 32 bytes long, so each
// starts aligned for `ldmatrix`, whose rows are 16 bytes. What a kernel streams is staged while
// it computes: the forward's K and V tiles one at a time, each while the other is in use (as
// FlashAttention-2's forward), and the backward passes' tiles, which each product reads at both
// ends of a step, in two buffers, the next while the current is in use.
template <unsigned D, unsigned LD = D + 8>
struct FwdShared {
  bf16 qs[64][LD];
  bf16 ks[64][LD];
  bf16 vs[64][LD];
  unsigned qfirst[64], qseg[64], qpre[64], kseg[64];
};

template <unsigned D, unsigned LD = D + 8>
struct KvShared {
  bf16 ks[64][LD];
  bf16 vs[64][LD];
  bf16 qs[2][32][LD];
  bf16 dos[2][32][LD];
  float qlse[2][32], qdelta[2][32];
  unsigned qfirst[2][32], qseg[2][32], qpre[2][32], kseg[64];
};

template <unsigned D, unsigned LD = D + 8>
struct QShared {
  bf16 qs[64][LD];
  bf16 dos[64][LD];
  bf16 ks[2][32][LD];
  bf16 vs[2][32][LD];
  float qlse[64], qdelta[64];
  unsigned qfirst[64], qseg[64], qpre[64], kseg[2][32];
};
}  // namespace tc
