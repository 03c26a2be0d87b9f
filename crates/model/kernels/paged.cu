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
// positions from the sequence's cached length on come from the step's own `k_new` / `v_new`.
//
// The pool holds the keys in its first `half` rows and the values in the next `half`. Rows are
// head-major in blocks: key t of kv head h of a sequence with block table `tbl` is row
// (tbl[t / BT] * KV + h) * BT + t % BT, rows of D elements. `meta` holds, per query row r, the
// start of its table in `meta[3R..]`, its visible length and its sequence's cached length (before
// the step), then the tables. The step's rows of one sequence are consecutive, in order.

#include "common.cuh"

// Head dims up to 32 * MAX_COLS.
#define MAX_COLS 8

template <typename T>
__device__ void paged_attention(const T* q, const T* k_new, const T* v_new, T* pool,
                                const unsigned* meta, T* out, unsigned R, unsigned H, unsigned KV,
                                unsigned D, unsigned BT, u64 half, float scale) {
  __shared__ float qs[32 * MAX_COLS];
  const unsigned r = blockIdx.x, h = blockIdx.y, kh = h / (H / KV), lane = threadIdx.x;
  const unsigned len = meta[3 * r + 1], cached = meta[3 * r + 2];
  const unsigned* table = meta + 3 * (u64)R + meta[3 * r];
  T* keys = pool;
  T* values = pool + half * D;
  // Where key (value) t of this row's sequence starts: the pool below `cached`, else the step's
  // row of that position (rows of one sequence are consecutive, the last of them is r's own).
  auto at = [&](unsigned t, const T* cache, const T* fresh) -> const T* {
    if (t < cached) return cache + (((u64)table[t / BT] * KV + kh) * BT + t % BT) * D;
    return fresh + ((u64)(r + 1 + t - len) * KV + kh) * D;
  };
  const u64 qat = ((u64)r * H + h) * D;
  for (unsigned d = lane; d < D; d += 32) qs[d] = ld(q, qat + d) * scale;
  if (h % (H / KV) == 0) {
    const unsigned t = len - 1;
    const u64 row = ((u64)table[t / BT] * KV + kh) * BT + t % BT;
    const u64 from = ((u64)r * KV + kh) * D;
    for (unsigned d = lane; d < D; d += 32) {
      keys[row * D + d] = k_new[from + d];
      values[row * D + d] = v_new[from + d];
    }
  }
  __syncthreads();
  float acc[MAX_COLS];
  for (int c = 0; c < MAX_COLS; ++c) acc[c] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (unsigned t0 = 0; t0 < len; t0 += 32) {
    const unsigned t = t0 + lane;
    float s = -INFINITY;
    if (t < len) {
      const T* key = at(t, keys, k_new);
      s = 0.0f;
      for (unsigned d = 0; d < D; ++d) s += qs[d] * ld(key, d);
    }
    float cmax = s;
    for (int o = 16; o > 0; o >>= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, o));
    const float mn = fmaxf(m, cmax);
    const float corr = expf(m - mn);
    const float p = t < len ? expf(s - mn) : 0.0f;
    float ps = p;
    for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    l = l * corr + ps;
    m = mn;
    for (int c = 0; c < MAX_COLS; ++c) acc[c] *= corr;
    const unsigned n = min(32u, len - t0);
    for (unsigned j = 0; j < n; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
      const T* value = at(t0 + j, values, v_new);
      for (int c = 0; c < MAX_COLS; ++c) {
        const unsigned d = lane + 32 * c;
        if (d < D) acc[c] += pj * ld(value, d);
      }
    }
  }
  const float inv = 1.0f / l;
  for (int c = 0; c < MAX_COLS; ++c) {
    const unsigned d = lane + 32 * c;
    if (d < D) st(out, qat + d, acc[c] * inv);
  }
}

#define PAGED(T, S)                                                                               \
  extern "C" __global__ void paged_attention_##S(                                                 \
      const T* q, const T* k_new, const T* v_new, T* pool, const unsigned* meta, T* out,          \
      unsigned R, unsigned H, unsigned KV, unsigned D, unsigned BT, u64 half, float scale) {      \
    paged_attention(q, k_new, v_new, pool, meta, out, R, H, KV, D, BT, half, scale);              \
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
