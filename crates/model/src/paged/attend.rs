//! Decode attention straight over the paged pool (CPU, f32): each sequence's new query reads its
//! cached keys and values where they lie, through its block table. The general path gathers
//! every sequence's rows into a padded `(B, kv_heads, T, head_dim)` copy per layer and
//! transposes it; once sequences grow past a few dozen tokens that copy is most of a decode step
//! (`sluice bench engine`, tiny preset, 256-token completions: gather and transpose 43 % of the
//! engine's time).
//!
//! The loops are written for 8-wide vectors and compiled twice: for baseline x86-64 and, chosen
//! at run time, for AVX2 + FMA. Sequences run in parallel only when a step does enough work to
//! pay for waking the pool.

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

/// One decode step's attention. `keys` and `values` are one layer's pool, rows of
/// `kv_heads · head_dim`; `q` is `(B, heads, head_dim)` flat, the query heads of kv head `h`
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
    if wide {
        // SAFETY: `wide` is `avx2_fma()`: the CPU has AVX2 and FMA.
        return unsafe { attend_wide(seq, shape, scale, out) };
    }
    let _ = wide;
    by_head_dim::<false>(seq, shape, scale, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_wide(seq: &Seq<'_>, shape: &DecodeShape, scale: f32, out: &mut [f32]) {
    by_head_dim::<true>(seq, shape, scale, out);
}

/// [`attend_seq`] with the head dim as a constant for the common sizes, so the per-key loops
/// unroll and the output rows stay in registers; any other size runs the same loops with the
/// dim read at run time.
///
/// `FMA`: compiled inside [`attend_wide`], so products and sums fuse into one instruction
/// (elsewhere `mul_add` would be a library call per element).
#[inline(always)]
fn by_head_dim<const FMA: bool>(seq: &Seq<'_>, shape: &DecodeShape, scale: f32, out: &mut [f32]) {
    match shape.head_dim {
        16 => attend_seq::<16, FMA>(seq, shape, scale, out),
        32 => attend_seq::<32, FMA>(seq, shape, scale, out),
        64 => attend_seq::<64, FMA>(seq, shape, scale, out),
        128 => attend_seq::<128, FMA>(seq, shape, scale, out),
        _ => attend_seq::<0, FMA>(seq, shape, scale, out),
    }
}

/// `a · b + c`, fused where the body is compiled with FMA.
#[inline(always)]
fn mul_add<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// One sequence's attention, every kv head: scores of the head's query group against each key
/// row (each row read once for the whole group), softmax, then the value rows weighted into
/// `out` (`(heads, head_dim)` flat). `D` is the head dim, or 0 to read it from `shape`.
#[inline(always)]
fn attend_seq<const D: usize, const FMA: bool>(
    seq: &Seq<'_>,
    shape: &DecodeShape,
    scale: f32,
    out: &mut [f32],
) {
    let DecodeShape {
        kv_heads,
        groups,
        head_dim,
        block_tokens,
    } = *shape;
    let d = if D == 0 { head_dim } else { D };
    let (width, len) = (kv_heads * d, seq.len);
    let rows: Vec<usize> = (0..len)
        .map(|t| seq.table[t / block_tokens] as usize * block_tokens + t % block_tokens)
        .collect();
    // (groups, len) scores of one kv head's queries.
    let mut scores = vec![0f32; groups * len];
    // One output row, accumulated here rather than in `out`, so it can live in registers.
    let mut acc = vec![0f32; d];
    for h in 0..kv_heads {
        let q_h = &seq.q[h * groups * d..][..groups * d];
        for (t, &row) in rows.iter().enumerate() {
            let k = &seq.keys[row * width + h * d..][..d];
            for (g, q_g) in q_h.chunks_exact(d).enumerate() {
                scores[g * len + t] = dot::<FMA>(&q_g[..d], k) * scale;
            }
        }
        for (g, s) in scores.chunks_exact_mut(len).enumerate() {
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for x in s.iter_mut() {
                *x -= max;
            }
            crate::fused::exp_f32_slice(s);
            let inv = 1.0 / s.iter().sum::<f32>();
            let acc = &mut acc[..d];
            acc.fill(0.0);
            for (&p, &row) in s.iter().zip(&rows) {
                let v = &seq.values[row * width + h * d..][..d];
                for (a, &v) in acc.iter_mut().zip(v) {
                    *a = mul_add::<FMA>(p, v, *a);
                }
            }
            let o = &mut out[(h * groups + g) * d..][..d];
            for (o, &a) in o.iter_mut().zip(acc.iter()) {
                *o = a * inv;
            }
        }
    }
}

/// `a · b` in eight partial sums (one 8-wide vector), so the loop vectorises without
/// reassociating one long chain.
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] = mul_add::<FMA>(x[i], y[i], acc[i]);
        }
    }
    let tail: f32 = a_rest.iter().zip(b_rest).map(|(x, y)| x * y).sum();
    let (lo, hi) = acc.split_at(4);
    (lo[0] + hi[0]) + (lo[1] + hi[1]) + (lo[2] + hi[2]) + (lo[3] + hi[3]) + tail
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

    /// Both compiled bodies, a head dim with a constant-size path (16) and one without (24),
    /// sequences of different lengths over scattered blocks: each output row equals plain
    /// attention over the sequence's own rows.
    #[test]
    fn matches_plain_attention_for_every_head_dim_and_body() {
        let (kv_heads, groups, block_tokens, blocks) = (2, 3, 4, 12);
        for d in [16, 24] {
            let width = kv_heads * d;
            let value = |i: usize| ((i * 7919) % 1000) as f32 / 500.0 - 1.0;
            let keys: Vec<f32> = (0..blocks * block_tokens * width).map(value).collect();
            let values: Vec<f32> = (0..keys.len()).map(|i| value(i + 13)).collect();
            let tables: [&[BlockId]; 2] = [&[7, 2, 9], &[0, 11]];
            let lens = [10, 5];
            let q: Vec<f32> = (0..2 * kv_heads * groups * d)
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
                let rows: Vec<usize> = (0..lens[b])
                    .map(|t| table[t / block_tokens] as usize * block_tokens + t % block_tokens)
                    .collect();
                for h in 0..kv_heads {
                    let take = |pool: &[f32]| -> Vec<Vec<f32>> {
                        rows.iter()
                            .map(|r| pool[r * width + h * d..][..d].to_vec())
                            .collect()
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
                                assert!((x - y).abs() < 1e-5, "d {d}: {x} vs {y}");
                                assert!((z - y).abs() < 1e-5, "d {d}: {z} vs {y}");
                            }
                        }
                    }
                }
            }
        }
    }
}
