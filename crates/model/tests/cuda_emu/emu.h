// A CPU emulation of the CUDA execution model, enough to run Sluice's training kernels
// (crates/model/kernels/*.cu) as C++ in the tests: every thread of a block is an OS thread, the
// blocks of a grid run one after another (so `__shared__` is one static array), `__syncthreads`
// is a barrier over the block and warp shuffles exchange through a per-warp barrier. It checks
// the kernels' indexing, masking and arithmetic without a GPU; speed, memory coalescing and
// races the real hardware could expose are for the GPU check (scripts/gpu-check). The tensor
// cores' `mma.sync` and `ldmatrix` exchange their lanes' registers through the warp, in PTX's
// documented fragment layouts (`ldmatrix_x4`, `mma_bf16_16816` below). An asynchronous copy
// (`cp.async`) fills its destination with all-ones bits (a NaN in bf16 and in f32) when issued
// and lands only at its thread's wait, so a kernel that reads a staged tile before the wait and
// barrier, or stages into a buffer the block still reads, computes with the poison.
#pragma once
#define SLUICE_CUDA_EMU 1

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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
struct __align__(8) float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
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
// Per thread, 64 bytes for `gather` (a warp's operands of mma and ldmatrix).
inline std::vector<unsigned char> gathered;
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
// Every lane of the calling thread's warp puts its `v` in; `all[l]` receives lane l's.
template <class T>
void gather(const T& v, T* all) {
  static_assert(sizeof(T) <= 64, "64 bytes a lane");
  const unsigned t = threadIdx.x;
  auto& warp = *warp_barriers[t / 32];
  std::memcpy(&gathered[t * 64], &v, sizeof(T));
  warp.arrive_and_wait();
  for (unsigned l = 0; l < 32; ++l) std::memcpy(&all[l], &gathered[((t & ~31u) + l) * 64], sizeof(T));
  warp.arrive_and_wait();
}

inline float bf16_lo(unsigned w) { return __bfloat162float({uint16_t(w & 0xffffu)}); }
inline float bf16_hi(unsigned w) { return __bfloat162float({uint16_t(w >> 16)}); }
inline unsigned bf16_pair(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return unsigned(lo.bits) | (unsigned(hi.bits) << 16);
}

// `ldmatrix.sync.aligned.m8n8.x4.shared.b16` (`.trans` with `trans`): lanes 8m..8m+7 give the
// rows of 8 x 8 matrix m; lane l receives in r[m] the pair at row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1 of matrix m (of its transpose with `trans`), the first in the low half.
inline void ldmatrix_x4(unsigned r[4], const __nv_bfloat16* row, bool trans) {
  const __nv_bfloat16* rows[32];
  gather(row, rows);
  const unsigned l = threadIdx.x % 32, a = l / 4, c = 2 * (l % 4);
  for (unsigned m = 0; m < 4; ++m)
    r[m] = trans ? bf16_pair(rows[8 * m + c][a], rows[8 * m + c + 1][a])
                 : bf16_pair(rows[8 * m + a][c], rows[8 * m + a][c + 1]);
}

// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`, d += a b, with PTX's fragments: lane
// l = 4 g + t holds A's (g, 2t..), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..) in a[0..4),
// B's (2t.., g) and (2t + 8.., g) in b0 and b1, and D's (g, 2t..) and (g + 8, 2t..) in d.
inline void mma_bf16_16816(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
  struct Operands {
    unsigned a[4], b[2];
  };
  Operands mine{{a[0], a[1], a[2], a[3]}, {b0, b1}}, all[32];
  gather(mine, all);
  float A[16][16], B[16][8];
  for (unsigned l = 0; l < 32; ++l) {
    const unsigned g = l / 4, t = 2 * (l % 4);
    const unsigned* x = all[l].a;
    A[g][t] = bf16_lo(x[0]), A[g][t + 1] = bf16_hi(x[0]);
    A[g + 8][t] = bf16_lo(x[1]), A[g + 8][t + 1] = bf16_hi(x[1]);
    A[g][t + 8] = bf16_lo(x[2]), A[g][t + 9] = bf16_hi(x[2]);
    A[g + 8][t + 8] = bf16_lo(x[3]), A[g + 8][t + 9] = bf16_hi(x[3]);
    B[t][g] = bf16_lo(all[l].b[0]), B[t + 1][g] = bf16_hi(all[l].b[0]);
    B[t + 8][g] = bf16_lo(all[l].b[1]), B[t + 9][g] = bf16_hi(all[l].b[1]);
  }
  const unsigned l = threadIdx.x % 32, g = l / 4, t = 2 * (l % 4);
  for (unsigned e = 0; e < 4; ++e) {
    const unsigned row = g + 8 * (e / 2), col = t + e % 2;
    float s = d[e];
    for (unsigned k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    d[e] = s;
  }
}

// `cp.async` of `bytes` (4 or 16) into shared memory, `src_bytes` of them read from `src` at
// issue (the rest zeros): the destination holds all-ones bits until the thread's
// `cp_async_wait_all`.
struct Pending {
  void* dst;
  unsigned char data[16];
  unsigned bytes;
};
inline thread_local std::vector<Pending> pending;
inline void cp_async(void* dst, const void* src, unsigned src_bytes, unsigned bytes) {
  Pending p{dst, {}, bytes};
  std::memcpy(p.data, src, src_bytes);
  std::memset(dst, 0xff, bytes);
  pending.push_back(p);
}
inline void cp_async_wait_all() {
  for (const Pending& p : pending) std::memcpy(p.dst, p.data, p.bytes);
  pending.clear();
}

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
        gathered.assign(n * 64, 0);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < n; ++t)
          threads.emplace_back([=] {
            threadIdx = {t, 0, 0};
            kernel(P(args)...);
            if (!pending.empty()) {
              std::fprintf(stderr, "thread %u of block (%u, %u, %u) ended with %zu copies not waited for\n",
                           t, blockIdx.x, blockIdx.y, blockIdx.z, pending.size());
              std::abort();
            }
          });
        for (auto& t : threads) t.join();
      }
}
}  // namespace emu

