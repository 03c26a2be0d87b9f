// The training loss's token scores on the GPU, one block per row of logits (the vocabulary):
// log p(target) and the entropy of softmax(z / T) forward, and the gradient with respect to the
// logits backward, each row's statistics recomputed in f32 from the logits (f32 or bf16). The
// product forming the logits stays on cuBLAS; these replace the dozen elementwise and reduction
// kernels per chunk of rows that the composition in crates/model/src/scores.rs launches.
//
// With z = logit / T, m = max z, s = sum exp(z - m):  log p_j = z_j - m - ln s,
// H = -sum p_j log p_j = ln s - sum exp(z_j - m) (z_j - m) / s, and for the output gradients
// (g_lp, g_H):  dL/dlogit_j = (-p_j (g_lp + g_H (log p_j + H)) + g_lp [j = target]) / T.
//
// The kernels are bound by memory (a row of Qwen2.5's vocabulary is 304 KB in bf16), so a row
// is read as few times as the arithmetic allows, 16 bytes a load: the statistics in one pass
// (a running max, the sums rescaled when it moves, as an online softmax keeps them), so the
// forward reads its row once and the backward twice, then writes the gradient. (Until
// 2026-11-30 the statistics took two passes of one value a load: two reads forward, three
// backward.) The statistics are kept in base 2 (z scaled by log2(e) as it is read, each
// exponential one `ex2.approx`), converted to nats for what the kernels return.

#include "common.cuh"

// A thread's share of a row, z in base 2 (z / T times log2(e)): its largest z, s = sum 2^(z - m)
// and sz = sum 2^(z - m) (z - m) over the values it has read (s = 0 before the first).
struct RowStats {
  float m = -INFINITY, s = 0.0f, sz = 0.0f;

  // Moves the max to `m2` (>= m), rescaling the sums: 2^(z - m2) = c 2^(z - m) with
  // c = 2^(m - m2), and z - m2 = (z - m) + (m - m2).
  __device__ __forceinline__ void rebase(float m2) {
    if (s > 0.0f) {
      const float d = m - m2, c = exp2_fast(d);
      sz = c * (sz + d * s);
      s *= c;
    }
    m = m2;
  }
  // Adds the N values of `z`, whose largest is `mx`.
  template <unsigned N>
  __device__ __forceinline__ void add(const float (&z)[N], float mx) {
    if (mx > m) rebase(mx);
#pragma unroll
    for (unsigned i = 0; i < N; ++i) {
      const float d = z[i] - m, e = exp2_fast(d);
      s += e;
      sz += e * d;
    }
  }
};

// The statistics of one row, in every thread: m2 = max z and ls2 = log2 s in base 2, and the
// entropy H in nats. One pass over the row, then the threads' shares rebased on the row's max
// and summed in a fixed order (`block_sum`).
template <typename T>
__device__ void row_stats(const T* z, unsigned V, float k2, float& m2, float& ls2, float& h) {
  RowStats r;
  if (vec_aligned(z, V)) {
    for (unsigned c = threadIdx.x; c < V / VEC<T>; c += blockDim.x) {
      float v[VEC<T>];
      load_vec(z + (u64)c * VEC<T>, v);
#pragma unroll
      for (unsigned i = 0; i < VEC<T>; ++i) v[i] *= k2;
      float mx = v[0];
#pragma unroll
      for (unsigned i = 1; i < VEC<T>; ++i) mx = fmaxf(mx, v[i]);
      r.add(v, mx);
    }
  } else {
    for (unsigned j = threadIdx.x; j < V; j += blockDim.x) {
      const float v[1] = {ld(z, j) * k2};
      r.add(v, v[0]);
    }
  }
  m2 = block_max(r.m);
  r.rebase(m2);
  const float s = block_sum(r.s), sz = block_sum(r.sz);
  ls2 = log2f(s);
  h = (ls2 - sz / s) * LN2;
}

// out (rows, 2) f32: log p(target), entropy.
template <typename T>
__device__ void scores_fwd(const T* logits, const unsigned* targets, float* out, unsigned V,
                           float inv_t) {
  const T* z = logits + (u64)blockIdx.x * V;
  const float k2 = inv_t * LOG2E;
  float m2, ls2, h;
  row_stats(z, V, k2, m2, ls2, h);
  if (threadIdx.x == 0) {
    out[2 * (u64)blockIdx.x] = (ld(z, targets[blockIdx.x]) * k2 - m2 - ls2) * LN2;
    out[2 * (u64)blockIdx.x + 1] = h;
  }
}

// gz (rows, V) like the logits, from grad (rows, 2) f32.
template <typename T>
__device__ void scores_bwd(const T* logits, const unsigned* targets, const float* grad, T* gz,
                           unsigned V, float inv_t) {
  const u64 at = (u64)blockIdx.x * V;
  const float k2 = inv_t * LOG2E;
  float m2, ls2, h;
  row_stats(logits + at, V, k2, m2, ls2, h);
  const float g_lp = grad[2 * (u64)blockIdx.x], g_h = grad[2 * (u64)blockIdx.x + 1];
  const unsigned t = targets[blockIdx.x];
  // The gradient at column j of the value z (base 2): log2 p = z - m2 - ls2.
  const auto grad_at = [&](float z, unsigned j) {
    const float l2 = z - m2 - ls2, logp = l2 * LN2;
    const float g = -exp2_fast(l2) * (g_lp + g_h * (logp + h)) + (j == t ? g_lp : 0.0f);
    return g * inv_t;
  };
  if (vec_aligned(logits, V) && vec_aligned(gz, V)) {
    for (unsigned c = threadIdx.x; c < V / VEC<T>; c += blockDim.x) {
      float v[VEC<T>];
      load_vec(logits + at + (u64)c * VEC<T>, v);
#pragma unroll
      for (unsigned i = 0; i < VEC<T>; ++i) v[i] = grad_at(v[i] * k2, c * VEC<T> + i);
      store_vec(gz + at + (u64)c * VEC<T>, v);
    }
    return;
  }
  for (unsigned j = threadIdx.x; j < V; j += blockDim.x)
    st(gz, at + j, grad_at(ld(logits, at + j) * k2, j));
}

#define SCORES(T, S)                                                                              \
  extern "C" __global__ void scores_fwd_##S(const T* logits, const unsigned* targets, float* out, \
                                            unsigned V, float inv_t) {                            \
    scores_fwd(logits, targets, out, V, inv_t);                                                   \
  }                                                                                               \
  extern "C" __global__ void scores_bwd_##S(const T* logits, const unsigned* targets,             \
                                            const float* grad, T* gz, unsigned V, float inv_t) {  \
    scores_bwd(logits, targets, grad, gz, V, inv_t);                                              \
  }

SCORES(float, f32)
SCORES(bf16, bf16)
