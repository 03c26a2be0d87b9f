// Shared by Sluice's training kernels: element loads and stores that widen bf16 to f32 and round
// back once (every sum, statistic and exponential runs in f32), and a deterministic block sum.
// Compiled by nvcc (build.rs) and, for the CPU tests, by a C++ compiler over an emulation of
// the execution model (crates/model/tests/cuda_emu).
#pragma once

#ifndef SLUICE_CUDA_EMU
#include <cuda_bf16.h>
#endif

typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;

__device__ __forceinline__ float ld(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16* p, u64 i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16* p, u64 i, float v) { p[i] = __float2bfloat16(v); }

// `v` rounded to T, and a T widened back (the value a store then a load gives).
template <typename T>
__device__ __forceinline__ T rounded(float v) {
  T t;
  st(&t, 0, v);
  return t;
}
template <typename T>
__device__ __forceinline__ float widen(T v) {
  return ld(&v, 0);
}

// The rotation of the pair (x1, x2) = (x[j], x[j + d/2]) of a head by its angle j (cosine c,
// sine s; the rotate-half convention of Llama and Qwen): the new x[j], and the new x[j + d/2].
// One expression for every kernel that rotates, so each rounds alike.
__device__ __forceinline__ float rope_first(float x1, float x2, float c, float s) {
  return x1 * c - x2 * s;
}
__device__ __forceinline__ float rope_second(float x1, float x2, float c, float s) {
  return x2 * c + x1 * s;
}

constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;

// 2^x in one instruction (relative error about 2^-22; results below 2^-126 are flushed to 0).
__device__ __forceinline__ float exp2_fast(float x) {
#ifdef SLUICE_CUDA_EMU
  return std::exp2(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Whether some query of slots i_lo..=i_hi sees some key of slots j_lo..=j_hi (one row, `b`, of
// L slots) by the batch's tile mask (crates/model/src/fused/attention/tiles.rs): per row and
// tile of 64 queries, a bit per tile of 64 keys. Every thread of a block reads the same words,
// so a loop that skips by it stays uniform.
__device__ __forceinline__ bool tiles_meet(const unsigned* tiles, unsigned b, unsigned L,
                                           unsigned i_lo, unsigned i_hi, unsigned j_lo,
                                           unsigned j_hi) {
  const unsigned T = (L + 63) / 64, W = (T + 31) / 32;
  for (unsigned qt = i_lo / 64; qt <= i_hi / 64; ++qt)
    for (unsigned kt = j_lo / 64; kt <= j_hi / 64; ++kt)
      if ((tiles[((u64)b * T + qt) * W + kt / 32] >> (kt % 32)) & 1u) return true;
  return false;
}

// Values of T a 16-byte load moves, and whether `n` values at `p` start on a 16-byte boundary
// and fill whole loads (then every later run of `n` does too).
template <typename T>
constexpr unsigned VEC = 16 / sizeof(T);
template <typename T>
__device__ __forceinline__ bool vec_aligned(const T* p, u64 n) {
  return ((u64)(const void*)p | (n * sizeof(T))) % 16 == 0;
}

// VEC<T> values at `p` (16-byte aligned) in one load, widened to f32.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&z)[VEC<T>]) {
  const uint4 w = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
  for (unsigned i = 0; i < VEC<T>; ++i) z[i] = ld(e, i);
}

// VEC<T> values each rounded once to T, stored at `p` (16-byte aligned) in one store.
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&z)[VEC<T>]) {
  uint4 w;
  T* e = reinterpret_cast<T*>(&w);
#pragma unroll
  for (unsigned i = 0; i < VEC<T>; ++i) st(e, i, z[i]);
  *reinterpret_cast<uint4*>(p) = w;
}

#define GRID_STRIDE(i, n)                                                                         \
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// The sum of one value per thread, returned to every thread: lanes by butterfly shuffles, then
// the warps' partial sums in a fixed order, so the result does not depend on scheduling.
// blockDim.x must be a multiple of 32 (at most 1024), and every thread of the block must call it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // the previous call's readers are done with `part`
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.0f;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) s += part[w];
  return s;
}

// The largest of one value per thread, returned to every thread (as `block_sum`).
__device__ __forceinline__ float block_max(float v) {
  __shared__ float part[32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float m = -INFINITY;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) m = fmaxf(m, part[w]);
  return m;
}

// A kernel's dynamic shared memory (the launch gives its size). The emulation runs one block at
// a time, so a static buffer stands in.
#ifdef SLUICE_CUDA_EMU
#define SLUICE_DYNAMIC_SHARED(name) static unsigned char name[128 * 1024] __attribute__((aligned(128)))
#else
#define SLUICE_DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif
