// The training loss's token scores on the GPU, one block per row of logits (the vocabulary):
// log p(target) and the entropy of softmax(z / T) forward, and the gradient with respect to the
// logits backward, each row's statistics recomputed in f32 from the logits (f32 or bf16). The
// product forming the logits stays on cuBLAS; these replace the dozen elementwise and reduction
// kernels per chunk of rows that the composition in crates/model/src/scores.rs launches.
//
// With z = logit / T, m = max z, s = sum exp(z - m):  log p_j = z_j - m - ln s,
// H = -sum p_j log p_j = ln s - sum exp(z_j - m) (z_j - m) / s, and for the output gradients
// (g_lp, g_H):  dL/dlogit_j = (-p_j (g_lp + g_H (log p_j + H)) + g_lp [j = target]) / T.

#include "common.cuh"

// m, ln s and H of one row, in every thread.
template <typename T>
__device__ void row_stats(const T* z, unsigned V, float inv_t, float& m, float& ln_s, float& h) {
  float mx = -INFINITY;
  for (unsigned j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, ld(z, j) * inv_t);
  m = block_max(mx);
  float s = 0.0f, sz = 0.0f;
  for (unsigned j = threadIdx.x; j < V; j += blockDim.x) {
    const float d = ld(z, j) * inv_t - m;
    const float e = expf(d);
    s += e;
    sz += e * d;
  }
  s = block_sum(s);
  sz = block_sum(sz);
  ln_s = logf(s);
  h = ln_s - sz / s;
}

// out (rows, 2) f32: log p(target), entropy.
template <typename T>
__device__ void scores_fwd(const T* logits, const unsigned* targets, float* out, unsigned V,
                           float inv_t) {
  const T* z = logits + (u64)blockIdx.x * V;
  float m, ln_s, h;
  row_stats(z, V, inv_t, m, ln_s, h);
  if (threadIdx.x == 0) {
    out[2 * (u64)blockIdx.x] = ld(z, targets[blockIdx.x]) * inv_t - m - ln_s;
    out[2 * (u64)blockIdx.x + 1] = h;
  }
}

// gz (rows, V) like the logits, from grad (rows, 2) f32.
template <typename T>
__device__ void scores_bwd(const T* logits, const unsigned* targets, const float* grad, T* gz,
                           unsigned V, float inv_t) {
  const u64 at = (u64)blockIdx.x * V;
  float m, ln_s, h;
  row_stats(logits + at, V, inv_t, m, ln_s, h);
  const float g_lp = grad[2 * (u64)blockIdx.x], g_h = grad[2 * (u64)blockIdx.x + 1];
  const unsigned t = targets[blockIdx.x];
  for (unsigned j = threadIdx.x; j < V; j += blockDim.x) {
    const float logp = ld(logits, at + j) * inv_t - m - ln_s;
    float g = -expf(logp) * (g_lp + g_h * (logp + h));
    if (j == t) g += g_lp;
    st(gz, at + j, g * inv_t);
  }
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
