//! Decode attention straight over the paged pool (CPU, f32): each sequence's new query reads its
//! cached keys and values where they lie, through its block table. The general path gathers
//! every sequence's rows into a padded `(B, kv_heads, T, head_dim)` copy per layer and
//! transposes it; once sequences grow past a few dozen tokens that copy is most of a decode step
//! (`sluice bench engine`, tiny preset, 256-token completions: gather and transpose 43 % of the
//! engine's time).
//!
//! Two bodies: AVX2 + FMA intrinsics (chosen at run time, for head dims of whole 8-wide vectors;
//! [`avx2`]) and portable loops for every other CPU and head dim. Sequences run in parallel only
//! when a step does enough work to pay for waking the pool.

use rayon::prelude::*;

use super::BlockId;

/// The shapes the kernel needs.
pub(super) struct DecodeShape {
    pub kv_heads: usize,
    /// Query heads per kv head.
    pub groups: usize,
    pub head_dim: usize,
    pub block_tokens: usize,
}

/// Below this many multiply-adds (each key read costs `2 · groups · head_dim`: scores and
/// values) the step's attention runs on the calling thread: splitting it costs more in
/// wake-ups than it saves. Measured on tiny (16,384 key reads of head dim 16, 2 query heads per
/// kv head); counted in key reads alone it kept small's attention (head dim 64, 3 per kv head)
/// on one thread at 64 in flight, 7 % of the step while the other core waited.
const MIN_PARALLEL_MACS: usize = 1 << 20;

/// One decode step's attention. `keys` and `values` are one layer's pool, rows of `head_dim`
/// in head-major blocks (see [`row_offsets`]); `q` is `(B, heads, head_dim)` flat, the query heads of kv head `h`
/// being `h · groups .. (h + 1) · groups`; sequence `b` attends to its first `lens[b]` tokens
/// (the new one included) through `tables[b]`. Returns `(B, heads · head_dim)` flat.
pub(super) fn decode_attention(
    keys: &[f32],
    values: &[f32],
    q: &[f32],
    tables: &[&[BlockId]],
    lens: &[usize],
    shape: &DecodeShape,
    scale: f32,
) -> Vec<f32> {
    let per_seq = shape.kv_heads * shape.groups * shape.head_dim;
    let mut out = vec![0f32; tables.len() * per_seq];
    let wide = crate::fused::avx2_fma();
    let one = |(b, out_b): (usize, &mut [f32])| {
        let seq = Seq {
            keys,
            values,
            q: &q[b * per_seq..][..per_seq],
            table: tables[b],
            len: lens[b],
        };
        attend_dispatch(&seq, shape, scale, out_b, wide);
    };
    let reads: usize = lens.iter().sum::<usize>() * shape.kv_heads;
    let macs = reads * 2 * shape.groups * shape.head_dim;
    if macs >= MIN_PARALLEL_MACS && rayon::current_num_threads() > 1 {
        out.par_chunks_mut(per_seq).enumerate().for_each(one);
    } else {
        out.chunks_mut(per_seq).enumerate().for_each(one);
    }
    out
}

/// One sequence's inputs: the layer's pools, its query heads, block table and visible length.
struct Seq<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    q: &'a [f32],
    table: &'a [BlockId],
    len: usize,
}

#[allow(unsafe_code)]
fn attend_dispatch(seq: &Seq<'_>, shape: &DecodeShape, scale: f32, out: &mut [f32], wide: bool) {
    #[cfg(target_arch = "x86_64")]
    if wide && shape.head_dim.is_multiple_of(8) {
        // SAFETY: `wide` is `avx2_fma()`: the CPU has AVX2 and FMA; the head dim is whole
        // vectors.
        return unsafe { avx2::attend(seq, shape, scale, out) };
    }
    let _ = wide;
    by_head_dim(seq, shape, scale, out);
}

/// [`attend_seq`] with the head dim as a constant for the common sizes, so the per-key loops
/// unroll and the output rows stay in registers; any other size runs the same loops with the
/// dim read at run time.
fn by_head_dim(seq: &Seq<'_>, shape: &DecodeShape, scale: f32, out: &mut [f32]) {
    match shape.head_dim {
        16 => attend_seq::<16>(seq, shape, scale, out),
        32 => attend_seq::<32>(seq, shape, scale, out),
        64 => attend_seq::<64>(seq, shape, scale, out),
        128 => attend_seq::<128>(seq, shape, scale, out),
        _ => attend_seq::<0>(seq, shape, scale, out),
    }
}

/// Pool offsets (in f32s) of a sequence's visible rows of kv head 0, in position order; kv
/// head `h`'s rows are [`head_stride`] further (blocks are head-major: each kv head's
/// `block_tokens` rows in turn).
fn row_offsets(seq: &Seq<'_>, shape: &DecodeShape) -> Vec<usize> {
    let DecodeShape {
        kv_heads,
        head_dim,
        block_tokens,
        ..
    } = *shape;
    (0..seq.len)
        .map(|t| {
            let block = seq.table[t / block_tokens] as usize;
            (block * kv_heads * block_tokens + t % block_tokens) * head_dim
        })
        .collect()
}

/// Distance (in f32s) from a kv head's row to the next head's at the same position.
fn head_stride(shape: &DecodeShape) -> usize {
    shape.block_tokens * shape.head_dim
}

/// `scores` (one query head's, over every visible key) to probabilities, in place.
#[inline(always)]
fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for x in scores.iter_mut() {
        *x -= max;
    }
    crate::fused::exp_f32_in_place(scores);
    let inv = 1.0 / scores.iter().sum::<f32>();
    for x in scores.iter_mut() {
        *x *= inv;
    }
}

/// One sequence's attention, every kv head, in plain Rust (CPUs without AVX2 and FMA, and head
/// dims that are not whole 8-wide vectors): scores of the head's query group against each key
/// row (each row read once for the whole group), softmax, then the value rows weighted into
/// `out` (`(heads, head_dim)` flat). `D` is the head dim, or 0 to read it from `shape`.
#[inline(always)]
fn attend_seq<const D: usize>(seq: &Seq<'_>, shape: &DecodeShape, scale: f32, out: &mut [f32]) {
    let DecodeShape {
        kv_heads,
        groups,
        head_dim,
        ..
    } = *shape;
    let d = if D == 0 { head_dim } else { D };
    let len = seq.len;
    let rows = row_offsets(seq, shape);
    let stride = head_stride(shape);
    // (groups, len) probabilities of one kv head's queries.
    let mut scores = vec![0f32; groups * len];
    // One output row, accumulated here rather than in `out`, so it can live in registers.
    let mut acc = vec![0f32; d];
    for h in 0..kv_heads {
        let q_h = &seq.q[h * groups * d..][..groups * d];
        for (t, &row) in rows.iter().enumerate() {
            let k = &seq.keys[row + h * stride..][..d];
            for (g, q_g) in q_h.chunks_exact(d).enumerate() {
                scores[g * len + t] = dot(&q_g[..d], k) * scale;
            }
        }
        for (g, p) in scores.chunks_exact_mut(len).enumerate() {
            softmax(p);
            let acc = &mut acc[..d];
            acc.fill(0.0);
            for (&p, &row) in p.iter().zip(&rows) {
                let v = &seq.values[row + h * stride..][..d];
                for (a, &v) in acc.iter_mut().zip(v) {
                    *a += p * v;
                }
            }
            out[(h * groups + g) * d..][..d].copy_from_slice(acc);
        }
    }
}

/// `a · b` in eight partial sums, so the loop vectorises without reassociating one long chain.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a_rest.iter().zip(b_rest).map(|(x, y)| x * y).sum();
    let (lo, hi) = acc.split_at(4);
    (lo[0] + hi[0]) + (lo[1] + hi[1]) + (lo[2] + hi[2]) + (lo[3] + hi[3]) + tail
}

/// The AVX2 + FMA body, for head dims of whole 8-wide vectors (every common one). Per kv head:
/// - scores eight keys at a time: each of the head's query rows against the eight key rows
///   (read once per tile, from L1 for every query of the group), then one tree of horizontal
///   adds turns the eight accumulators into eight scores, stored together;
/// - the values in one pass per panel of up to [`GROUP_PANEL`] query heads × [`DIM_PANEL`]
///   vectors (12 accumulators in registers), so each value row is read once per panel, not
///   once per query head.
///
/// The portable loops above left the score's eight-lane sums to the compiler, which split
/// them into pairs of lanes, and read every value row once per query head: small at 64 in
/// flight with 256-token contexts spent a third of its decode step in them.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{DecodeShape, Seq, head_stride, row_offsets};

    /// Query heads per value pass.
    const GROUP_PANEL: usize = 3;
    /// 8-wide vectors of the head dim per value pass.
    const DIM_PANEL: usize = 4;
    /// Rows ahead that the loops prefetch: a sequence's rows lie in blocks scattered over the
    /// pool, so the hardware prefetcher loses the stream at every block boundary.
    const AHEAD: usize = 16;
    /// f32s per cache line.
    const LINE: usize = 16;

    /// Starts loading the `n > 0` floats at `p` into L1: every cache line they touch (a row
    /// need not start on a line).
    ///
    /// # Safety
    /// None beyond the CPU having SSE (a prefetch does not fault).
    #[inline(always)]
    unsafe fn prefetch(p: *const f32, n: usize) {
        let lines = (p.wrapping_add(n - 1) as usize / 64) - (p as usize / 64);
        for l in 0..=lines {
            // SAFETY: a prefetch of any address is harmless; `wrapping_add` keeps the pointer
            // arithmetic defined.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l * LINE).cast()) };
        }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA, and `shape.head_dim` is a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend(seq: &Seq<'_>, shape: &DecodeShape, scale: f32, out: &mut [f32]) {
        let DecodeShape {
            kv_heads,
            groups,
            head_dim: d,
            ..
        } = *shape;
        debug_assert!(d.is_multiple_of(8));
        let len = seq.len;
        let (rows, stride) = (row_offsets(seq, shape), head_stride(shape));
        // Every read below is within a visible row of the pools, the query or the output.
        let last = rows
            .iter()
            .max()
            .map_or(0, |&r| r + (kv_heads - 1) * stride + d);
        assert!(
            last <= seq.keys.len() && last <= seq.values.len(),
            "paged attention: a block table points past the pool"
        );
        assert!(seq.q.len() >= kv_heads * groups * d && out.len() >= kv_heads * groups * d);
        let mut probs = vec![0f32; groups * len];
        for h in 0..kv_heads {
            // SAFETY: the asserts above: kv head `h`'s columns of each row, its query rows and
            // output rows are in bounds.
            unsafe {
                scores(
                    seq.keys.as_ptr().add(h * stride),
                    &rows,
                    seq.q.as_ptr().add(h * groups * d),
                    groups,
                    d,
                    scale,
                    &mut probs,
                );
            }
            for p in probs.chunks_exact_mut(len) {
                // SAFETY: AVX2 (this function's contract).
                unsafe { softmax(p) };
            }
            let mut g0 = 0;
            while g0 < groups {
                let gn = (groups - g0).min(GROUP_PANEL);
                let panel = if d.is_multiple_of(8 * DIM_PANEL) {
                    DIM_PANEL
                } else if d.is_multiple_of(16) {
                    2
                } else {
                    1
                };
                let mut c0 = 0;
                while c0 < d {
                    // SAFETY: as above; columns `c0..c0 + 8·panel` of the head.
                    unsafe {
                        let pass = ValuePass {
                            values: seq.values.as_ptr().add(h * stride + c0),
                            rows: &rows,
                            probs: probs.as_ptr().add(g0 * len),
                            d,
                            out: out.as_mut_ptr().add((h * groups + g0) * d + c0),
                        };
                        match (gn, panel) {
                            (3, 4) => pass.run::<3, 4>(),
                            (3, 2) => pass.run::<3, 2>(),
                            (3, _) => pass.run::<3, 1>(),
                            (2, 4) => pass.run::<2, 4>(),
                            (2, 2) => pass.run::<2, 2>(),
                            (2, _) => pass.run::<2, 1>(),
                            (_, 4) => pass.run::<1, 4>(),
                            (_, 2) => pass.run::<1, 2>(),
                            _ => pass.run::<1, 1>(),
                        }
                    }
                    c0 += 8 * panel;
                }
                g0 += gn;
            }
        }
    }

    /// Scaled scores of `groups` query rows (`q`, `d` apart) against the keys at `k + rows[t]`,
    /// into `out[g · len + t]`.
    ///
    /// # Safety
    /// AVX2 and FMA; `d` a multiple of 8; `d` floats readable at `q + g·d` and at `k + row`.
    #[inline(always)]
    unsafe fn scores(
        k: *const f32,
        rows: &[usize],
        q: *const f32,
        groups: usize,
        d: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let len = rows.len();
        assert!(out.len() >= groups * len);
        // SAFETY: the caller's; stores stay in `out` (asserted).
        unsafe {
            let scale_v = _mm256_set1_ps(scale);
            let mut t = 0;
            while t + 8 <= len {
                let keys: [*const f32; 8] = std::array::from_fn(|j| k.add(rows[t + j]));
                for &row in rows.iter().skip(t + AHEAD).take(8) {
                    prefetch(k.wrapping_add(row), d);
                }
                for g in 0..groups {
                    let q_g = q.add(g * d);
                    let mut acc = [_mm256_setzero_ps(); 8];
                    for i in (0..d).step_by(8) {
                        let qv = _mm256_loadu_ps(q_g.add(i));
                        for (a, key) in acc.iter_mut().zip(&keys) {
                            *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key.add(i)), *a);
                        }
                    }
                    let s = _mm256_mul_ps(sum_each(acc), scale_v);
                    _mm256_storeu_ps(out.as_mut_ptr().add(g * len + t), s);
                }
                t += 8;
            }
            for (t, &row) in rows.iter().enumerate().skip(t) {
                let key = k.add(row);
                for g in 0..groups {
                    let q_g = q.add(g * d);
                    let mut acc = _mm256_setzero_ps();
                    for i in (0..d).step_by(8) {
                        acc = _mm256_fmadd_ps(
                            _mm256_loadu_ps(q_g.add(i)),
                            _mm256_loadu_ps(key.add(i)),
                            acc,
                        );
                    }
                    out[g * len + t] = sum(acc) * scale;
                }
            }
        }
    }

    /// [`super::softmax`] with the maximum and the sum in 8-wide vectors (the portable loops
    /// are one scalar chain each: a float reduction is not reordered for the compiler).
    ///
    /// # Safety
    /// AVX2 (inlined into [`attend`]).
    #[inline(always)]
    unsafe fn softmax(scores: &mut [f32]) {
        let (whole, tail) = scores.split_at_mut(scores.len() / 8 * 8);
        // SAFETY: AVX2 (the caller's); loads and stores stay in `whole`.
        unsafe {
            let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
            for c in whole.chunks_exact(8) {
                m = _mm256_max_ps(m, _mm256_loadu_ps(c.as_ptr()));
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
            let max = tail.iter().copied().fold(_mm_cvtss_f32(m), f32::max);
            for x in scores.iter_mut() {
                *x -= max;
            }
            crate::fused::exp_f32_in_place(scores);
            let (whole, tail) = scores.split_at_mut(scores.len() / 8 * 8);
            let mut acc = _mm256_setzero_ps();
            for c in whole.chunks_exact(8) {
                acc = _mm256_add_ps(acc, _mm256_loadu_ps(c.as_ptr()));
            }
            let inv = 1.0 / (sum(acc) + tail.iter().sum::<f32>());
            for x in scores.iter_mut() {
                *x *= inv;
            }
        }
    }

    /// The lane sums of eight vectors, as one vector (`out[j]` = the sum of `a[j]`'s lanes).
    ///
    /// # Safety
    /// AVX2 (inlined into [`attend`]).
    #[inline(always)]
    unsafe fn sum_each(a: [__m256; 8]) -> __m256 {
        // SAFETY: register-only AVX operations; the caller's CPU has AVX2.
        unsafe {
            // Each 128-bit half: [a0, a1, a2, a3] partial sums of its own half of the lanes.
            let s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            let s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            let lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
            let hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
            _mm256_add_ps(lo, hi)
        }
    }

    /// The sum of one vector's lanes.
    ///
    /// # Safety
    /// AVX2 (inlined into [`attend`]).
    #[inline(always)]
    unsafe fn sum(a: __m256) -> f32 {
        // SAFETY: register-only AVX operations; the caller's CPU has AVX2.
        unsafe {
            let half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
            _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
        }
    }

    /// `G` query heads' probabilities (`probs + g·len`, one per row) times `C` vectors of each
    /// value row (`values + rows[t]`), into `out + g·d`.
    #[derive(Clone, Copy)]
    struct ValuePass<'a> {
        values: *const f32,
        rows: &'a [usize],
        probs: *const f32,
        d: usize,
        out: *mut f32,
    }

    impl ValuePass<'_> {
        /// Inlined into [`attend`], whose AVX2 and FMA it compiles with.
        ///
        /// # Safety
        /// AVX2 and FMA; `8·C` floats readable at `values + row` for every row, `len` at
        /// `probs + g·len` and writable at `out + g·d` for every `g < G`.
        #[inline(always)]
        unsafe fn run<const G: usize, const C: usize>(&self) {
            let Self {
                values,
                rows,
                probs,
                d,
                out,
            } = *self;
            let len = rows.len();
            // SAFETY: the contract.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); C]; G];
                for (t, &row) in rows.iter().enumerate() {
                    if let Some(&ahead) = rows.get(t + AHEAD) {
                        prefetch(values.wrapping_add(ahead), 8 * C);
                    }
                    let v = values.add(row);
                    let vv: [__m256; C] = std::array::from_fn(|i| _mm256_loadu_ps(v.add(8 * i)));
                    for (g, acc_g) in acc.iter_mut().enumerate() {
                        let p = _mm256_set1_ps(*probs.add(g * len + t));
                        for (a, &v) in acc_g.iter_mut().zip(&vv) {
                            *a = _mm256_fmadd_ps(p, v, *a);
                        }
                    }
                }
                for (g, acc_g) in acc.iter().enumerate() {
                    for (i, &a) in acc_g.iter().enumerate() {
                        _mm256_storeu_ps(out.add(g * d + 8 * i), a);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Softmax attention of one query row over `len` key/value rows, computed plainly.
    fn reference(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], scale: f32) -> Vec<f32> {
        let s: Vec<f32> = k
            .iter()
            .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale)
            .collect();
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - max).exp()).collect();
        let sum: f32 = e.iter().sum();
        (0..q.len())
            .map(|j| e.iter().zip(v).map(|(p, v)| p * v[j]).sum::<f32>() / sum)
            .collect()
    }

    /// Both bodies, head dims with a constant-size portable path (16, 64), one without (24)
    /// and one the AVX2 body takes in single vectors (40), query groups that fill the value
    /// panels, leave a partial one (7 = 3 + 3 + 1) or none (1), and sequences whose lengths
    /// leave no, some, or only a tail of eight-key tiles, over scattered blocks: each output
    /// row equals plain attention over the sequence's own rows.
    #[test]
    fn matches_plain_attention_for_every_head_dim_and_body() {
        let (kv_heads, block_tokens, blocks) = (2, 4, 12);
        for (d, groups) in [(16, 3), (24, 3), (64, 7), (40, 1), (16, 2)] {
            let value = |i: usize| ((i * 7919) % 1000) as f32 / 500.0 - 1.0;
            let keys: Vec<f32> = (0..blocks * kv_heads * block_tokens * d)
                .map(value)
                .collect();
            let values: Vec<f32> = (0..keys.len()).map(|i| value(i + 13)).collect();
            let tables: [&[BlockId]; 3] = [&[7, 2, 9, 4, 10, 1], &[0, 11], &[3, 5, 6, 8]];
            let lens = [21, 5, 16];
            let q: Vec<f32> = (0..tables.len() * kv_heads * groups * d)
                .map(|i| value(i + 5))
                .collect();
            let shape = DecodeShape {
                kv_heads,
                groups,
                head_dim: d,
                block_tokens,
            };
            let scale = 1.0 / (d as f32).sqrt();
            let out = decode_attention(&keys, &values, &q, &tables, &lens, &shape, scale);
            let per_seq = kv_heads * groups * d;
            for (b, table) in tables.iter().enumerate() {
                for h in 0..kv_heads {
                    // Head-major blocks: kv head `h` of position `t` at row
                    // `(block · kv_heads + h) · block_tokens + t % block_tokens`.
                    let rows: Vec<usize> = (0..lens[b])
                        .map(|t| {
                            let block = table[t / block_tokens] as usize;
                            (block * kv_heads + h) * block_tokens + t % block_tokens
                        })
                        .collect();
                    let take = |pool: &[f32]| -> Vec<Vec<f32>> {
                        rows.iter().map(|r| pool[r * d..][..d].to_vec()).collect()
                    };
                    let (k, v) = (take(&keys), take(&values));
                    for g in 0..groups {
                        let at = b * per_seq + (h * groups + g) * d;
                        let want = reference(&q[at..at + d], &k, &v, scale);
                        for wide in [false, true] {
                            if wide && !crate::fused::avx2_fma() {
                                continue;
                            }
                            let seq = Seq {
                                keys: &keys,
                                values: &values,
                                q: &q[b * per_seq..][..per_seq],
                                table,
                                len: lens[b],
                            };
                            let mut one = vec![0f32; per_seq];
                            attend_dispatch(&seq, &shape, scale, &mut one, wide);
                            let got = &one[(h * groups + g) * d..][..d];
                            for ((x, y), z) in got.iter().zip(&want).zip(&out[at..at + d]) {
                                assert!(
                                    (x - y).abs() < 1e-5,
                                    "d {d}, groups {groups}, wide {wide}: {x} vs {y}"
                                );
                                assert!((z - y).abs() < 1e-5, "d {d}, groups {groups}: {z} vs {y}");
                            }
                        }
                    }
                }
            }
        }
    }
}
