//! Decode attention straight over the paged pool (CPU, f32): each sequence's new query reads its
//! cached keys and values where they lie, through its block table. The general path gathers
//! every sequence's rows into a padded `(B, kv_heads, T, head_dim)` copy per layer and
//! transposes it; once sequences grow past a few dozen tokens that copy is most of a decode step
//! (`sluice bench engine`, tiny preset, 256-token completions: gather and transpose 43 % of the
//! engine's time).

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
    let DecodeShape {
        kv_heads,
        groups,
        head_dim: d,
        block_tokens,
    } = *shape;
    let width = kv_heads * d;
    let per_seq = kv_heads * groups * d;
    let mut out = vec![0f32; tables.len() * per_seq];
    out.par_chunks_mut(per_seq)
        .enumerate()
        .for_each(|(b, out_b)| {
            let len = lens[b];
            let rows: Vec<usize> = (0..len)
                .map(|t| tables[b][t / block_tokens] as usize * block_tokens + t % block_tokens)
                .collect();
            // (groups, len) scores of one kv head's queries: each key row is read once for all.
            let mut scores = vec![0f32; groups * len];
            for h in 0..kv_heads {
                let q_h = &q[(b * kv_heads + h) * groups * d..][..groups * d];
                for (t, &row) in rows.iter().enumerate() {
                    let k = &keys[row * width + h * d..][..d];
                    for (g, q_g) in q_h.chunks_exact(d).enumerate() {
                        scores[g * len + t] = dot(q_g, k) * scale;
                    }
                }
                for (g, s) in scores.chunks_exact_mut(len).enumerate() {
                    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    for x in s.iter_mut() {
                        *x -= max;
                    }
                    crate::fused::exp_f32_slice(s);
                    let sum: f32 = s.iter().sum();
                    let o = &mut out_b[(h * groups + g) * d..][..d];
                    for (&p, &row) in s.iter().zip(&rows) {
                        let v = &values[row * width + h * d..][..d];
                        let p = p / sum;
                        for (o, &v) in o.iter_mut().zip(v) {
                            *o += p * v;
                        }
                    }
                }
            }
        });
    out
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Four partial sums: lets the compiler vectorise without reassociating one long chain.
    let mut acc = [0f32; 4];
    let (a4, a_rest) = a.split_at(a.len() / 4 * 4);
    let (b4, b_rest) = b.split_at(a4.len());
    for (x, y) in a4.chunks_exact(4).zip(b4.chunks_exact(4)) {
        for i in 0..4 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a_rest.iter().zip(b_rest).map(|(x, y)| x * y).sum();
    acc[0] + acc[1] + acc[2] + acc[3] + tail
}
