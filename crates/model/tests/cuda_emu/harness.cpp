// Runs one of Sluice's CUDA kernels under the emulation of emu.h, launched as
// crates/model/src/fused/device.rs and device/attention.rs (crates/trainer/src/adamw_kernel/cuda.rs for AdamW and the norm's
// sums) launches it on a GPU (the same grids and blocks):
//
//   harness OP DTYPE IN OUT ARGS...
//
// IN holds the op's inputs one after another, floats as f32 (rounded to bf16 here when DTYPE is
// bf16) and slot arrays as u32; OUT receives its outputs, floats as f32. Used by
// crates/model/tests/fused_ops.rs.
#include "emu.h"

#include "../../kernels/adamw.cu"
#include "../../kernels/attention.cu"
#include "../../kernels/attention_tc.cu"
#include "../../kernels/fused.cu"
#include "../../kernels/paged.cu"
#include "../../kernels/scores.cu"

#include <cstdio>
#include <cstdlib>
#include <string>

static FILE* in_file;
static FILE* out_file;

template <class T>
std::vector<T> floats(size_t n) {
  std::vector<float> f(n);
  if (fread(f.data(), 4, n, in_file) != n) { fprintf(stderr, "short input\n"); exit(2); }
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) v[i] = f[i];
    else v[i] = __float2bfloat16(f[i]);
  }
  return v;
}

std::vector<unsigned> words(size_t n) {
  std::vector<unsigned> v(n);
  if (fread(v.data(), 4, n, in_file) != n) { fprintf(stderr, "short input\n"); exit(2); }
  return v;
}

template <class T>
void put(const std::vector<T>& v) {
  for (const T& x : v) {
    float f;
    if constexpr (std::is_same_v<T, float>) f = x;
    else f = __bfloat162float(x);
    fwrite(&f, 4, 1, out_file);
  }
}

static unsigned blocks(unsigned long long n, unsigned per) {
  return (unsigned)std::min<unsigned long long>((n + per - 1) / per, 4096);
}

// device.rs: THREADS, DW_CHUNK_ROWS.
constexpr unsigned THREADS = 256, CHUNK_ROWS = 64;

// The dK/dV kernel's signature: attention.cu's writes T, attention_tc.cu's f32 partial sums.
template <class T, class O>
using KvKernel = void (*)(const T*, const T*, const T*, const T*, const float*, const float*,
                          const unsigned*, const unsigned*, const unsigned*, const unsigned*, int,
                          O*, O*, unsigned, unsigned, unsigned, float);

template <class T, int D, class O = T>
void attention(void (*fwd)(const T*, const T*, const T*, const unsigned*, const unsigned*,
                           const unsigned*, const unsigned*, int, T*, float*, unsigned, unsigned,
                           unsigned, float),
               KvKernel<T, O> kv,
               void (*dq)(const T*, const T*, const T*, const T*, const float*, const float*,
                          const unsigned*, const unsigned*, const unsigned*, const unsigned*, int,
                          T*, unsigned, unsigned, unsigned, float),
               void (*delta)(const T*, const T*, float*, unsigned, unsigned, unsigned, u64),
               unsigned B, unsigned L, unsigned H, unsigned KV, int runs, unsigned block = Tile<D>::ROWS,
               unsigned R = Tile<D>::ROWS, unsigned parts = Tile<D>::PARTS) {
  const size_t N = (size_t)B * L;
  auto q = floats<T>(N * H * D), k = floats<T>(N * KV * D), v = floats<T>(N * KV * D),
       g = floats<T>(N * H * D);
  // The tile mask: per row and tile of 64 queries, a bit per tile of 64 keys (tiles.rs).
  const size_t mask_tiles = (L + 63) / 64, mask_words = (mask_tiles + 31) / 32;
  auto seg = words(N), prefix = words(N), first = words(N);
  auto mask = words(B * mask_tiles * mask_words);
  const float scale = 1.0f / std::sqrt((float)D);
  // The tensor-core kernels take 64 rows a block, with 128 threads.
  const unsigned tiles = (L + R - 1) / R;
  std::vector<T> o(N * H * D), gq(N * H * D), gk(N * KV * D), gv(N * KV * D);
  std::vector<float> lse(N * H), dl(N * H);
  // The forward and dK/dV take `parts` threads a row (device/attention.rs, `split_threads`).
  emu::launch(fwd, dim3(tiles, B * H), dim3(block * parts), q.data(), k.data(), v.data(), seg.data(),
              prefix.data(), first.data(), mask.data(), runs, o.data(), lse.data(), L, H, KV, scale);
  emu::launch(delta, dim3(blocks(N * H * 32, THREADS)), dim3(THREADS), o.data(), g.data(),
              dl.data(), L, H, (unsigned)D, (u64)(N * H));
  if constexpr (std::is_same_v<O, T>) {
    emu::launch(kv, dim3(tiles, B * KV), dim3(block * parts), q.data(), k.data(), v.data(), g.data(),
                lse.data(), dl.data(), seg.data(), prefix.data(), first.data(), mask.data(), runs,
                gk.data(), gv.data(), L, H, KV, scale);
  } else {
    // The tensor-core dK/dV: a block per query head into f32 shares, then their sum per kv head.
    std::vector<float> pk(N * H * D), pv(N * H * D);
    emu::launch(kv, dim3(tiles, B * H), dim3(block * parts), q.data(), k.data(), v.data(), g.data(),
                lse.data(), dl.data(), seg.data(), prefix.data(), first.data(), mask.data(), runs,
                pk.data(), pv.data(), L, H, KV, scale);
    emu::launch(attn_tc_kv_sum_bf16, dim3(blocks(N * KV * D, THREADS)), dim3(THREADS), pk.data(),
                pv.data(), gk.data(), gv.data(), H, KV, (unsigned)D, (u64)(N * KV * D));
  }
  emu::launch(dq, dim3(tiles, B * H), dim3(block), q.data(), k.data(), v.data(), g.data(), lse.data(),
              dl.data(), seg.data(), prefix.data(), first.data(), mask.data(), runs, gq.data(), L, H, KV,
              scale);
  put(o);
  put(lse);
  put(gq);
  put(gk);
  put(gv);
}

#define ATTN(T, S, D) \
  attention<T, D>(attn_fwd_##S##_##D, attn_bwd_kv_##S##_##D, attn_bwd_q_##S##_##D, attn_delta_##S, B, L, H, KV, runs)

template <class T>
void run(const std::string& op, char** a, bool bf);

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: harness OP f32|bf16 IN OUT ARGS...\n");
    return 2;
  }
  in_file = fopen(argv[3], "rb");
  out_file = fopen(argv[4], "wb");
  if (!in_file || !out_file) { perror("open"); return 2; }
  const std::string op = argv[1], dtype = argv[2];
  if (dtype == "f32") run<float>(op, argv + 5, false);
  else run<bf16>(op, argv + 5, true);
  fclose(out_file);
  return 0;
}

#define PICK(name) (bf ? (void*)name##_bf16 : (void*)name##_f32)

// The parts of a split paged attention combined, as fused/device/paged.rs launches it.
template <class T>
void combine(const float* part, T* out, unsigned R, unsigned H, unsigned D, unsigned parts) {
  if constexpr (std::is_same_v<T, float>) {
    emu::launch(paged_combine_f32, dim3(R, H), dim3(32), part, out, H, D, parts);
  } else {
    emu::launch(paged_combine_bf16, dim3(R, H), dim3(32), part, out, H, D, parts);
  }
}

template <class T>
void run(const std::string& op, char** a, bool bf) {
  auto u = [&](int i) { return (unsigned)strtoul(a[i], nullptr, 10); };
  auto f = [&](int i) { return strtof(a[i], nullptr); };
  if (op == "rms_fwd") {
    const unsigned rows = u(0), d = u(1);
    auto x = floats<T>((size_t)rows * d), w = floats<T>(d);
    std::vector<T> y(x.size());
    auto k = (void (*)(const T*, const T*, T*, unsigned, float))PICK(rms_fwd);
    emu::launch(k, dim3(rows), dim3(THREADS), x.data(), w.data(), y.data(), d, f(2));
    put(y);
  } else if (op == "add_rms_fwd") {
    const unsigned rows = u(0), d = u(1);
    auto x = floats<T>((size_t)rows * d), y = floats<T>((size_t)rows * d), w = floats<T>(d);
    std::vector<T> sum(x.size()), normed(x.size());
    auto k = (void (*)(const T*, const T*, const T*, T*, T*, unsigned, float))PICK(add_rms_fwd);
    emu::launch(k, dim3(rows), dim3(THREADS), x.data(), y.data(), w.data(), sum.data(), normed.data(), d, f(2));
    put(sum);
    put(normed);
  } else if (op == "rms_bwd") {
    const unsigned rows = u(0), d = u(1), chunks = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    auto x = floats<T>((size_t)rows * d), w = floats<T>(d), g = floats<T>((size_t)rows * d);
    std::vector<T> dx(x.size()), dw(d);
    std::vector<float> inv(rows), part((size_t)chunks * d);
    auto kdx = (void (*)(const T*, const T*, const T*, T*, float*, unsigned, float))PICK(rms_bwd_dx);
    auto kpart = (void (*)(const T*, const T*, const float*, float*, unsigned, unsigned, unsigned))PICK(rms_bwd_dw_part);
    auto ksum = (void (*)(const float*, T*, unsigned, unsigned))PICK(rms_bwd_dw_sum);
    emu::launch(kdx, dim3(rows), dim3(THREADS), x.data(), w.data(), g.data(), dx.data(), inv.data(), d, f(2));
    emu::launch(kpart, dim3((d + THREADS - 1) / THREADS, chunks), dim3(THREADS), x.data(), g.data(),
                inv.data(), part.data(), rows, d, CHUNK_ROWS);
    emu::launch(ksum, dim3((d + THREADS - 1) / THREADS), dim3(THREADS), part.data(), dw.data(), chunks, d);
    put(dx);
    put(dw);
  } else if (op == "swiglu_fwd" || op == "swiglu_bwd") {
    const u64 n = u(0);
    auto gate = floats<T>(n), up = floats<T>(n);
    if (op == "swiglu_fwd") {
      std::vector<T> out(n);
      auto k = (void (*)(const T*, const T*, T*, u64))PICK(swiglu_fwd);
      emu::launch(k, dim3(blocks(n, THREADS)), dim3(THREADS), gate.data(), up.data(), out.data(), n);
      put(out);
    } else {
      auto g = floats<T>(n);
      std::vector<T> grads(2 * n);
      auto k = (void (*)(const T*, const T*, const T*, T*, u64))PICK(swiglu_bwd);
      emu::launch(k, dim3(blocks(n, THREADS)), dim3(THREADS), gate.data(), up.data(), g.data(), grads.data(), n);
      put(grads);
    }
  } else if (op == "rope") {
    const unsigned rows = u(0), width = u(1), d = u(2);
    auto x = floats<T>((size_t)rows * width), c = floats<T>((size_t)rows * d / 2), s = floats<T>((size_t)rows * d / 2);
    std::vector<T> y(x.size());
    auto k = (void (*)(const T*, const T*, const T*, T*, u64, unsigned, unsigned, float))PICK(rope);
    emu::launch(k, dim3(blocks((u64)rows * width / 2, THREADS)), dim3(THREADS), x.data(), c.data(), s.data(),
                y.data(), (u64)rows, width, d, f(3));
    put(y);
  } else if (op == "split_rope") {
    // ARGS: rows, hq, hk, d, whether the bias is read (the input is there either way).
    const unsigned rows = u(0), hq = u(1), hk = u(2), d = u(3), has_bias = u(4), width = (hq + 2 * hk) * d;
    auto x = floats<T>((size_t)rows * width), b = floats<T>(width);
    auto c = floats<T>((size_t)rows * d / 2), s = floats<T>((size_t)rows * d / 2);
    std::vector<T> q((size_t)rows * hq * d), k((size_t)rows * hk * d), v(k.size());
    auto kern = (void (*)(const T*, const T*, unsigned, const T*, const T*, T*, T*, T*, u64, unsigned, unsigned,
                          unsigned))PICK(split_rope);
    emu::launch(kern, dim3(blocks((u64)rows * width / 2, THREADS)), dim3(THREADS), x.data(), b.data(), has_bias,
                c.data(), s.data(), q.data(), k.data(), v.data(), (u64)rows, hq, hk, d);
    put(q);
    put(k);
    put(v);
  } else if (op == "swiglu_rows") {
    const unsigned rows = u(0), inter = u(1);
    auto x = floats<T>((size_t)rows * 2 * inter);
    std::vector<T> out((size_t)rows * inter);
    auto k = (void (*)(const T*, T*, u64, unsigned))PICK(swiglu_rows);
    emu::launch(k, dim3(blocks((u64)rows * inter, THREADS)), dim3(THREADS), x.data(), out.data(), (u64)rows, inter);
    put(out);
  } else if (op == "attention") {
    const unsigned B = u(0), L = u(1), H = u(2), KV = u(3), D = u(4);
    const int runs = (int)u(5);
    const bool tensor_cores = a[6] && u(6);
    if constexpr (std::is_same_v<T, bf16>) {
      if (tensor_cores && D == 64) {
        attention<bf16, 64, float>(attn_tc_fwd_bf16_64, attn_tc_bwd_kv_bf16_64, attn_tc_bwd_q_bf16_64,
                            attn_delta_bf16, B, L, H, KV, runs, 128, 64, 1);
        return;
      }
      if (tensor_cores && D == 128) {
        attention<bf16, 128, float>(attn_tc_fwd_bf16_128, attn_tc_bwd_kv_bf16_128, attn_tc_bwd_q_bf16_128,
                             attn_delta_bf16, B, L, H, KV, runs, 128, 64, 1);
        return;
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      if (D == 16) ATTN(float, f32, 16); else if (D == 32) ATTN(float, f32, 32);
      else if (D == 64) ATTN(float, f32, 64); else ATTN(float, f32, 128);
    } else {
      if (D == 16) ATTN(bf16, bf16, 16); else if (D == 32) ATTN(bf16, bf16, 32);
      else if (D == 64) ATTN(bf16, bf16, 64); else ATTN(bf16, bf16, 128);
    }
  } else if (op == "adamw_many") {
    // ARGS: the constants (clip b1 nb1 b2 nb2 c1 c2 eps lr decay), then each parameter's size;
    // IN: every parameter's p, m, v, g in turn. OUT: every parameter's p, m, v.
    float k[10];
    for (int i = 0; i < 10; ++i) k[i] = f(i);
    std::vector<std::vector<float>> ps, ms, vs, gs;
    std::vector<u64> pa, ma, va, ga, chunk_at;
    std::vector<unsigned> chunk_param, chunk_len;
    for (int i = 10; a[i]; ++i) {
      const size_t n = u(i);
      ps.push_back(floats<float>(n));
      ms.push_back(floats<float>(n));
      vs.push_back(floats<float>(n));
      gs.push_back(floats<float>(n));
      // adamw_kernel.rs: CHUNK elements a block.
      for (size_t at = 0; at < n; at += 65536) {
        chunk_param.push_back(i - 10);
        chunk_at.push_back(at);
        chunk_len.push_back((unsigned)std::min<size_t>(65536, n - at));
      }
    }
    for (size_t t = 0; t < ps.size(); ++t) {
      pa.push_back((u64)ps[t].data());
      ma.push_back((u64)ms[t].data());
      va.push_back((u64)vs[t].data());
      ga.push_back((u64)gs[t].data());
    }
    emu::launch(adamw_many_f32, dim3(chunk_param.size()), dim3(THREADS), pa.data(), ma.data(),
                va.data(), ga.data(), chunk_param.data(), chunk_at.data(), chunk_len.data(), k[0],
                k[1], k[2], k[3], k[4], k[5], k[6], k[7], k[8], k[9]);
    for (size_t t = 0; t < ps.size(); ++t) {
      put(ps[t]);
      put(ms[t]);
      put(vs[t]);
    }
  } else if (op == "paged") {
    // ARGS: R, H, KV, D, BT, scale, pool rows per half, meta words, and optionally the parts
    // each row's keys are split into (default 1). IN: q, the step's new keys and values, the
    // pool (keys then values), meta. OUT: the attention, then the pool.
    const unsigned R = u(0), H = u(1), KV = u(2), D = u(3), BT = u(4), pool_rows = u(6), meta_len = u(7),
                   parts = a[8] ? u(8) : 1;
    auto q = floats<T>((size_t)R * H * D), k_new = floats<T>((size_t)R * KV * D),
         v_new = floats<T>((size_t)R * KV * D), pool = floats<T>((size_t)2 * pool_rows * D);
    auto meta = words(meta_len);
    std::vector<T> out((size_t)R * H * D);
    std::vector<float> part((size_t)R * H * parts * (D + 2));
    auto k = (void (*)(const T*, const T*, const T*, T*, const unsigned*, T*, float*, unsigned, unsigned,
                       unsigned, unsigned, unsigned, u64, float))PICK(paged_attention);
    emu::launch(k, dim3(R, H, parts), dim3(32), q.data(), k_new.data(), v_new.data(), pool.data(),
                meta.data(), out.data(), part.data(), R, H, KV, D, BT, (u64)pool_rows, f(5));
    if (parts > 1) combine(part.data(), out.data(), R, H, D, parts);
    put(out);
    put(pool);
  } else if (op == "paged_qkv") {
    // ARGS: as `paged` up to the meta words, whether the bias is read, and optionally the parts.
    // IN: the stacked q/k/v rows, the bias, cos, sin, the pool, meta. OUT: as `paged`.
    const unsigned R = u(0), H = u(1), KV = u(2), D = u(3), BT = u(4), pool_rows = u(6), meta_len = u(7),
                   has_bias = u(8), width = (H + 2 * KV) * D, parts = a[9] ? u(9) : 1;
    auto qkv = floats<T>((size_t)R * width), b = floats<T>(width);
    auto c = floats<T>((size_t)R * D / 2), s = floats<T>((size_t)R * D / 2);
    auto pool = floats<T>((size_t)2 * pool_rows * D);
    auto meta = words(meta_len);
    std::vector<T> out((size_t)R * H * D);
    std::vector<float> part((size_t)R * H * parts * (D + 2));
    auto k = (void (*)(const T*, const T*, unsigned, const T*, const T*, T*, const unsigned*, T*, float*,
                       unsigned, unsigned, unsigned, unsigned, unsigned, u64, float))PICK(paged_attention_qkv);
    emu::launch(k, dim3(R, H, parts), dim3(32), qkv.data(), b.data(), has_bias, c.data(), s.data(),
                pool.data(), meta.data(), out.data(), part.data(), R, H, KV, D, BT, (u64)pool_rows, f(5));
    if (parts > 1) combine(part.data(), out.data(), R, H, D, parts);
    put(out);
    put(pool);
  } else if (op == "kv_rows") {
    // ARGS: rows, width, half (pool rows per half). IN: k, v, the row indices, the pool.
    const unsigned n = u(0), width = u(1);
    const u64 half = u(2);
    auto k = floats<T>((size_t)n * width), v = floats<T>((size_t)n * width);
    auto rows = words(n);
    auto pool = floats<T>((size_t)(2 * half) * width);
    if constexpr (std::is_same_v<T, float>) {
      emu::launch(kv_rows_b4, dim3(blocks((u64)n * width, THREADS)), dim3(THREADS), (const unsigned*)k.data(),
                  (const unsigned*)v.data(), rows.data(), (unsigned*)pool.data(), n, width, half);
    } else {
      emu::launch(kv_rows_b2, dim3(blocks((u64)n * width, THREADS)), dim3(THREADS), (const unsigned short*)k.data(),
                  (const unsigned short*)v.data(), rows.data(), (unsigned short*)pool.data(), n, width, half);
    }
    put(pool);
  } else if (op == "snapshot_many") {
    // ARGS: each buffer's size; IN: the f32 buffers. OUT: them in the op's dtype, one after another.
    std::vector<std::vector<float>> src;
    std::vector<std::vector<T>> dst;
    std::vector<u64> sa, da, chunk_at;
    std::vector<unsigned> chunk_param, chunk_len;
    for (int i = 0; a[i]; ++i) {
      const size_t n = u(i);
      src.push_back(floats<float>(n));
      dst.emplace_back(n);
      for (size_t at = 0; at < n; at += 65536) {
        chunk_param.push_back(i);
        chunk_at.push_back(at);
        chunk_len.push_back((unsigned)std::min<size_t>(65536, n - at));
      }
    }
    for (size_t i = 0; i < src.size(); ++i) {
      sa.push_back((u64)src[i].data());
      da.push_back((u64)dst[i].data());
    }
    emu::launch(snapshot_many_f32, dim3(chunk_param.size()), dim3(THREADS), sa.data(), da.data(),
                chunk_param.data(), chunk_at.data(), chunk_len.data(), (int)bf);
    for (auto& d : dst) put(d);
  } else if (op == "accumulate_many") {
    // ARGS: each parameter's size and flags (ACC_*); IN per parameter: its f32 sum (unless
    // ACC_FRESH), g and (with ACC_H) h, each as f32 or, by its flag, rounded to bf16. OUT: the
    // sums, one after another.
    std::vector<std::vector<float>> sums, gf, hf;
    std::vector<std::vector<bf16>> gb, hb;
    std::vector<u64> sa, ga, ha, chunk_at;
    std::vector<unsigned> flags, chunk_param, chunk_len;
    for (int i = 0; a[i]; i += 2) {
      const size_t n = u(i);
      const unsigned fl = u(i + 1), t = flags.size();
      flags.push_back(fl);
      sums.push_back((fl & ACC_FRESH) ? std::vector<float>(n, NAN) : floats<float>(n));
      const bool g16 = fl & ACC_G_BF16, has_h = fl & ACC_H, h16 = fl & ACC_H_BF16;
      gf.push_back(g16 ? std::vector<float>() : floats<float>(n));
      gb.push_back(g16 ? floats<bf16>(n) : std::vector<bf16>());
      hf.push_back(has_h && !h16 ? floats<float>(n) : std::vector<float>());
      hb.push_back(has_h && h16 ? floats<bf16>(n) : std::vector<bf16>());
      for (size_t at = 0; at < n; at += 65536) {
        chunk_param.push_back(t);
        chunk_at.push_back(at);
        chunk_len.push_back((unsigned)std::min<size_t>(65536, n - at));
      }
    }
    for (size_t t = 0; t < flags.size(); ++t) {
      sa.push_back((u64)sums[t].data());
      ga.push_back(flags[t] & ACC_G_BF16 ? (u64)gb[t].data() : (u64)gf[t].data());
      ha.push_back(!(flags[t] & ACC_H) ? 0 : flags[t] & ACC_H_BF16 ? (u64)hb[t].data() : (u64)hf[t].data());
    }
    emu::launch(accumulate_many_f32, dim3(chunk_param.size()), dim3(THREADS), sa.data(), ga.data(),
                ha.data(), flags.data(), chunk_param.data(), chunk_at.data(), chunk_len.data());
    for (auto& s : sums) put(s);
  } else if (op == "sumsq_many") {
    // ARGS: each buffer's size; IN: the buffers. OUT: one sum of squares per 65536-element chunk.
    std::vector<std::vector<float>> gs;
    std::vector<u64> ga, chunk_at;
    std::vector<unsigned> chunk_param, chunk_len;
    for (int i = 0; a[i]; ++i) {
      const size_t n = u(i);
      gs.push_back(floats<float>(n));
      for (size_t at = 0; at < n; at += 65536) {
        chunk_param.push_back(i);
        chunk_at.push_back(at);
        chunk_len.push_back((unsigned)std::min<size_t>(65536, n - at));
      }
    }
    for (auto& g : gs) ga.push_back((u64)g.data());
    std::vector<float> partial(chunk_param.size());
    emu::launch(sumsq_many_f32, dim3(chunk_param.size()), dim3(THREADS), ga.data(),
                chunk_param.data(), chunk_at.data(), chunk_len.data(), partial.data());
    put(partial);
  } else if (op == "scores") {
    const unsigned rows = u(0), V = u(1);
    auto logits = floats<T>((size_t)rows * V);
    auto targets = words(rows);
    auto grad = floats<float>((size_t)rows * 2);
    std::vector<float> out((size_t)rows * 2);
    std::vector<T> gz((size_t)rows * V);
    auto fwd = (void (*)(const T*, const unsigned*, float*, unsigned, float))PICK(scores_fwd);
    auto bwd = (void (*)(const T*, const unsigned*, const float*, T*, unsigned, float))PICK(scores_bwd);
    emu::launch(fwd, dim3(rows), dim3(THREADS), logits.data(), targets.data(), out.data(), V, f(2));
    emu::launch(bwd, dim3(rows), dim3(THREADS), logits.data(), targets.data(), grad.data(), gz.data(), V, f(2));
    put(out);
    put(gz);
  } else {
    fprintf(stderr, "unknown op %s\n", op.c_str());
    exit(2);
  }
}
