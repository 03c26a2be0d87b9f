// Attention over packed segments on tensor cores, for bf16 heads of 64 (the bf16 training
// forward of Qwen2.5-0.5B-shaped models and SmolLM2): the products S = Q Kᵀ, O = P V and the
// backward's dP, dV, dK and dQ run as 16 x 16 x 16 bf16 matrix multiply-accumulates with f32
// sums (WMMA); the softmax, its log-sum-exp, the mask and dS = P (dP - delta) run in f32 on the
// staged f32 scores. The rule, the inputs and the outputs are attention.cu's; P and dS are
// rounded to bf16 for their products, as FlashAttention rounds them.
//
// Staged tiles are rows of 64 bf16 at a stride of LD = 72 (WMMA wants a multiple of 8; the extra
// 16 bytes move consecutive rows off the same shared-memory banks). Every warp owns 16 rows of
// a tile; lane pairs (lane / 2) own one row each of the warp's f32 scores for the scalar work.

#include "common.cuh"

#ifndef SLUICE_CUDA_EMU
#include <mma.h>
#endif

using namespace nvcuda;

namespace tc {
constexpr unsigned D = 64;
constexpr unsigned LD = D + 8;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
// A right-hand operand staged transposed (its columns are the tile's rows).
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// `rows` slots of one head of a (N, stride) tensor from slot `slot0` into `dst`, zeros past
// `valid`.
__device__ __forceinline__ void stage(bf16 (*dst)[LD], const bf16* src, u64 slot0, unsigned valid,
                                      unsigned rows, unsigned stride, unsigned col0) {
  for (unsigned e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const unsigned r = e / D, c = e % D;
    dst[r][c] = r < valid ? src[(slot0 + r) * stride + col0 + c] : __float2bfloat16(0.0f);
  }
}

// out (16 x 16 NT, f32, row stride ldo) = a (16 x D) times the transpose of bt's 16 NT rows.
template <unsigned NT>
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

// acc[0..D/16) (16 x D) += a (16 x 16 KT, row stride lda) times b (16 KT x D, row stride LD).
template <unsigned KT>
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
// (rows past `valid` are skipped), through the warp's 16 rows of `scratch` (f32, stride lds).
__device__ __forceinline__ void write_rows(FragC* acc, float factor, float* scratch, unsigned lds,
                                           bf16* out, u64 slot0, unsigned valid, unsigned stride,
                                           unsigned col0) {
  const unsigned lane = threadIdx.x % 32;
  for (unsigned n = 0; n < D / 16; ++n) {
    __syncwarp();
    wmma::store_matrix_sync(scratch, acc[n], lds, wmma::mem_row_major);
    __syncwarp();
    const unsigned r = lane / 2, c0 = (lane % 2) * 8;
    if (r < valid)
      for (unsigned c = c0; c < c0 + 8; ++c)
        out[(slot0 + r) * stride + col0 + n * 16 + c] = __float2bfloat16(scratch[r * lds + c] * factor);
  }
}
}  // namespace tc

__device__ __forceinline__ bool sees(unsigned i, unsigned j, unsigned first_i, unsigned seg_i,
                                     unsigned prefix_i, unsigned seg_j, int runs) {
  return j <= i && j >= first_i && (runs || seg_j == seg_i || (prefix_i != 0 && seg_j == prefix_i));
}

// Grid (ceil(L / 64), B * H), 128 threads: 64 queries of one (row, head). Two passes over the
// keys: the row statistics (max, sum), then O = softmax(S) V with P from the final log-sum-exp,
// so the accumulators are never rescaled.
extern "C" __global__ void attn_tc_fwd_bf16_64(const bf16* q, const bf16* k, const bf16* v,
                                               const unsigned* seg, const unsigned* prefix,
                                               const unsigned* first, int runs, bf16* o,
                                               float* lse, unsigned L, unsigned H, unsigned KV,
                                               float scale) {
  using namespace tc;
  constexpr unsigned BQ = 64, BK = 64, LS = BK + 4;
  __shared__ __align__(32) bf16 qs[BQ][LD];
  __shared__ __align__(32) bf16 ks[BK][LD];  // also the P tile, once the scores are formed
  __shared__ __align__(32) bf16 vs[BK][LD];
  __shared__ __align__(32) float ss[BQ][LS];
  __shared__ unsigned qfirst[BQ], qseg[BQ], qpre[BQ], kseg[BK];
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned i0 = blockIdx.x * BQ, nq = min(BQ, L - i0);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned r = warp * 16 + lane / 2, c0 = (lane % 2) * 32, i = i0 + r;
  const u64 row0 = (u64)b * L;
  stage(qs, q, row0 + i0, nq, BQ, H * D, h * D);
  for (unsigned t = threadIdx.x; t < BQ; t += blockDim.x) {
    const bool ok = t < nq;
    qfirst[t] = ok ? first[row0 + i0 + t] : 0xffffffffu;
    qseg[t] = ok ? seg[row0 + i0 + t] : 0;
    qpre[t] = ok ? prefix[row0 + i0 + t] : 0;
  }
  __syncthreads();
  unsigned lo = 0xffffffffu;
  for (unsigned t = 0; t < BQ; ++t) lo = min(lo, qfirst[t]);
  const unsigned hi = i0 + nq;
  float m = -INFINITY, l = 0.0f;
  // Pass 1: each row's max and sum of exponentials.
  for (unsigned j0 = lo; j0 < hi; j0 += BK) {
    const unsigned nk = min(BK, hi - j0);
    __syncthreads();
    stage(ks, k, row0 + j0, nk, BK, KV * D, kh * D);
    for (unsigned t = threadIdx.x; t < BK; t += blockDim.x) kseg[t] = t < nk ? seg[row0 + j0 + t] : 0;
    __syncthreads();
    product_t<BK / 16>(&ss[warp * 16][0], LS, &qs[warp * 16][0], &ks[0][0]);
    __syncwarp();
    float mx = -INFINITY;
    for (unsigned c = c0; c < c0 + 32; ++c) {
      const bool ok = c < nk && r < nq && sees(i, j0 + c, qfirst[r], qseg[r], qpre[r], kseg[c], runs);
      const float s = ok ? ss[r][c] * scale : -INFINITY;
      ss[r][c] = s;
      mx = fmaxf(mx, s);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    // Every lane shuffles (a pair's lanes agree on `mn`; rows without a visible key yet skip).
    const float mn = fmaxf(m, mx);
    float sum = 0.0f;
    if (mn > -INFINITY)
      for (unsigned c = c0; c < c0 + 32; ++c) sum += expf(ss[r][c] - mn);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (mn > -INFINITY) {
      l = l * expf(m - mn) + sum;
      m = mn;
    }
  }
  const float row_lse = m + logf(l);
  // Pass 2: O = P V.
  FragC acc[D / 16];
  for (unsigned n = 0; n < D / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);
  for (unsigned j0 = lo; j0 < hi; j0 += BK) {
    const unsigned nk = min(BK, hi - j0);
    __syncthreads();
    stage(ks, k, row0 + j0, nk, BK, KV * D, kh * D);
    stage(vs, v, row0 + j0, nk, BK, KV * D, kh * D);
    for (unsigned t = threadIdx.x; t < BK; t += blockDim.x) kseg[t] = t < nk ? seg[row0 + j0 + t] : 0;
    __syncthreads();
    product_t<BK / 16>(&ss[warp * 16][0], LS, &qs[warp * 16][0], &ks[0][0]);
    __syncthreads();  // every warp is done with the keys: P takes their place
    for (unsigned c = c0; c < c0 + 32; ++c) {
      const bool ok = c < nk && r < nq && sees(i, j0 + c, qfirst[r], qseg[r], qpre[r], kseg[c], runs);
      ks[r][c] = __float2bfloat16(ok ? expf(ss[r][c] * scale - row_lse) : 0.0f);
    }
    __syncwarp();
    accumulate<BK / 16>(acc, &ks[warp * 16][0], LD, &vs[0][0]);
  }
  write_rows(acc, 1.0f, &ss[warp * 16][0], LS, o, row0 + i0 + warp * 16,
             nq > warp * 16 ? nq - warp * 16 : 0, H * D, h * D);
  if (lane % 2 == 0 && r < nq) lse[((u64)b * H + h) * L + i] = row_lse;
}

// dK, dV. Grid (ceil(L / 64), B * KV), 128 threads: 64 keys of one (row, kv head), summed over
// the queries of every head of the group, 32 at a time.
extern "C" __global__ void attn_tc_bwd_kv_bf16_64(const bf16* q, const bf16* k, const bf16* v,
                                                  const bf16* dout, const float* lse,
                                                  const float* delta, const unsigned* seg,
                                                  const unsigned* prefix, const unsigned* first,
                                                  int runs, bf16* dk, bf16* dv, unsigned L,
                                                  unsigned H, unsigned KV, float scale) {
  using namespace tc;
  constexpr unsigned BK = 64, BQ = 32, LS = BQ + 4, LP = BQ + 8;
  __shared__ __align__(32) bf16 ks[BK][LD];
  __shared__ __align__(32) bf16 vs[BK][LD];
  __shared__ __align__(32) bf16 qs[BQ][LD];
  __shared__ __align__(32) bf16 dos[BQ][LD];
  __shared__ __align__(32) float ss[BK][LS];
  __shared__ __align__(32) bf16 pt[BK][LP];
  __shared__ __align__(32) bf16 dst[BK][LP];
  __shared__ float qlse[BQ], qdelta[BQ];
  __shared__ unsigned qfirst[BQ], qseg[BQ], qpre[BQ], kseg[BK];
  const unsigned b = blockIdx.y / KV, kh = blockIdx.y % KV, g = H / KV;
  const unsigned j0 = blockIdx.x * BK, nk = min(BK, L - j0), jlast = j0 + nk - 1;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned r = warp * 16 + lane / 2, c0 = (lane % 2) * 16, j = j0 + r;
  const u64 row0 = (u64)b * L;
  stage(ks, k, row0 + j0, nk, BK, KV * D, kh * D);
  stage(vs, v, row0 + j0, nk, BK, KV * D, kh * D);
  for (unsigned t = threadIdx.x; t < BK; t += blockDim.x) kseg[t] = t < nk ? seg[row0 + j0 + t] : 0;
  FragC gk[D / 16], gv[D / 16];
  for (unsigned n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(gk[n], 0.0f);
    wmma::fill_fragment(gv[n], 0.0f);
  }
  for (unsigned gi = 0; gi < g; ++gi) {
    const unsigned h = kh * g + gi;
    for (unsigned i0 = j0; i0 < L; i0 += BQ) {
      const unsigned nq = min(BQ, L - i0);
      __syncthreads();
      for (unsigned t = threadIdx.x; t < BQ; t += blockDim.x) {
        const bool ok = t < nq;
        const u64 at = row0 + i0 + t;
        qfirst[t] = ok ? first[at] : 0xffffffffu;
        qseg[t] = ok ? seg[at] : 0;
        qpre[t] = ok ? prefix[at] : 0;
        qlse[t] = ok ? lse[((u64)b * H + h) * L + i0 + t] : 0.0f;
        qdelta[t] = ok ? delta[((u64)b * H + h) * L + i0 + t] : 0.0f;
      }
      __syncthreads();
      unsigned cmin = 0xffffffffu;
      for (unsigned t = 0; t < BQ; ++t) cmin = min(cmin, qfirst[t]);
      if (cmin > jlast) continue;  // the same for every thread: no query here sees these keys
      stage(qs, q, row0 + i0, nq, BQ, H * D, h * D);
      stage(dos, dout, row0 + i0, nq, BQ, H * D, h * D);
      __syncthreads();
      // Sᵀ (keys x queries) = K Qᵀ, then Pᵀ.
      product_t<BQ / 16>(&ss[warp * 16][0], LS, &ks[warp * 16][0], &qs[0][0]);
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
      product_t<BQ / 16>(&ss[warp * 16][0], LS, &vs[warp * 16][0], &dos[0][0]);
      __syncwarp();
      for (unsigned c = 0; c < 16; ++c) {
        const unsigned qi = c0 + c;
        dst[r][qi] = __float2bfloat16(p[c] * (ss[r][qi] - qdelta[qi]));
      }
      __syncwarp();
      accumulate<BQ / 16>(gv, &pt[warp * 16][0], LP, &dos[0][0]);
      accumulate<BQ / 16>(gk, &dst[warp * 16][0], LP, &qs[0][0]);
    }
  }
  const unsigned valid = nk > warp * 16 ? nk - warp * 16 : 0;
  write_rows(gk, scale, &ss[warp * 16][0], LS, dk, row0 + j0 + warp * 16, valid, KV * D, kh * D);
  write_rows(gv, 1.0f, &ss[warp * 16][0], LS, dv, row0 + j0 + warp * 16, valid, KV * D, kh * D);
}

// dQ. Grid (ceil(L / 64), B * H), 128 threads: 64 queries of one (row, head), over the keys
// they see, 32 at a time.
extern "C" __global__ void attn_tc_bwd_q_bf16_64(const bf16* q, const bf16* k, const bf16* v,
                                                 const bf16* dout, const float* lse,
                                                 const float* delta, const unsigned* seg,
                                                 const unsigned* prefix, const unsigned* first,
                                                 int runs, bf16* dq, unsigned L, unsigned H,
                                                 unsigned KV, float scale) {
  using namespace tc;
  constexpr unsigned BQ = 64, BK = 32, LS = BK + 4, LP = BK + 8;
  __shared__ __align__(32) bf16 qs[BQ][LD];
  __shared__ __align__(32) bf16 dos[BQ][LD];
  __shared__ __align__(32) bf16 ks[BK][LD];
  __shared__ __align__(32) bf16 vs[BK][LD];
  __shared__ __align__(32) float ss[BQ][LS];
  __shared__ __align__(32) bf16 dss[BQ][LP];
  __shared__ float qlse[BQ], qdelta[BQ];
  __shared__ unsigned qfirst[BQ], qseg[BQ], qpre[BQ], kseg[BK];
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned i0 = blockIdx.x * BQ, nq = min(BQ, L - i0);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned r = warp * 16 + lane / 2, c0 = (lane % 2) * 16, i = i0 + r;
  const u64 row0 = (u64)b * L;
  stage(qs, q, row0 + i0, nq, BQ, H * D, h * D);
  stage(dos, dout, row0 + i0, nq, BQ, H * D, h * D);
  for (unsigned t = threadIdx.x; t < BQ; t += blockDim.x) {
    const bool ok = t < nq;
    const u64 at = row0 + i0 + t;
    qfirst[t] = ok ? first[at] : 0xffffffffu;
    qseg[t] = ok ? seg[at] : 0;
    qpre[t] = ok ? prefix[at] : 0;
    qlse[t] = ok ? lse[((u64)b * H + h) * L + i0 + t] : 0.0f;
    qdelta[t] = ok ? delta[((u64)b * H + h) * L + i0 + t] : 0.0f;
  }
  __syncthreads();
  unsigned lo = 0xffffffffu;
  for (unsigned t = 0; t < BQ; ++t) lo = min(lo, qfirst[t]);
  const unsigned hi = i0 + nq;
  FragC gq[D / 16];
  for (unsigned n = 0; n < D / 16; ++n) wmma::fill_fragment(gq[n], 0.0f);
  for (unsigned j0 = lo; j0 < hi; j0 += BK) {
    const unsigned nk = min(BK, hi - j0);
    __syncthreads();
    stage(ks, k, row0 + j0, nk, BK, KV * D, kh * D);
    stage(vs, v, row0 + j0, nk, BK, KV * D, kh * D);
    for (unsigned t = threadIdx.x; t < BK; t += blockDim.x) kseg[t] = t < nk ? seg[row0 + j0 + t] : 0;
    __syncthreads();
    product_t<BK / 16>(&ss[warp * 16][0], LS, &qs[warp * 16][0], &ks[0][0]);
    __syncwarp();
    float p[16];
    for (unsigned c = 0; c < 16; ++c) {
      const unsigned kj = c0 + c;
      const bool ok = kj < nk && r < nq && sees(i, j0 + kj, qfirst[r], qseg[r], qpre[r], kseg[kj], runs);
      p[c] = ok ? expf(ss[r][kj] * scale - qlse[r]) : 0.0f;
    }
    __syncwarp();
    product_t<BK / 16>(&ss[warp * 16][0], LS, &dos[warp * 16][0], &vs[0][0]);
    __syncwarp();
    for (unsigned c = 0; c < 16; ++c) {
      const unsigned kj = c0 + c;
      dss[r][kj] = __float2bfloat16(p[c] * (ss[r][kj] - qdelta[r]));
    }
    __syncwarp();
    accumulate<BK / 16>(gq, &dss[warp * 16][0], LP, &ks[0][0]);
  }
  write_rows(gq, scale, &ss[warp * 16][0], LS, dq, row0 + i0 + warp * 16,
             nq > warp * 16 ? nq - warp * 16 : 0, H * D, h * D);
}
