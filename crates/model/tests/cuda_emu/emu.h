// A CPU emulation of the CUDA execution model, enough to run Sluice's training kernels
// (crates/model/kernels/*.cu) as C++ in the tests: every thread of a block is an OS thread, the
// blocks of a grid run one after another (so `__shared__` is one static array), `__syncthreads`
// is a barrier over the block and warp shuffles exchange through a per-warp barrier. It checks
// the kernels' indexing, masking and arithmetic without a GPU; speed, memory coalescing and
// races the real hardware could expose are for the GPU check (scripts/gpu-check). WMMA's tensor-
// core fragments are in wmma.h.
#pragma once
#define SLUICE_CUDA_EMU 1

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct __align__(16) uint4 {
  unsigned x, y, z, w;
};
struct __align__(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x = 1, unsigned y = 1, unsigned z = 1) : x(x), y(y), z(z) {}
};

inline thread_local uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {
inline std::barrier<>* block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<float> lanes;
}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
inline void __syncwarp() { emu::warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

namespace emu {
// Every lane of the calling thread's warp puts its 32-bit `v` in, then takes the value of lane
// `src(its own lane)`.
template <class T, class Src>
T exchange(T v, Src src) {
  static_assert(sizeof(T) == 4, "a shuffle moves 32 bits");
  const unsigned t = threadIdx.x;
  auto& warp = *warp_barriers[t / 32];
  std::memcpy(&lanes[t], &v, 4);
  warp.arrive_and_wait();
  T r;
  std::memcpy(&r, &lanes[(t & ~31u) | (src(t & 31u) & 31u)], 4);
  warp.arrive_and_wait();
  return r;
}
}  // namespace emu

template <class T>
T __shfl_xor_sync(unsigned, T v, int mask) {
  return emu::exchange(v, [=](unsigned lane) { return lane ^ (unsigned)mask; });
}

template <class T>
T __shfl_sync(unsigned, T v, int src) {
  return emu::exchange(v, [=](unsigned) { return (unsigned)src; });
}

// Bit l set where lane l's predicate holds (every lane of a full warp calls).
inline unsigned __ballot_sync(unsigned, bool p) {
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l)
    bits |= (emu::exchange(unsigned(p), [=](unsigned) { return l; }) & 1u) << l;
  return bits;
}

using std::max;
using std::min;

// IEEE operations rounded to nearest, each on its own (the harness is compiled without
// contraction into fused multiply-adds).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }

struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even; NaN stays NaN.
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return {uint16_t(0x7fc0)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {uint16_t(u >> 16)};
}

struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16(a), __float2bfloat16(b)};
}

namespace emu {
// Runs `kernel` over `grid` blocks of `block.x` threads (1-D blocks, a multiple of 32 threads).
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
  gridDim = grid;
  blockDim = block;
  const unsigned n = block.x;
  // Blocks run one at a time, last first: a GPU starts them in no promised order (in practice
  // roughly first to last), so a kernel whose blocks read what other blocks of the same launch
  // write gets it wrong here too.
  for (unsigned z = grid.z; z-- > 0;)
    for (unsigned y = grid.y; y-- > 0;)
      for (unsigned x = grid.x; x-- > 0;) {
        blockIdx = {x, y, z};
        std::barrier<> bar(n);
        block_barrier = &bar;
        warp_barriers.clear();
        for (unsigned w = 0; w < (n + 31) / 32; ++w)
          warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, n - w * 32)));
        lanes.assign(n, 0.0f);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < n; ++t)
          threads.emplace_back([=] {
            threadIdx = {t, 0, 0};
            kernel(P(args)...);
          });
        for (auto& t : threads) t.join();
      }
}
}  // namespace emu

#include "wmma.h"
