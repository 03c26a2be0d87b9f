// Token choice on the GPU for rows of f32 logits, one block per row: only each row's token and
// behaviour log-probability leave the device. The mathematics is the engine's CPU sampler's
// (crates/engine/src/native/sampler.rs) without top-k/top-p: e = exp((z - max) / T) summed in
// f64 to Z; greedy rows (T = 0) take the first largest logit and report T = 1; sampled rows take
// the first token whose running sum of e exceeds u * Z, with u the row's uniform draw (made on
// the host from the request's seed and position, as the CPU makes it), else the last token; the
// log-probability is (z - max) / T - ln Z.

#define THREADS 256

// Larger wins, ties break low; NaN never wins.
__device__ __forceinline__ void better(float& v, unsigned int& i, float v2, unsigned int i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

extern "C" __global__ void sample_rows_f32(const float* logits, unsigned int vocab,
                                           const float* temperatures, const double* uniforms,
                                           unsigned int* tokens, float* logprobs) {
  __shared__ float s_val[THREADS];
  __shared__ unsigned int s_idx[THREADS];
  __shared__ double s_pre[THREADS];
  __shared__ double s_z;
  __shared__ unsigned int s_token;
  const unsigned int row = blockIdx.x, t = threadIdx.x;
  const float* z = logits + (unsigned long long)row * vocab;
  const float temp = temperatures[row];
  const bool greedy = !(temp > 1e-5f);
  const float inv_t = greedy ? 1.0f : 1.0f / temp;

  // The largest logit and its first index.
  float best = -INFINITY;
  unsigned int best_i = 0;
  for (unsigned int v = t; v < vocab; v += THREADS) better(best, best_i, z[v], v);
  s_val[t] = best;
  s_idx[t] = best_i;
  __syncthreads();
  for (unsigned int w = THREADS / 2; w > 0; w >>= 1) {
    if (t < w) better(s_val[t], s_idx[t], s_val[t + w], s_idx[t + w]);
    __syncthreads();
  }
  const float max = s_val[0];
  const unsigned int argmax = s_idx[0];

  // Each thread sums its own contiguous stretch, so prefix sums run in token order.
  const unsigned int per = (vocab + THREADS - 1) / THREADS;
  const unsigned int lo = min(vocab, t * per), hi = min(vocab, lo + per);
  double sum = 0.0;
  for (unsigned int v = lo; v < hi; ++v) sum += (double)expf((z[v] - max) * inv_t);
  s_pre[t] = sum;
  __syncthreads();
  if (t == 0) {
    double acc = 0.0;
    for (unsigned int i = 0; i < THREADS; ++i) {
      const double part = s_pre[i];
      s_pre[i] = acc;  // exclusive prefix
      acc += part;
    }
    s_z = acc;
    s_token = greedy ? argmax : vocab - 1;
  }
  __syncthreads();

  // The one stretch the target falls in (the stretches' intervals are disjoint) finds it.
  if (!greedy && lo < hi) {
    const double target = uniforms[row] * s_z;
    double acc = s_pre[t];
    if (acc <= target && acc + sum > target) {
      unsigned int found = hi - 1;
      for (unsigned int v = lo; v < hi; ++v) {
        acc += (double)expf((z[v] - max) * inv_t);
        if (acc > target) {
          found = v;
          break;
        }
      }
      s_token = found;
    }
  }
  __syncthreads();
  if (t == 0) {
    const unsigned int token = s_token;
    tokens[row] = token;
    logprobs[row] = (float)((double)((z[token] - max) * inv_t) - log(s_z));
  }
}
