//! Attention straight over the paged pool (CPU, f32): each new token's query reads its
//! sequence's cached keys and values where they lie, through its block table, up to its own
//! position. The general path gathers every sequence's rows into a padded `(B, kv_heads, T,
//! head_dim)` copy per layer and transposes it; once sequences grow past a few dozen tokens that
//! copy is most of a decode step (`sluice bench engine`, tiny preset, 256-token completions:
//! gather and transpose 43 % of the engine's time). Prompt chunks take the same path, a query
//! row per token: the padded path's index copies, masks and small batched products cost a
//! 1,024-token prefill of SmolLM2 (64 prompts of 16) about 3 ms per layer.
//!
//! Two bodies: AVX2 + FMA intrinsics (chosen at run time, for head dims of whole 8-wide vectors;
//! [`avx2`]) and portable loops for every other CPU and head dim. Sequences run in parallel only
//! when a step does enough work to pay for waking the pool.

use rayon::prelude::*;

use super::BlockId;

/// The shapes the kernel needs.
pub(super) struct PoolShape {
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

/// One step's attention. `keys` and `values` are one layer's pool, rows of `head_dim` in
/// head-major blocks (see [`row_offsets`]); `q` is `(R, heads, head_dim)` flat, one row per new
/// token, the query heads of kv head `h` being `h · groups .. (h + 1) · groups`; row `r`
/// attends to the first `lens[r]` tokens of its sequence (itself included) through
/// `tables[r]`. Returns `(R, heads · head_dim)` flat.
pub(super) fn attention(
    keys: &[f32],
    values: &[f32],
    q: &[f32],
    tables: &[&[BlockId]],
    lens: &[usize],
    shape: &PoolShape,
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
        // The next row's first keys, unless it is this sequence's next token (a prompt's).
        if let Some(&next) = tables.get(b + 1)
            && !std::ptr::eq(next, tables[b])
        {
            prefetch_start(keys, values, next, lens[b + 1], shape);
        }
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

/// Keys and values a row reads before the kernel's own prefetching reaches them.
const START_ROWS: usize = 16;

/// Asks for the first [`START_ROWS`] keys and values of every kv head of the row with `table`
/// and `len` visible tokens (the next one a thread attends), so they arrive while this row's
/// are multiplied: a sequence's rows sit in blocks scattered over the pool, and a decode step's
/// sequences are mostly that short.
fn prefetch_start(keys: &[f32], values: &[f32], table: &[BlockId], len: usize, shape: &PoolShape) {
    #[cfg(target_arch = "x86_64")]
    for t in 0..len.min(START_ROWS) {
        for h in 0..shape.kv_heads {
            let row = row_offset(table, t, shape) + h * head_stride(shape);
            for pool in [keys, values] {
                // SAFETY: a prefetch reads no memory and cannot fault; the CPU has SSE.
                #[allow(unsafe_code)]
                unsafe {
                    avx2::prefetch(pool.as_ptr().wrapping_add(row), shape.head_dim)
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (keys, values, table, len, shape);
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
fn attend_dispatch(seq: &Seq<'_>, shape: &PoolShape, scale: f32, out: &mut [f32], wide: bool) {
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
fn by_head_dim(seq: &Seq<'_>, shape: &PoolShape, scale: f32, out: &mut [f32]) {
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
fn row_offsets(seq: &Seq<'_>, shape: &PoolShape) -> Vec<usize> {
    (0..seq.len)
        .map(|t| row_offset(seq.table, t, shape))
        .collect()
}

/// Pool offset (in f32s) of kv head 0's row at position `t` of the sequence with `table`.
fn row_offset(table: &[BlockId], t: usize, shape: &PoolShape) -> usize {
    let PoolShape {
        kv_heads,
        head_dim,
        block_tokens,
        ..
    } = *shape;
    (table[t / block_tokens] as usize * kv_heads * block_tokens + t % block_tokens) * head_dim
}

/// Distance (in f32s) from a kv head's row to the next head's at the same position.
fn head_stride(shape: &PoolShape) -> usize {
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
fn attend_seq<const D: usize>(seq: &Seq<'_>, shape: &PoolShape, scale: f32, out: &mut [f32]) {
    let PoolShape {
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
mod avx2;

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
            let shape = PoolShape {
                kv_heads,
                groups,
                head_dim: d,
                block_tokens,
            };
            let scale = 1.0 / (d as f32).sqrt();
            let out = attention(&keys, &values, &q, &tables, &lens, &shape, scale);
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
