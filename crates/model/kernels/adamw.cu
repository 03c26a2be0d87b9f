// AdamW over contiguous f32 buffers, in place. Every operation is rounded on its own (the _rn
// intrinsics forbid fused multiply-adds), in the order of the composition of candle ops in
// crates/trainer/src/adamw_kernel.rs, so both give the same bits. `x * c + 0` is written out
// as the composition's `affine(c, 0)` computes it (it turns -0 into +0).

#define GRID_STRIDE(i, n) \
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (n); \
       i += (unsigned long long)blockDim.x * gridDim.x)

__device__ __forceinline__ float affine0(float x, float c) { return __fadd_rn(__fmul_rn(x, c), 0.0f); }

// m <- b*m + (1-b)*g'   (second == 0), or   v <- b*v + (1-b)*g'^2   (second != 0);  g' = clip*g.
extern "C" __global__ void adamw_moment_f32(float* dst, const float* g, unsigned long long n,
                                            float clip, float b, float nb, int second) {
  GRID_STRIDE(i, n) {
    float gi = affine0(g[i], clip);
    float term = second ? affine0(__fmul_rn(gi, gi), nb) : affine0(gi, nb);
    dst[i] = __fadd_rn(affine0(dst[i], b), term);
  }
}

// p <- (1 - lr*wd)*p - lr * (m*c1) / (sqrt(v*c2) + eps).
extern "C" __global__ void adamw_step_f32(float* p, const float* m, const float* v,
                                          unsigned long long n, float c1, float c2, float eps,
                                          float lr, float decay) {
  GRID_STRIDE(i, n) {
    float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(affine0(v[i], c2)), 1.0f), eps);
    float adam = __fdiv_rn(affine0(m[i], c1), denom);
    p[i] = __fsub_rn(affine0(p[i], decay), affine0(adam, lr));
  }
}
