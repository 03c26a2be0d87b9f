// AdamW over contiguous f32 buffers, in place. Every operation is rounded on its own (the _rn
// intrinsics forbid fused multiply-adds), in the order of the composition of candle ops in
// crates/trainer/src/adamw_kernel.rs, so both give the same bits. `x * c + 0` is written out
// as the composition's `affine(c, 0)` computes it (it turns -0 into +0).

#include "common.cuh"

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

// Every parameter of a step in one launch: block b updates `chunk_len[b]` elements from element
// `chunk_at[b]` of parameter `chunk_param[b]`, whose weights, moments and gradient are at the
// device addresses p[.], m[.], v[.], g[.]. Each element takes the operations of the two kernels
// above, in their order, so the bits are theirs.
extern "C" __global__ void adamw_many_f32(const u64* p, const u64* m, const u64* v, const u64* g,
                                          const unsigned* chunk_param, const u64* chunk_at,
                                          const unsigned* chunk_len, float clip, float b1,
                                          float nb1, float b2, float nb2, float c1, float c2,
                                          float eps, float lr, float decay) {
  const unsigned c = blockIdx.x, t = chunk_param[c];
  const u64 at = chunk_at[c];
  float* pp = (float*)p[t] + at;
  float* mm = (float*)m[t] + at;
  float* vv = (float*)v[t] + at;
  const float* gg = (const float*)g[t] + at;
  for (unsigned i = threadIdx.x; i < chunk_len[c]; i += blockDim.x) {
    const float gi = affine0(gg[i], clip);
    const float mi = __fadd_rn(affine0(mm[i], b1), affine0(gi, nb1));
    const float vi = __fadd_rn(affine0(vv[i], b2), affine0(__fmul_rn(gi, gi), nb2));
    mm[i] = mi;
    vv[i] = vi;
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(affine0(vi, c2)), 1.0f), eps);
    const float adam = __fdiv_rn(affine0(mi, c1), denom);
    pp[i] = __fsub_rn(affine0(pp[i], decay), affine0(adam, lr));
  }
}

// partial[c] = the sum of squares of chunk c (laid out as for adamw_many_f32) of the buffers at
// the device addresses g[.]: f32 sums in a fixed order within the block; the host adds the
// chunks' sums in f64. The global gradient norm of a step in one launch.
extern "C" __global__ void sumsq_many_f32(const u64* g, const unsigned* chunk_param,
                                          const u64* chunk_at, const unsigned* chunk_len,
                                          float* partial) {
  const unsigned c = blockIdx.x;
  const float* x = (const float*)g[chunk_param[c]] + chunk_at[c];
  float s = 0.0f;
  for (unsigned i = threadIdx.x; i < chunk_len[c]; i += blockDim.x) s += x[i] * x[i];
  s = block_sum(s);
  if (threadIdx.x == 0) partial[c] = s;
}

// The published snapshot of every parameter in one launch: chunk c (laid out as for
// adamw_many_f32) of the f32 buffer at src[.] converted to bf16 (to_bf16 != 0, rounded to
// nearest even, as candle's conversion rounds) or copied as f32, into the buffer at dst[.].
extern "C" __global__ void snapshot_many_f32(const u64* src, const u64* dst,
                                             const unsigned* chunk_param, const u64* chunk_at,
                                             const unsigned* chunk_len, int to_bf16) {
  const unsigned c = blockIdx.x, t = chunk_param[c];
  const u64 at = chunk_at[c];
  const float* s = (const float*)src[t] + at;
  if (to_bf16) {
    bf16* d = (bf16*)dst[t] + at;
    for (unsigned i = threadIdx.x; i < chunk_len[c]; i += blockDim.x) d[i] = __float2bfloat16(s[i]);
  } else {
    float* d = (float*)dst[t] + at;
    for (unsigned i = threadIdx.x; i < chunk_len[c]; i += blockDim.x) d[i] = s[i];
  }
}

// One micro-batch's gradients added to the step's f32 sums, every parameter in one launch
// (chunks laid out as for adamw_many_f32): sum[t] = (ACC_FRESH ? 0 : sum[t]) + (g[t] + h[t]),
// the gradients read as f32 from f32 or bf16 buffers, h only where ACC_H says there is one (a
// tied embedding's gathered rows and its LM head). Each addition is rounded on its own, in that
// order: the bits of converting each gradient and adding them tensor by tensor.
#define ACC_FRESH 1u
#define ACC_G_BF16 2u
#define ACC_H 4u
#define ACC_H_BF16 8u

__device__ __forceinline__ float acc_read(u64 base, u64 i, bool is_bf16) {
  return is_bf16 ? __bfloat162float(((const bf16*)base)[i]) : ((const float*)base)[i];
}

extern "C" __global__ void accumulate_many_f32(const u64* sum, const u64* g, const u64* h,
                                               const unsigned* flags, const unsigned* chunk_param,
                                               const u64* chunk_at, const unsigned* chunk_len) {
  const unsigned c = blockIdx.x, t = chunk_param[c], f = flags[t];
  const u64 at = chunk_at[c];
  float* s = (float*)sum[t] + at;
  for (unsigned i = threadIdx.x; i < chunk_len[c]; i += blockDim.x) {
    float x = acc_read(g[t], at + i, f & ACC_G_BF16);
    if (f & ACC_H) x = __fadd_rn(x, acc_read(h[t], at + i, f & ACC_H_BF16));
    s[i] = __fadd_rn((f & ACC_FRESH) ? 0.0f : s[i], x);
  }
}
