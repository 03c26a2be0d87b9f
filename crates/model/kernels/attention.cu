// Causal attention over packed segments on the GPU, forward and backward, in the manner of
// FlashAttention-2 on CUDA cores: nothing of size L x L is stored. The forward keeps each query's
// log-sum-exp (f32); the backward recomputes the probabilities from it in two passes, one over
// key blocks (dK, dV: each thread owns a key and sums over the query heads of its group) and one
// over query blocks (dQ: each thread owns a query), so no gradient is summed by atomics and the
// results do not depend on scheduling.
//
// Slot i of a row sees slot j iff first[i] <= j <= i and j's segment is i's own or the prefix i
// continues (`runs`: every segment is one run of slots and none continues a prefix, so the range
// alone decides): the rule of crates/model/src/fused/attention.rs, whose `Segments` gives
// `first` and `tiles` (the tiles of 64 x 64 slots that hold a visible pair: the rest are
// skipped). q is (N, H*D), k and v (N, KV*D), N = B*L rows; scores are scaled by `scale`.
// Products accumulate in f32 whatever the inputs' dtype (f32 or bf16); outputs are rounded once.

#include "common.cuh"

// Threads (queries or keys) per block, and the keys (queries) staged in shared memory at a time:
// smaller for D = 128 to stay within 48 KB of static shared memory. The forward splits a query's
// columns over PARTS threads, so that its query and output rows fit in registers (a whole row of
// 128 of each spilled 860 bytes a thread). The host's launches use the same numbers
// (crates/model/src/fused/device/attention.rs, `attention_rows`, `attention_fwd_parts`).
template <int D>
struct Tile {
  static constexpr unsigned ROWS = D <= 64 ? 64 : 32;
  static constexpr unsigned CHUNK = D <= 64 ? 16 : 8;
  static constexpr unsigned KEYS = 32;  // the forward's key tile
  static constexpr unsigned PARTS = D <= 64 ? 1 : 2;
};

__device__ __forceinline__ bool visible(unsigned i, unsigned j, unsigned first_i, unsigned seg_i,
                                        unsigned prefix_i, unsigned seg_j, int runs) {
  return j <= i && j >= first_i && (runs || seg_j == seg_i || (prefix_i != 0 && seg_j == prefix_i));
}

// The smallest of one value per thread (every thread gets it), through `scratch` of ROWS.
template <unsigned ROWS>
__device__ __forceinline__ unsigned block_min(unsigned v, unsigned* scratch) {
  __syncthreads();
  scratch[threadIdx.x] = v;
  __syncthreads();
  unsigned m = 0xffffffffu;
  for (unsigned t = 0; t < ROWS; ++t) m = min(m, scratch[t]);
  return m;
}

// Grid (ceil(L / ROWS), B * H), ROWS * PARTS threads: threads t * PARTS .. t * PARTS + PARTS - 1
// of block x are query x * ROWS + t of one (row, head), thread p of them holding the columns
// p, p + PARTS, p + 2 * PARTS, ... (interleaved, so the threads of a query read neighbouring
// banks of a staged key). They add their partial scores by shuffles; every thread of the block
// runs every loop (no early exit around a shuffle). o like q; lse (B, H, L).
template <typename T, int D>
__device__ void attn_fwd(const T* q, const T* k, const T* v, const unsigned* seg,
                         const unsigned* prefix, const unsigned* first, const unsigned* tiles,
                         int runs, T* o, float* lse, unsigned L, unsigned H, unsigned KV,
                         float scale) {
  constexpr unsigned R = Tile<D>::ROWS, C = Tile<D>::CHUNK, K = Tile<D>::KEYS, P = Tile<D>::PARTS;
  constexpr unsigned DP = D / P;  // a thread's columns
  __shared__ float ks[K][D], vs[K][D];
  __shared__ unsigned kseg[K], scratch[R * P];
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned part = threadIdx.x % P, i = blockIdx.x * R + threadIdx.x / P;
  const bool active = i < L;
  const u64 slot = (u64)b * L + i;
  float qr[DP], acc[DP];
  unsigned fi = 0xffffffffu, si = 0, pi = 0;
  for (unsigned d = 0; d < DP; ++d) acc[d] = 0.0f;
  if (active) {
    for (unsigned d = 0; d < DP; ++d) qr[d] = ld(q, slot * H * D + (u64)h * D + d * P + part) * scale;
    fi = first[slot];
    si = seg[slot];
    pi = prefix[slot];
  }
  const unsigned lo = block_min<R * P>(fi, scratch);
  const unsigned hi = min(L, blockIdx.x * R + R);  // keys below hi
  float m = -INFINITY, l = 0.0f;
  for (unsigned j0 = lo; j0 < hi; j0 += K) {
    // Key tiles no query of the block sees (tiles.rs) are skipped whole.
    if (!tiles_meet(tiles, b, L, blockIdx.x * R, hi - 1, j0, min(j0 + K, hi) - 1)) continue;
    __syncthreads();
    for (unsigned e = threadIdx.x; e < K * D; e += R * P) {
      const unsigned r = e / D, c = e % D, j = j0 + r;
      const u64 at = ((u64)b * L + j) * KV * D + (u64)kh * D + c;
      ks[r][c] = j < hi ? ld(k, at) : 0.0f;
      vs[r][c] = j < hi ? ld(v, at) : 0.0f;
    }
    for (unsigned e = threadIdx.x; e < K; e += R * P) kseg[e] = j0 + e < hi ? seg[(u64)b * L + j0 + e] : 0;
    __syncthreads();
    // With one thread a query nothing below needs the others: an inactive one is done. With
    // several, it still takes part in their shuffles (its scores are all masked).
    if (P == 1 && !active) continue;
    for (unsigned c0 = 0; c0 < K; c0 += C) {
      float sc[C];
      float cmax = -INFINITY;
#pragma unroll
      for (unsigned t = 0; t < C; ++t) {
        const unsigned j = j0 + c0 + t;
        const bool seen = active && j < hi && visible(i, j, fi, si, pi, kseg[c0 + t], runs);
        float s = 0.0f;
        if (seen)
          for (unsigned d = 0; d < DP; ++d) s += qr[d] * ks[c0 + t][d * P + part];
        for (unsigned o = 1; o < P; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        sc[t] = seen ? s : -INFINITY;
        cmax = fmaxf(cmax, sc[t]);
      }
      if (cmax == -INFINITY) continue;
      const float mn = fmaxf(m, cmax);
      const float corr = expf(m - mn);
      l *= corr;
      for (unsigned d = 0; d < DP; ++d) acc[d] *= corr;
      m = mn;
#pragma unroll
      for (unsigned t = 0; t < C; ++t) {
        const float p = expf(sc[t] - m);
        l += p;
        for (unsigned d = 0; d < DP; ++d) acc[d] += p * vs[c0 + t][d * P + part];
      }
    }
  }
  if (active) {
    const float r = 1.0f / l;
    for (unsigned d = 0; d < DP; ++d) st(o, slot * H * D + (u64)h * D + d * P + part, acc[d] * r);
    if (part == 0) lse[((u64)b * H + h) * L + i] = m + logf(l);
  }
}

// delta (B, H, L) = rowsum(dO * O) per query and head: one warp per (slot, head), any grid.
template <typename T>
__device__ void attn_delta(const T* o, const T* dout, float* delta, unsigned L, unsigned H,
                           unsigned D, u64 n) {
  const u64 warps = (u64)gridDim.x * blockDim.x / 32;
  const unsigned lane = threadIdx.x % 32;
  for (u64 r = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < n; r += warps) {
    const u64 slot = r / H;
    const unsigned h = (unsigned)(r % H);
    float s = 0.0f;
    for (unsigned c = lane; c < D; c += 32) {
      const u64 at = slot * H * D + (u64)h * D + c;
      s += ld(o, at) * ld(dout, at);
    }
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) delta[((slot / L) * H + h) * L + slot % L] = s;
  }
}

// dK, dV. Grid (ceil(L / ROWS), B * KV), ROWS * PARTS threads: threads t * PARTS .. t * PARTS +
// PARTS - 1 own key x * ROWS + t of one (row, kv head), thread p of them the columns p, p + PARTS,
// ... (as in the forward), and sum over every query of the heads of its group that sees it.
template <typename T, int D>
__device__ void attn_bwd_kv(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                            const float* delta, const unsigned* seg, const unsigned* prefix,
                            const unsigned* first, const unsigned* tiles, int runs, T* dk, T* dv,
                            unsigned L, unsigned H, unsigned KV, float scale) {
  constexpr unsigned R = Tile<D>::ROWS, C = Tile<D>::CHUNK, P = Tile<D>::PARTS, DP = D / P;
  // Rows padded by PARTS: the threads of a warp (each its own key's row, its own columns of it)
  // read distinct banks.
  __shared__ float ks[R][D + P], vs[R][D + P];
  __shared__ float qs[C][D], dos[C][D];
  __shared__ float slse[C], sdelta[C];
  __shared__ unsigned sfirst[C], sseg[C], spre[C];
  const unsigned b = blockIdx.y / KV, kh = blockIdx.y % KV, g = H / KV;
  const unsigned part = threadIdx.x % P, own = threadIdx.x / P;
  const unsigned j0 = blockIdx.x * R, j = j0 + own;
  const bool active = j < L;
  const unsigned jlast = min(L, j0 + R) - 1;
  for (unsigned e = threadIdx.x; e < R * D; e += R * P) {
    const unsigned r = e / D, c = e % D, jj = j0 + r;
    const u64 at = ((u64)b * L + jj) * KV * D + (u64)kh * D + c;
    ks[r][c] = jj < L ? ld(k, at) : 0.0f;
    vs[r][c] = jj < L ? ld(v, at) : 0.0f;
  }
  const unsigned sj = active ? seg[(u64)b * L + j] : 0;
  float gk[DP], gv[DP];
  for (unsigned d = 0; d < DP; ++d) gk[d] = gv[d] = 0.0f;
  for (unsigned gi = 0; gi < g; ++gi) {
    const unsigned h = kh * g + gi;
    for (unsigned i0 = j0; i0 < L; i0 += C) {
      if (!tiles_meet(tiles, b, L, i0, min(i0 + C, L) - 1, j0, jlast)) continue;
      __syncthreads();
      for (unsigned e = threadIdx.x; e < C; e += R * P) {
        const unsigned i = i0 + e;
        const bool ok = i < L;
        const u64 at = (u64)b * L + i;
        sfirst[e] = ok ? first[at] : 0xffffffffu;
        sseg[e] = ok ? seg[at] : 0;
        spre[e] = ok ? prefix[at] : 0;
        slse[e] = ok ? lse[((u64)b * H + h) * L + i] : 0.0f;
        sdelta[e] = ok ? delta[((u64)b * H + h) * L + i] : 0.0f;
      }
      __syncthreads();
      unsigned cmin = 0xffffffffu;
      for (unsigned t = 0; t < C; ++t) cmin = min(cmin, sfirst[t]);
      if (cmin > jlast) continue;  // the same for every thread: no query here sees these keys
      for (unsigned e = threadIdx.x; e < C * D; e += R * P) {
        const unsigned r = e / D, c = e % D, i = i0 + r;
        const u64 at = ((u64)b * L + i) * H * D + (u64)h * D + c;
        qs[r][c] = i < L ? ld(q, at) : 0.0f;
        dos[r][c] = i < L ? ld(dout, at) : 0.0f;
      }
      __syncthreads();
      // As in the forward: with several threads a key, an inactive one still shuffles.
      if (P == 1 && !active) continue;
      for (unsigned t = 0; t < C; ++t) {
        const unsigned i = i0 + t;
        const bool seen = active && i < L && visible(i, j, sfirst[t], sseg[t], spre[t], sj, runs);
        if (P == 1 && !seen) continue;
        float s = 0.0f, dp = 0.0f;
        if (seen)
          for (unsigned d = 0; d < DP; ++d) {
            s += qs[t][d * P + part] * ks[own][d * P + part];
            dp += dos[t][d * P + part] * vs[own][d * P + part];
          }
        for (unsigned o = 1; o < P; o <<= 1) {
          s += __shfl_xor_sync(0xffffffffu, s, o);
          dp += __shfl_xor_sync(0xffffffffu, dp, o);
        }
        if (!seen) continue;
        const float p = expf(s * scale - slse[t]);
        const float ds = p * (dp - sdelta[t]);
        for (unsigned d = 0; d < DP; ++d) {
          gv[d] += p * dos[t][d * P + part];
          gk[d] += ds * qs[t][d * P + part];
        }
      }
    }
  }
  if (active) {
    const u64 at = ((u64)b * L + j) * KV * D + (u64)kh * D;
    for (unsigned d = 0; d < DP; ++d) {
      st(dk, at + d * P + part, gk[d] * scale);
      st(dv, at + d * P + part, gv[d]);
    }
  }
}

// dQ. Grid (ceil(L / ROWS), B * H), ROWS threads: thread t owns query x * ROWS + t.
template <typename T, int D>
__device__ void attn_bwd_q(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                           const float* delta, const unsigned* seg, const unsigned* prefix,
                           const unsigned* first, const unsigned* tiles, int runs, T* dq,
                           unsigned L, unsigned H, unsigned KV, float scale) {
  constexpr unsigned R = Tile<D>::ROWS, C = Tile<D>::CHUNK;
  __shared__ float qs[R][D + 1], dos[R][D + 1];
  __shared__ float ks[C][D], vs[C][D];
  __shared__ unsigned kseg[C], scratch[R];
  const unsigned b = blockIdx.y / H, h = blockIdx.y % H, kh = h / (H / KV);
  const unsigned i0 = blockIdx.x * R, i = i0 + threadIdx.x;
  const bool active = i < L;
  const u64 slot = (u64)b * L + i;
  for (unsigned e = threadIdx.x; e < R * D; e += R) {
    const unsigned r = e / D, c = e % D, ii = i0 + r;
    const u64 at = ((u64)b * L + ii) * H * D + (u64)h * D + c;
    qs[r][c] = ii < L ? ld(q, at) : 0.0f;
    dos[r][c] = ii < L ? ld(dout, at) : 0.0f;
  }
  unsigned fi = 0xffffffffu, si = 0, pi = 0;
  float li = 0.0f, di = 0.0f;
  if (active) {
    fi = first[slot];
    si = seg[slot];
    pi = prefix[slot];
    li = lse[((u64)b * H + h) * L + i];
    di = delta[((u64)b * H + h) * L + i];
  }
  const unsigned lo = block_min<R>(fi, scratch);
  const unsigned hi = min(L, i0 + R);
  float gq[D];
  for (int d = 0; d < D; ++d) gq[d] = 0.0f;
  for (unsigned j0 = lo; j0 < hi; j0 += C) {
    if (!tiles_meet(tiles, b, L, i0, hi - 1, j0, min(j0 + C, hi) - 1)) continue;
    __syncthreads();
    for (unsigned e = threadIdx.x; e < C * D; e += R) {
      const unsigned r = e / D, c = e % D, j = j0 + r;
      const u64 at = ((u64)b * L + j) * KV * D + (u64)kh * D + c;
      ks[r][c] = j < hi ? ld(k, at) : 0.0f;
      vs[r][c] = j < hi ? ld(v, at) : 0.0f;
    }
    for (unsigned e = threadIdx.x; e < C; e += R) kseg[e] = j0 + e < hi ? seg[(u64)b * L + j0 + e] : 0;
    __syncthreads();
    if (!active) continue;
    for (unsigned t = 0; t < C; ++t) {
      const unsigned j = j0 + t;
      if (j >= hi || !visible(i, j, fi, si, pi, kseg[t], runs)) continue;
      float s = 0.0f, dp = 0.0f;
      for (int d = 0; d < D; ++d) {
        s += qs[threadIdx.x][d] * ks[t][d];
        dp += dos[threadIdx.x][d] * vs[t][d];
      }
      const float ds = expf(s * scale - li) * (dp - di);
      for (int d = 0; d < D; ++d) gq[d] += ds * ks[t][d];
    }
  }
  if (active)
    for (int d = 0; d < D; ++d) st(dq, slot * H * D + (u64)h * D + d, gq[d] * scale);
}

#define ATTENTION(T, S, D)                                                                        \
  extern "C" __global__ void attn_fwd_##S##_##D(                                                  \
      const T* q, const T* k, const T* v, const unsigned* seg, const unsigned* prefix,            \
      const unsigned* first, const unsigned* tiles, int runs, T* o, float* lse, unsigned L,       \
      unsigned H, unsigned KV, float scale) {                                                     \
    attn_fwd<T, D>(q, k, v, seg, prefix, first, tiles, runs, o, lse, L, H, KV, scale);            \
  }                                                                                               \
  extern "C" __global__ void attn_bwd_kv_##S##_##D(                                               \
      const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,    \
      const unsigned* seg, const unsigned* prefix, const unsigned* first, const unsigned* tiles,  \
      int runs, T* dk, T* dv, unsigned L, unsigned H, unsigned KV, float scale) {                 \
    attn_bwd_kv<T, D>(q, k, v, dout, lse, delta, seg, prefix, first, tiles, runs, dk, dv, L, H,   \
                      KV, scale);                                                                 \
  }                                                                                               \
  extern "C" __global__ void attn_bwd_q_##S##_##D(                                                \
      const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,    \
      const unsigned* seg, const unsigned* prefix, const unsigned* first, const unsigned* tiles,  \
      int runs, T* dq, unsigned L, unsigned H, unsigned KV, float scale) {                        \
    attn_bwd_q<T, D>(q, k, v, dout, lse, delta, seg, prefix, first, tiles, runs, dq, L, H, KV,    \
                     scale);                                                                      \
  }

#define HEAD_DIMS(T, S) ATTENTION(T, S, 16) ATTENTION(T, S, 32) ATTENTION(T, S, 64) ATTENTION(T, S, 128)
HEAD_DIMS(float, f32)
HEAD_DIMS(bf16, bf16)

extern "C" __global__ void attn_delta_f32(const float* o, const float* dout, float* delta,
                                          unsigned L, unsigned H, unsigned D, u64 n) {
  attn_delta(o, dout, delta, L, H, D, n);
}
extern "C" __global__ void attn_delta_bf16(const bf16* o, const bf16* dout, float* delta,
                                           unsigned L, unsigned H, unsigned D, u64 n) {
  attn_delta(o, dout, delta, L, H, D, n);
}
