// The training forward's fused ops on the GPU, forward and backward: RMSNorm, SwiGLU and rotary
// embeddings over contiguous rows, for f32 and bf16 tensors (`_f32` / `_bf16`). The mathematics
// is the CPU kernels' (crates/model/src/fused/elementwise.rs, rope.rs); every statistic and
// transcendental runs in f32 and each output is rounded once to the tensor's dtype.

#include "common.cuh"

// ---- RMSNorm: one block per row of d ----

// 1 / sqrt(mean(row^2) + eps) of the block's row, in every thread.
template <typename T>
__device__ float row_inv(const T* row, unsigned d, float eps) {
  float ss = 0.0f;
  for (unsigned j = threadIdx.x; j < d; j += blockDim.x) {
    const float v = ld(row, j);
    ss += v * v;
  }
  return 1.0f / sqrtf(block_sum(ss) / d + eps);
}

// y = w * x / sqrt(mean(x^2) + eps)
template <typename T>
__device__ void rms_fwd(const T* x, const T* w, T* y, unsigned d, float eps) {
  const u64 at = (u64)blockIdx.x * d;
  const float inv = row_inv(x + at, d, eps);
  for (unsigned j = threadIdx.x; j < d; j += blockDim.x) st(y, at + j, ld(x, at + j) * inv * ld(w, j));
}

// The engine's residual add and the norm after it: sum = x + y (rounded to T, as a separate add
// would store it), normed = w * sum / sqrt(mean(sum^2) + eps). Each thread reads back only the
// elements it wrote (row_inv strides over the row as the first loop does).
template <typename T>
__device__ void add_rms_fwd(const T* x, const T* y, const T* w, T* sum, T* normed, unsigned d,
                            float eps) {
  const u64 at = (u64)blockIdx.x * d;
  for (unsigned j = threadIdx.x; j < d; j += blockDim.x) st(sum, at + j, ld(x, at + j) + ld(y, at + j));
  const float inv = row_inv(sum + at, d, eps);
  for (unsigned j = threadIdx.x; j < d; j += blockDim.x)
    st(normed, at + j, ld(sum, at + j) * inv * ld(w, j));
}

// dx = inv * (w*g - xh * sum(w*g*xh) / d) with xh = x*inv; inv per row into `inv_out` (f32) for
// the weight's gradient.
template <typename T>
__device__ void rms_bwd_dx(const T* x, const T* w, const T* g, T* dx, float* inv_out, unsigned d,
                           float eps) {
  const u64 at = (u64)blockIdx.x * d;
  const float inv = row_inv(x + at, d, eps);
  float dot = 0.0f;
  for (unsigned j = threadIdx.x; j < d; j += blockDim.x)
    dot += ld(w, j) * ld(g, at + j) * ld(x, at + j) * inv;
  const float c = block_sum(dot) / d;
  for (unsigned j = threadIdx.x; j < d; j += blockDim.x)
    st(dx, at + j, inv * (ld(w, j) * ld(g, at + j) - ld(x, at + j) * inv * c));
  if (threadIdx.x == 0) inv_out[blockIdx.x] = inv;
}

// part[chunk][col] = sum over the chunk's rows of g * x * inv: grid (columns / blockDim, chunks).
template <typename T>
__device__ void rms_bwd_dw_part(const T* x, const T* g, const float* inv, float* part,
                                unsigned rows, unsigned d, unsigned chunk_rows) {
  const unsigned col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= d) return;
  const unsigned r0 = blockIdx.y * chunk_rows;
  const unsigned r1 = min(rows, r0 + chunk_rows);
  float s = 0.0f;
  for (unsigned r = r0; r < r1; ++r) s += ld(g, (u64)r * d + col) * ld(x, (u64)r * d + col) * inv[r];
  part[(u64)blockIdx.y * d + col] = s;
}

// dw[col] = the chunks' partial sums, in chunk order.
template <typename T>
__device__ void rms_bwd_dw_sum(const float* part, T* dw, unsigned chunks, unsigned d) {
  const unsigned col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= d) return;
  float s = 0.0f;
  for (unsigned c = 0; c < chunks; ++c) s += part[(u64)c * d + col];
  st(dw, col, s);
}

// ---- SwiGLU, elementwise over n ----

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// SwiGLU is bound by memory (at [8, 2048] on Qwen2.5-0.5B's shapes about 78 KB a token and
// layer, forward and backward): where every tensor starts on a 16-byte boundary and n fills whole
// loads, each thread moves 16 bytes a load (8 bf16 or 4 f32), else one value.

// out = silu(gate) * up
template <typename T>
__device__ void swiglu_fwd(const T* gate, const T* up, T* out, u64 n) {
  const auto one = [](float g, float u) { return g * sigmoid(g) * u; };
  if (vec_aligned(gate, n) && vec_aligned(up, n) && vec_aligned(out, n)) {
    GRID_STRIDE(c, n / VEC<T>) {
      float g[VEC<T>], u[VEC<T>];
      load_vec(gate + c * VEC<T>, g);
      load_vec(up + c * VEC<T>, u);
#pragma unroll
      for (unsigned k = 0; k < VEC<T>; ++k) g[k] = one(g[k], u[k]);
      store_vec(out + c * VEC<T>, g);
    }
    return;
  }
  GRID_STRIDE(i, n) st(out, i, one(ld(gate, i), ld(up, i)));
}

// grads[0..n) = d gate = grad * up * s * (1 + gate * (1 - s)),  grads[n..2n) = d up = grad * silu(gate)
template <typename T>
__device__ void swiglu_bwd(const T* gate, const T* up, const T* grad, T* grads, u64 n) {
  // d gate into `g`'s place and d up into `u`'s, from gate g, up u and the gradient r.
  const auto one = [](float& g, float& u, float r) {
    const float s = sigmoid(g), dg = r * u * s * (1.0f + g * (1.0f - s));
    u = r * g * s;
    g = dg;
  };
  if (vec_aligned(gate, n) && vec_aligned(up, n) && vec_aligned(grad, n) &&
      vec_aligned(grads, n)) {
    GRID_STRIDE(c, n / VEC<T>) {
      float g[VEC<T>], u[VEC<T>], r[VEC<T>];
      load_vec(gate + c * VEC<T>, g);
      load_vec(up + c * VEC<T>, u);
      load_vec(grad + c * VEC<T>, r);
#pragma unroll
      for (unsigned k = 0; k < VEC<T>; ++k) one(g[k], u[k], r[k]);
      store_vec(grads + c * VEC<T>, g);
      store_vec(grads + n + c * VEC<T>, u);
    }
    return;
  }
  GRID_STRIDE(i, n) {
    float g = ld(gate, i), u = ld(up, i);
    one(g, u, ld(grad, i));
    st(grads, i, g);
    st(grads, n + i, u);
  }
}

// ---- rotary embedding ("rotate half") over rows of heads of d ----

// Each pair (j, j + d/2) of every head of every row rotated by the row's angle j (`sign` -1: the
// transpose, for the backward). cos and sin are (rows, d/2).
template <typename T>
__device__ void rope(const T* x, const T* cos, const T* sin, T* y, u64 rows, unsigned width,
                     unsigned d, float sign) {
  const unsigned half = d / 2, pairs = width / 2;
  GRID_STRIDE(p, rows * pairs) {
    const u64 row = p / pairs;
    const unsigned rem = (unsigned)(p % pairs), head = rem / half, j = rem % half;
    const u64 at = row * width + (u64)head * d + j;
    const float c = ld(cos, row * half + j), s = sign * ld(sin, row * half + j);
    const float x1 = ld(x, at), x2 = ld(x, at + half);
    st(y, at, rope_first(x1, x2, c, s));
    st(y, at + half, rope_second(x1, x2, c, s));
  }
}

// ---- the engine's stacked products, split ----

// One row of `qkv` (rows, (hq + 2 hk) d) holds a token's q, k and v heads side by side (one
// product with the stacked weights); `bias` ((hq + 2 hk) d) is added to every row when
// `has_bias`. Each pair (j, j + d/2) goes to its own output: q's and k's rotated by the row's
// angle j as `rope` does, v's copied.
template <typename T>
__device__ void split_rope(const T* qkv, const T* bias, unsigned has_bias, const T* cos,
                           const T* sin, T* q, T* k, T* v, u64 rows, unsigned hq, unsigned hk,
                           unsigned d) {
  const unsigned half = d / 2, pairs = (hq + 2 * hk) * half, width = 2 * pairs;
  GRID_STRIDE(p, rows * pairs) {
    const u64 row = p / pairs;
    const unsigned rem = (unsigned)(p % pairs), head = rem / half, j = rem % half;
    const u64 at = row * width + (u64)head * d + j;
    const unsigned col = head * d + j;
    float x1 = ld(qkv, at), x2 = ld(qkv, at + half);
    if (has_bias) x1 += ld(bias, col), x2 += ld(bias, col + half);
    T* out;
    u64 to;
    if (head < hq) {
      out = q, to = (row * hq + head) * d + j;
    } else if (head < hq + hk) {
      out = k, to = (row * hk + head - hq) * d + j;
    } else {
      st(v, (row * hk + head - hq - hk) * d + j, x1);
      st(v, (row * hk + head - hq - hk) * d + j + half, x2);
      continue;
    }
    const float c = ld(cos, row * half + j), s = ld(sin, row * half + j);
    st(out, to, rope_first(x1, x2, c, s));
    st(out, to + half, rope_second(x1, x2, c, s));
  }
}

// out (rows, inter) = silu(gate) * up, where each row of `gate_up` (rows, 2 inter) is a token's
// gate then up (one product with the stacked weights).
template <typename T>
__device__ void swiglu_rows(const T* gate_up, T* out, u64 rows, unsigned inter) {
  GRID_STRIDE(i, rows * inter) {
    const u64 row = i / inter, at = row * 2 * inter + i % inter;
    const float g = ld(gate_up, at);
    st(out, i, g * sigmoid(g) * ld(gate_up, at + inter));
  }
}

#define FOR_EACH_DTYPE(M) M(float, f32) M(bf16, bf16)

#define INSTANCES(T, S)                                                                           \
  extern "C" __global__ void rms_fwd_##S(const T* x, const T* w, T* y, unsigned d, float eps) {   \
    rms_fwd(x, w, y, d, eps);                                                                     \
  }                                                                                               \
  extern "C" __global__ void add_rms_fwd_##S(const T* x, const T* y, const T* w, T* sum,        \
                                             T* normed, unsigned d, float eps) {                  \
    add_rms_fwd(x, y, w, sum, normed, d, eps);                                                    \
  }                                                                                               \
  extern "C" __global__ void rms_bwd_dx_##S(const T* x, const T* w, const T* g, T* dx,            \
                                            float* inv, unsigned d, float eps) {                  \
    rms_bwd_dx(x, w, g, dx, inv, d, eps);                                                         \
  }                                                                                               \
  extern "C" __global__ void rms_bwd_dw_part_##S(const T* x, const T* g, const float* inv,        \
                                                 float* part, unsigned rows, unsigned d,          \
                                                 unsigned chunk_rows) {                           \
    rms_bwd_dw_part(x, g, inv, part, rows, d, chunk_rows);                                        \
  }                                                                                               \
  extern "C" __global__ void rms_bwd_dw_sum_##S(const float* part, T* dw, unsigned chunks,        \
                                                unsigned d) {                                     \
    rms_bwd_dw_sum(part, dw, chunks, d);                                                          \
  }                                                                                               \
  extern "C" __global__ void swiglu_fwd_##S(const T* gate, const T* up, T* out, u64 n) {          \
    swiglu_fwd(gate, up, out, n);                                                                 \
  }                                                                                               \
  extern "C" __global__ void swiglu_bwd_##S(const T* gate, const T* up, const T* grad, T* grads,  \
                                            u64 n) {                                              \
    swiglu_bwd(gate, up, grad, grads, n);                                                         \
  }                                                                                               \
  extern "C" __global__ void rope_##S(const T* x, const T* cos, const T* sin, T* y, u64 rows,     \
                                      unsigned width, unsigned d, float sign) {                   \
    rope(x, cos, sin, y, rows, width, d, sign);                                                   \
  }                                                                                               \
  extern "C" __global__ void split_rope_##S(const T* qkv, const T* bias, unsigned has_bias,       \
                                            const T* cos, const T* sin, T* q, T* k, T* v,         \
                                            u64 rows, unsigned hq, unsigned hk, unsigned d) {     \
    split_rope(qkv, bias, has_bias, cos, sin, q, k, v, rows, hq, hk, d);                          \
  }                                                                                               \
  extern "C" __global__ void swiglu_rows_##S(const T* gate_up, T* out, u64 rows,                  \
                                             unsigned inter) {                                    \
    swiglu_rows(gate_up, out, rows, inter);                                                       \
  }

FOR_EACH_DTYPE(INSTANCES)
