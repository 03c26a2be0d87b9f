//! The attention's per-task kernels: one (row, kv head) pair's forward and backward over blocks of
//! queries, in plain loops the compiler vectorises, with AVX2 + FMA bodies chosen at run time.

use super::super::{Dst, Mat, Real};
use super::{Attention, AttentionHeads};

/// Queries per block: each block's scores are one `(QUERY_BLOCK, keys)` product, so memory stays
/// bounded for long rows and the causal waste is half of one diagonal block.
const QUERY_BLOCK: usize = 64;

/// Score elements a merged block may compute beyond its parts before two products are cheaper
/// (the fixed cost of a product call and of a softmax pass, in elements).
const MERGE_SLACK: usize = 256;

/// `Σ a[j] b[j]` over eight interleaved partial sums, so that the loop vectorises (float
/// additions are not reassociated otherwise).
#[inline(always)]
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let zero = T::from_f64(0.0);
    let mut acc = [zero; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = zero;
    for (&x, &y) in ar.iter().zip(br) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// One (row, kv head) task over the flat `(N, heads·d)` / `(N, kv_heads·d)` activations: every
/// product reads them in place through strides.
pub(super) struct Task<'a, T> {
    op: &'a Attention,
    b: usize,
    kh: usize,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
}

/// Keys `a..b` of a row that some queries skip (see [`Span`]).
type Gap = Option<(usize, usize)>;

/// One block of queries `i0..i1` and the keys `klo..i1` they may see, less `gap`: keys between
/// a shared prompt and the block's own segment, which none of its queries sees (the group's
/// earlier completions). The block's scores hold the keys before the gap, then those after it.
#[derive(Clone, Copy)]
struct Span {
    i0: usize,
    i1: usize,
    klo: usize,
    gap: Gap,
}

impl Span {
    fn rows(&self) -> usize {
        self.i1 - self.i0
    }
    fn keys(&self) -> usize {
        self.i1 - self.klo - self.gap.map_or(0, |(a, b)| b - a)
    }
    /// The block's runs of keys: `(first key, keys, first column of its scores)`.
    fn ranges(&self) -> impl Iterator<Item = (usize, usize, usize)> {
        let (a, b) = self.gap.unwrap_or((self.i1, self.i1));
        [(self.klo, a - self.klo, 0), (b, self.i1 - b, a - self.klo)]
            .into_iter()
            .filter(|r| r.1 > 0)
    }
    /// The key of score column `c`.
    fn key(&self, c: usize) -> usize {
        match self.gap {
            Some((a, b)) if c >= a - self.klo => b + c - (a - self.klo),
            _ => self.klo + c,
        }
    }
    /// The score column of key `j` (not in the gap).
    fn column(&self, j: usize) -> usize {
        match self.gap {
            Some((a, b)) if j >= b => j - b + (a - self.klo),
            _ => j - self.klo,
        }
    }
}

impl<'a, T: Real> Task<'a, T> {
    pub(super) fn new(op: &'a Attention, task: usize, [q, k, v]: [&'a [T]; 3]) -> Self {
        let kv = op.heads.kv_heads;
        Self {
            op,
            b: task / kv,
            kh: task % kv,
            q,
            k,
            v,
        }
    }

    fn l(&self) -> usize {
        self.op.segments.len
    }

    /// The query blocks of this row: runs of slots that see the same first key and skip the
    /// same gap (one packed segment, or a piece of it at most [`QUERY_BLOCK`] long), with
    /// neighbouring runs without a gap merged while one product over both costs no more than two
    /// (plus [`MERGE_SLACK`] for the call). A row packed with short segments then computes each
    /// segment's scores, not a `QUERY_BLOCK`-wide square that the mask mostly throws away (the
    /// quickstart packs ~29-slot texts into 128-slot rows: about a fifth of a 64 × 64 block was
    /// used), and a completion that continues a shared prompt skips the group's earlier
    /// completions between the two (the recipe's rows: a prompt and 8 replies; the walk was
    /// about 2.5 times the visible keys). Any split is exact: each block's keys start at or
    /// before every one of its queries' first key, and its gap holds none they see.
    fn spans(&self) -> Vec<Span> {
        let l = self.l();
        let first = &self.op.segments.first[self.b * l..(self.b + 1) * l];
        let gaps = self.gaps();
        let cost = |sp: &Span| sp.rows() * sp.keys();
        let mut out: Vec<Span> = Vec::new();
        let mut i0 = 0;
        while i0 < l {
            let (f, gap) = (first[i0], gaps[i0]);
            let mut i1 = i0 + 1;
            while i1 < l && i1 - i0 < QUERY_BLOCK && first[i1] == f && gaps[i1] == gap {
                i1 += 1;
            }
            let run = Span {
                i0,
                i1,
                klo: f as usize,
                gap,
            };
            match out.last_mut() {
                Some(last)
                    if i1 - last.i0 <= QUERY_BLOCK && last.gap.is_none() && gap.is_none() =>
                {
                    let merged = Span {
                        i0: last.i0,
                        i1,
                        klo: last.klo.min(run.klo),
                        gap: None,
                    };
                    if cost(&merged) <= cost(last) + cost(&run) + MERGE_SLACK {
                        *last = merged;
                    } else {
                        out.push(run);
                    }
                }
                _ => out.push(run),
            }
            i0 = i1;
        }
        out
    }

    /// Per slot of this row, the keys below it that it does not see although they lie between
    /// its first visible key and itself: from one past its prefix's last slot before its own
    /// segment starts up to that start (`None` without a prefix, or where nothing lies between).
    /// Slots of its own segment all lie at or after the start, and its prefix's slots before it
    /// below the gap, so the gap holds no key the slot sees.
    fn gaps(&self) -> Vec<Gap> {
        let seg = &*self.op.segments;
        let l = self.l();
        let (ids, prefixes) = (
            &seg.ids[self.b * l..(self.b + 1) * l],
            &seg.prefixes[self.b * l..(self.b + 1) * l],
        );
        // Per segment id seen so far: its last slot, and the gap of its slots.
        let mut seen: Vec<(u32, usize, Gap)> = Vec::new();
        let mut out = Vec::with_capacity(l);
        for (i, (&id, &prefix)) in ids.iter().zip(prefixes).enumerate() {
            let gap = match seen.iter_mut().find(|e| e.0 == id) {
                Some(e) => {
                    e.1 = i;
                    e.2
                }
                None => {
                    let last_of_prefix = seen.iter().find(|e| prefix != 0 && e.0 == prefix);
                    let gap = last_of_prefix.map(|e| (e.1 + 1, i)).filter(|&(a, b)| a < b);
                    seen.push((id, i, gap));
                    gap
                }
            };
            out.push(gap);
        }
        out
    }

    /// Offset of query head `hq` at slot `i` of this row in `(N, heads·d)`.
    fn q_at(&self, hq: usize, i: usize) -> usize {
        let AttentionHeads {
            heads: h,
            head_dim: d,
            ..
        } = self.op.heads;
        (self.b * self.l() + i) * h * d + hq * d
    }

    /// Offset of this task's kv head at slot `j` in `(N, kv_heads·d)`.
    fn kv_at(&self, j: usize) -> usize {
        let AttentionHeads {
            kv_heads: kv,
            head_dim: d,
            ..
        } = self.op.heads;
        (self.b * self.l() + j) * kv * d + self.kh * d
    }

    /// `lhs (span.rows, d)` times the transpose of the span's keys' rows of `of` (this task's
    /// `k` or `v`): `(span.rows, span.keys)`, a column per key, one product per run of keys.
    #[inline(always)]
    fn by_keys(&self, sp: Span, lhs: Mat<'_, T>, of: &[T]) -> Vec<T> {
        let AttentionHeads {
            kv_heads: kv,
            head_dim: d,
            ..
        } = self.op.heads;
        let (rows, keys) = (sp.rows(), sp.keys());
        let from = |j: usize| Mat {
            data: &of[self.kv_at(j)..],
            rs: 1,
            cs: kv * d,
        };
        if sp.gap.is_none() {
            return T::matmul_new(rows, keys, d, lhs, from(sp.klo));
        }
        let mut out = vec![T::from_f64(0.0); rows * keys];
        for (j, n, c) in sp.ranges() {
            let dst = Dst {
                data: &mut out[c..],
                rs: keys,
                accumulate: false,
            };
            T::matmul(rows, n, d, dst, lhs, from(j));
        }
        out
    }

    /// `(span.rows, span.keys)` probabilities of query head `hq`: `s Q Kᵀ`, masked, then
    /// `exp(· − lse)` with the given per-query `lse`, or (without one) softmax-normalised
    /// with each row's log-sum-exp written to `lse_out`.
    #[inline(always)]
    fn probs(&self, hq: usize, sp: Span, lse: Option<&[T]>, lse_out: &mut [T]) -> Vec<T> {
        let AttentionHeads {
            heads: h,
            head_dim: d,
            ..
        } = self.op.heads;
        let keys = sp.keys();
        let zero = T::from_f64(0.0);
        let q = Mat {
            data: &self.q[self.q_at(hq, sp.i0)..],
            rs: h * d,
            cs: 1,
        };
        let mut s = self.by_keys(sp, q, self.k);
        let scale = T::from_f64(self.op.scale());
        let seg = &*self.op.segments;
        let first = &seg.first[self.b * self.l()..];
        for (r, row) in s.chunks_exact_mut(keys).enumerate() {
            let i = sp.i0 + r;
            let lo = first[i] as usize;
            for (c, x) in row.iter_mut().enumerate() {
                let j = sp.key(c);
                *x = if j >= lo && j <= i && seg.allowed(self.b, i, j) {
                    *x * scale
                } else {
                    T::from_f64(f64::NEG_INFINITY)
                };
            }
            // Slot i always sees itself: the row maximum is finite.
            let m = match lse {
                Some(lse) => lse[r],
                None => row
                    .iter()
                    .fold(row[sp.column(i)], |a, &x| if x > a { x } else { a }),
            };
            for x in row.iter_mut() {
                *x -= m;
            }
            T::exp_slice(row);
            if lse.is_none() {
                let mut sum = zero;
                for &x in row.iter() {
                    sum += x;
                }
                let inv = T::from_f64(1.0) / sum;
                for x in row.iter_mut() {
                    *x *= inv;
                }
                lse_out[r] = m + sum.ln();
            }
        }
        s
    }

    /// The g query heads' `(L, d)` outputs and `L` log-sum-exps.
    #[inline(always)]
    fn forward(&self) -> (Vec<T>, Vec<T>) {
        let l = self.l();
        let AttentionHeads {
            kv_heads: kv,
            head_dim: d,
            ..
        } = self.op.heads;
        let g = self.op.groups();
        let zero = T::from_f64(0.0);
        let mut out = vec![zero; g * l * d];
        let mut lse = vec![zero; g * l];
        for sp in self.spans() {
            for gi in 0..g {
                let hq = self.kh * g + gi;
                let lse_rows = &mut lse[gi * l + sp.i0..gi * l + sp.i1];
                let p = self.probs(hq, sp, None, lse_rows);
                let out = &mut out[(gi * l + sp.i0) * d..(gi * l + sp.i1) * d];
                for (x, (j, n, c)) in sp.ranges().enumerate() {
                    T::matmul(
                        sp.rows(),
                        d,
                        n,
                        Dst {
                            data: &mut *out,
                            rs: d,
                            accumulate: x > 0,
                        },
                        Mat {
                            data: &p[c..],
                            rs: sp.keys(),
                            cs: 1,
                        },
                        Mat {
                            data: &self.v[self.kv_at(j)..],
                            rs: kv * d,
                            cs: 1,
                        },
                    );
                }
            }
        }
        (out, lse)
    }

    /// `(dQ (g, L, d), dK (L, d), dV (L, d))` of this task.
    #[inline(always)]
    fn backward(&self, o: &[T], lse: &[T], dout: &[T]) -> Block<T> {
        let l = self.l();
        let AttentionHeads {
            heads: h,
            kv_heads: kv,
            head_dim: d,
        } = self.op.heads;
        let g = self.op.groups();
        let scale = T::from_f64(self.op.scale());
        let zero = T::from_f64(0.0);
        let mut dq = vec![zero; g * l * d];
        let mut dk = vec![zero; l * d];
        let mut dv = vec![zero; l * d];
        let mut unused = [];
        for sp in self.spans() {
            let (rows, keys) = (sp.rows(), sp.keys());
            for gi in 0..g {
                let hq = self.kh * g + gi;
                let lse_rows = &lse[(self.b * h + hq) * l + sp.i0..(self.b * h + hq) * l + sp.i1];
                let p = self.probs(hq, sp, Some(lse_rows), &mut unused);
                let q0 = self.q_at(hq, sp.i0);
                let d_out = Mat {
                    data: &dout[q0..],
                    rs: h * d,
                    cs: 1,
                };
                // dP = dO Vᵀ, then dS = s · P ⊙ (dP − rowsum(dO ⊙ O)).
                let mut ds = self.by_keys(sp, d_out, self.v);
                for (r, (dsr, pr)) in ds
                    .chunks_exact_mut(keys)
                    .zip(p.chunks_exact(keys))
                    .enumerate()
                {
                    let at = self.q_at(hq, sp.i0 + r);
                    let di = dot(&dout[at..at + d], &o[at..at + d]);
                    for (x, &pj) in dsr.iter_mut().zip(pr) {
                        *x = pj * (*x - di) * scale;
                    }
                }
                // Per run of keys (columns c.. of dS and P): dQ (+)= dS K, dK += dSᵀ Q,
                // dV += Pᵀ dO.
                let dq = &mut dq[(gi * l + sp.i0) * d..(gi * l + sp.i1) * d];
                for (x, (j, n, c)) in sp.ranges().enumerate() {
                    let (ds_c, p_c) = (
                        Mat {
                            data: &ds[c..],
                            rs: keys,
                            cs: 1,
                        },
                        Mat {
                            data: &p[c..],
                            rs: keys,
                            cs: 1,
                        },
                    );
                    let dst = Dst {
                        data: &mut *dq,
                        rs: d,
                        accumulate: x > 0,
                    };
                    let k = Mat {
                        data: &self.k[self.kv_at(j)..],
                        rs: kv * d,
                        cs: 1,
                    };
                    T::matmul(rows, d, n, dst, ds_c, k);
                    let q = Mat {
                        data: &self.q[q0..],
                        rs: h * d,
                        cs: 1,
                    };
                    let kr = j * d..(j + n) * d;
                    let dk = Dst::adding(&mut dk[kr.clone()], d);
                    T::matmul(n, d, rows, dk, ds_c.t(), q);
                    let dv = Dst::adding(&mut dv[kr], d);
                    T::matmul(n, d, rows, dv, p_c.t(), d_out);
                }
            }
        }
        (dq, dk, dv)
    }
}

pub(super) type Block<T> = (Vec<T>, Vec<T>, Vec<T>);

/// The task bodies compiled for AVX2 + FMA, chosen at run time where the CPU has them (the
/// crate itself targets baseline x86-64, SSE2).
#[cfg(target_arch = "x86_64")]
mod wide {
    use super::{Block, Real, Task};

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn forward<T: Real>(t: &Task<'_, T>) -> (Vec<T>, Vec<T>) {
        t.forward()
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn backward<T: Real>(t: &Task<'_, T>, ins: [&[T]; 3]) -> Block<T> {
        t.backward(ins[0], ins[1], ins[2])
    }
}

#[allow(unsafe_code)]
pub(super) fn run_forward<T: Real>(t: &Task<'_, T>) -> (Vec<T>, Vec<T>) {
    #[cfg(target_arch = "x86_64")]
    if crate::fused::avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above).
        return unsafe { wide::forward(t) };
    }
    t.forward()
}

#[allow(unsafe_code)]
pub(super) fn run_backward<T: Real>(t: &Task<'_, T>, ins: [&[T]; 3]) -> Block<T> {
    #[cfg(target_arch = "x86_64")]
    if crate::fused::avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above).
        return unsafe { wide::backward(t, ins) };
    }
    t.backward(ins[0], ins[1], ins[2])
}
