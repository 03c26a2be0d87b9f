// The engine's attention on the GPU, straight over the paged KV pool: each new token's query
// reads its sequence's cached keys and values where they lie, through its block table, up to its
// own position (the CPU kernel of crates/model/src/paged/attend.rs; the composition gathered a
// padded copy of every sequence and ran about ten kernels per layer). One warp per (row, query
// head): lanes score 32 keys at a time, the softmax is kept online, and each lane accumulates
// its own columns of the values. Sums and the softmax run in f32 for f32 and bf16 pools.
//
// The same launch stores the step's new keys and values in the pool (the write took a launch of
// its own per layer): the warp of each kv head's first query head writes its row's key and value.
// Since blocks run in no fixed order, no warp reads a position this step writes from the pool:
// positions from the sequence's cached length on come from the step's own keys and values.
//
// The step's queries, keys and values come either split (q, k_new, v_new: `SplitHeads`) or as
// the engine's stacked q/k/v product before its bias, rotation and split (`StackedHeads`): then
// this launch does what `split_rope` (fused.cu) would have done in one of its own, with the
// same arithmetic and the same rounding to T, so both give the same bits.
//
// A long row's keys can be split over gridDim.z parts (flash-decoding): part z scores the keys
// of its own stretch, `span` positions from z * span, and leaves its running maximum, sum and
// unnormalised values in `part` ((R, H, parts) records of D + 2 floats); `paged_combine` then
// rescales the parts to their common maximum and writes the output. A row's keys are then read
// by `parts` warps at once, where one warp walked them all: with few rows and long contexts
// (R * H warps on a GPU that keeps thousands in flight) the launch was latency-bound. With one
// part the launch writes the output itself, as it did before the split.
//
// The pool holds the keys in its first `half` rows and the values in the next `half`. Rows are
// head-major in blocks: key t of kv head h of a sequence with block table `tbl` is row
// (tbl[t / BT] * KV + h) * BT + t % BT, rows of D elements. `meta` holds, per query row r, the
// start of its table in `meta[3R..]`, its visible length and its sequence's cached length (before
// the step), then the tables. The step's rows of one sequence are consecutive, in order.

#include "common.cuh"

// Head dims up to 32 * MAX_COLS.
#define MAX_COLS 8

// The step's heads split: q (R, H, D), k and v (R, KV, D).
template <typename T>
struct SplitHeads {
  const T *q, *k, *v;
  unsigned H, KV, D;
  __device__ float query(u64 r, unsigned h, unsigned d) const { return ld(q, (r * H + h) * D + d); }
  __device__ T key(u64 r, unsigned kh, unsigned d) const { return k[(r * KV + kh) * D + d]; }
  __device__ T value(u64 r, unsigned kh, unsigned d) const { return v[(r * KV + kh) * D + d]; }
};

// The step's heads as rows of the stacked product, qkv (R, (H + 2 KV) D), q's heads then k's
// then v's; `bias` ((H + 2 KV) D) added when `has_bias`; q and k rotated by the row's angles
// (cos, sin: (R, D/2)). Each value is rounded to T as `split_rope` stores it.
template <typename T>
struct StackedHeads {
  const T *qkv, *bias, *cos, *sin;
  unsigned has_bias, H, KV, D;
  __device__ float raw(u64 r, unsigned col) const {
    float x = ld(qkv, r * (H + 2 * KV) * D + col);
    if (has_bias) x += ld(bias, col);
    return x;
  }
  // Element d of head `head` (q's heads first, then k's) of row r, rotated.
  __device__ float rotated(u64 r, unsigned head, unsigned d) const {
    const unsigned half = D / 2, j = d % half, col = head * D + j;
    const float x1 = raw(r, col), x2 = raw(r, col + half);
    const float c = ld(cos, r * half + j), s = ld(sin, r * half + j);
    return d < half ? rope_first(x1, x2, c, s) : rope_second(x1, x2, c, s);
  }
  __device__ float query(u64 r, unsigned h, unsigned d) const {
    return widen(rounded<T>(rotated(r, h, d)));
  }
  __device__ T key(u64 r, unsigned kh, unsigned d) const { return rounded<T>(rotated(r, H + kh, d)); }
  __device__ T value(u64 r, unsigned kh, unsigned d) const {
    return rounded<T>(raw(r, (H + KV + kh) * D + d));
  }
};

// Positions part z of `parts` scores in a row of `len`: whole warps' worth, part 0 first.
__device__ __forceinline__ unsigned part_span(unsigned len, unsigned parts) {
  return ((len + parts - 1) / parts + 31) & ~31u;
}

template <typename T, typename Heads>
__device__ void paged_attention(const Heads& step, T* pool, const unsigned* meta, T* out,
                                float* part, unsigned R, unsigned H, unsigned KV, unsigned D,
                                unsigned BT, u64 half, float scale) {
  __shared__ float qs[32 * MAX_COLS];
  const unsigned r = blockIdx.x, h = blockIdx.y, kh = h / (H / KV), lane = threadIdx.x;
  const unsigned len = meta[3 * r + 1], cached = meta[3 * r + 2];
  const unsigned parts = gridDim.z, z = blockIdx.z, span = part_span(len, parts);
  const unsigned from = min(len, z * span), end = min(len, from + span);
  const unsigned* table = meta + 3 * (u64)R + meta[3 * r];
  T* keys = pool;
  T* values = pool + half * D;
  // Where position t < cached of this row's sequence lies in either half of the pool; from
  // `cached` on, the step's row of that position (rows of one sequence are consecutive, the last
  // of them is r's own).
  auto pooled = [&](unsigned t) -> u64 { return (((u64)table[t / BT] * KV + kh) * BT + t % BT) * D; };
  auto fresh = [&](unsigned t) -> u64 { return r + 1 + t - len; };
  const u64 qat = ((u64)r * H + h) * D;
  for (unsigned d = lane; d < D; d += 32) qs[d] = step.query(r, h, d) * scale;
  if (z == 0 && h % (H / KV) == 0) {
    const u64 row = pooled(len - 1);
    for (unsigned d = lane; d < D; d += 32) {
      keys[row + d] = step.key(r, kh, d);
      values[row + d] = step.value(r, kh, d);
    }
  }
  __syncthreads();
  float acc[MAX_COLS];
  for (int c = 0; c < MAX_COLS; ++c) acc[c] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (unsigned t0 = from; t0 < end; t0 += 32) {
    const unsigned t = t0 + lane;
    float s = -INFINITY;
    if (t < end && t < cached) {
      const T* key = keys + pooled(t);
      s = 0.0f;
      for (unsigned d = 0; d < D; ++d) s += qs[d] * ld(key, d);
    } else if (t < end) {
      s = 0.0f;
      for (unsigned d = 0; d < D; ++d) s += qs[d] * widen(step.key(fresh(t), kh, d));
    }
    float cmax = s;
    for (int o = 16; o > 0; o >>= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, o));
    const float mn = fmaxf(m, cmax);
    const float corr = expf(m - mn);
    const float p = t < end ? expf(s - mn) : 0.0f;
    float ps = p;
    for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    l = l * corr + ps;
    m = mn;
    for (int c = 0; c < MAX_COLS; ++c) acc[c] *= corr;
    const unsigned n = min(32u, end - t0);
    for (unsigned j = 0; j < n; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
      if (t0 + j < cached) {
        const T* value = values + pooled(t0 + j);
        for (int c = 0; c < MAX_COLS; ++c) {
          const unsigned d = lane + 32 * c;
          if (d < D) acc[c] += pj * ld(value, d);
        }
      } else {
        const u64 row = fresh(t0 + j);
        for (int c = 0; c < MAX_COLS; ++c) {
          const unsigned d = lane + 32 * c;
          if (d < D) acc[c] += pj * widen(step.value(row, kh, d));
        }
      }
    }
  }
  if (parts > 1) {
    // This part's record: its maximum and sum (-inf and 0 for an empty stretch), then its
    // values' unnormalised sums.
    float* rec = part + (((u64)r * H + h) * parts + z) * (D + 2);
    if (lane == 0) {
      rec[0] = m;
      rec[1] = l;
    }
    for (int c = 0; c < MAX_COLS; ++c) {
      const unsigned d = lane + 32 * c;
      if (d < D) rec[2 + d] = acc[c];
    }
    return;
  }
  const float inv = 1.0f / l;
  for (int c = 0; c < MAX_COLS; ++c) {
    const unsigned d = lane + 32 * c;
    if (d < D) st(out, qat + d, acc[c] * inv);
  }
}

// The parts of a split launch combined: block (r, h) rescales each part's sums to the parts'
// common maximum (part 0 always holds a key) and writes the row's output for head h.
template <typename T>
__device__ void paged_combine(const float* part, T* out, unsigned H, unsigned D, unsigned parts) {
  const unsigned r = blockIdx.x, h = blockIdx.y;
  const float* recs = part + ((u64)r * H + h) * parts * (D + 2);
  float m = -INFINITY;
  for (unsigned z = 0; z < parts; ++z) m = fmaxf(m, recs[z * (D + 2)]);
  float l = 0.0f;
  for (unsigned z = 0; z < parts; ++z) l += recs[z * (D + 2) + 1] * expf(recs[z * (D + 2)] - m);
  const float inv = 1.0f / l;
  for (unsigned d = threadIdx.x; d < D; d += blockDim.x) {
    float v = 0.0f;
    for (unsigned z = 0; z < parts; ++z) v += recs[z * (D + 2) + 2 + d] * expf(recs[z * (D + 2)] - m);
    st(out, ((u64)r * H + h) * D + d, v * inv);
  }
}

#define PAGED(T, S)                                                                               \
  extern "C" __global__ void paged_attention_##S(                                                 \
      const T* q, const T* k_new, const T* v_new, T* pool, const unsigned* meta, T* out,          \
      float* part, unsigned R, unsigned H, unsigned KV, unsigned D, unsigned BT, u64 half,        \
      float scale) {                                                                              \
    const SplitHeads<T> step{q, k_new, v_new, H, KV, D};                                          \
    paged_attention(step, pool, meta, out, part, R, H, KV, D, BT, half, scale);                   \
  }                                                                                               \
  extern "C" __global__ void paged_attention_qkv_##S(                                             \
      const T* qkv, const T* bias, unsigned has_bias, const T* cos, const T* sin, T* pool,        \
      const unsigned* meta, T* out, float* part, unsigned R, unsigned H, unsigned KV, unsigned D, \
      unsigned BT, u64 half, float scale) {                                                       \
    const StackedHeads<T> step{qkv, bias, cos, sin, has_bias, H, KV, D};                          \
    paged_attention(step, pool, meta, out, part, R, H, KV, D, BT, half, scale);                   \
  }                                                                                               \
  extern "C" __global__ void paged_combine_##S(const float* part, T* out, unsigned H, unsigned D, \
                                               unsigned parts) {                                  \
    paged_combine(part, out, H, D, parts);                                                        \
  }

PAGED(float, f32)
PAGED(bf16, bf16)

// A step's new keys and values written into a layer's pool in one launch. The pool holds the
// keys in its first `half` rows and the values in the next `half`; row i of `k` and of `v`
// (`width` elements) goes to row rows[i] of each half. Elements are copied as words of their
// size, so one kernel serves every element type of that size.
template <typename U>
__device__ void kv_rows(const U* k, const U* v, const unsigned* rows, U* pool, unsigned n,
                        unsigned width, u64 half) {
  GRID_STRIDE(i, (u64)n * width) {
    const u64 at = (u64)rows[i / width] * width + i % width;
    pool[at] = k[i];
    pool[half * width + at] = v[i];
  }
}

#define KV_ROWS(U, S)                                                                             \
  extern "C" __global__ void kv_rows_##S(const U* k, const U* v, const unsigned* rows, U* pool,  \
                                         unsigned n, unsigned width, u64 half) {                  \
    kv_rows(k, v, rows, pool, n, width, half);                                                    \
  }

KV_ROWS(unsigned short, b2)
KV_ROWS(unsigned, b4)
KV_ROWS(u64, b8)
