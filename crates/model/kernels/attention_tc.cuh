// The tensor-core attention's building blocks (attention_tc.cu): WMMA fragments and their
// shared-memory loads, the staging of tiles and of queries' slot arrays, the products of a
// warp's 16 rows, the spans a tile's mask is tested by whole, and each kernel's shared memory.
#pragma once

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

// WMMA's bf16 loads from shared memory, in the shared state space: nvcc emits
// `load_matrix_sync` of bf16 fragments in the generic one, which ptxas lowers to eight 32-bit
// loads a fragment (and, for a transposed operand, moves between lanes), where `.shared` takes
// one `ldmatrix`. The same PTX instruction otherwise, so the fragments are laid out as WMMA's.
#ifdef SLUICE_CUDA_EMU
template <class F>
__device__ __forceinline__ void load(F& f, const bf16* p, unsigned ld) {
  wmma::load_matrix_sync(f, p, ld);
}
#else
#define TC_SHARED_LOAD(F, OP)                                                                     \
  __device__ __forceinline__ void load(F& f, const bf16* p, unsigned ld) {                        \
    unsigned* x = reinterpret_cast<unsigned*>(&f.x[0]);                                           \
    asm volatile(OP " {%0, %1, %2, %3}, [%4], %5;"                                                \
                 : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])                                 \
                 : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(ld)                            \
                 : "memory");                                                                     \
  }
TC_SHARED_LOAD(FragA, "wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16")
TC_SHARED_LOAD(FragBt, "wmma.load.b.sync.aligned.col.m16n16k16.shared.bf16")
TC_SHARED_LOAD(FragB, "wmma.load.b.sync.aligned.row.m16n16k16.shared.bf16")
#undef TC_SHARED_LOAD
#endif

constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;

// 2^x in one instruction (relative error about 2^-22; results below 2^-126 are flushed to 0).
__device__ __forceinline__ float exp2_fast(float x) {
#ifdef SLUICE_CUDA_EMU
  return std::exp2(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Four consecutive f32 of shared memory, 16-byte aligned, in one load.
__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

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

// The value all W lanes of this lane's group hold (W consecutive lanes, W a power of two up to
// 32), or NONE where they differ. Every lane of the warp calls.
template <unsigned W>
__device__ __forceinline__ unsigned group_common(unsigned v) {
  const unsigned lane = threadIdx.x % 32, first = lane & ~(W - 1);
  const unsigned v0 = __shfl_sync(0xffffffffu, v, first);
  const unsigned differ = __ballot_sync(0xffffffffu, v != v0);
  unsigned group = 0xffffffffu;
  if constexpr (W < 32) group = ((1u << W) - 1) << first;
  return (differ & group) ? NONE : v0;
}

// The largest value of this lane's group of W lanes (as `group_common`).
template <unsigned W>
__device__ __forceinline__ unsigned group_max(unsigned v) {
  for (unsigned o = 1; o < W; o *= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Whether a query of segment `seg` and prefix `pre` sees every key of a span of segment `span`
// (by segment alone; NONE sees nothing here).
__device__ __forceinline__ bool span_segment_seen(unsigned span, unsigned seg, unsigned pre) {
  return span != NONE && (span == seg || (pre != 0 && span == pre));
}

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
      load(fa, a + k * 16, LD);
      load(fb, bt + n * 16 * LD + k * 16, LD);
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
    load(fa, a + k * 16, lda);
    for (unsigned n = 0; n < D / 16; ++n) {
      FragB fb;
      load(fb, b + k * 16 * LD + n * 16, LD);
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
// starts 32-byte aligned as WMMA requires.
template <unsigned D, unsigned LD = D + 8>
struct FwdShared {
  bf16 qs[64][LD];
  bf16 ks[64][LD];  // also the P tile, once the scores are formed
  bf16 vs[64][LD];
  float ss[64][68];
  unsigned qfirst[64], qseg[64], qpre[64], kseg[64];
  unsigned kspan[2];  // the segment each half of the key tile shares, or NONE
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
  Span qspan[2];  // each half of the query tile's
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
  unsigned kspan[2];  // the segment each half of the key tile shares, or NONE
};
}  // namespace tc
