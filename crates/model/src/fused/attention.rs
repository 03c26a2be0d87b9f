//! Causal self-attention over packed segments, forward and backward, without materialising the
//! `(B, heads, L, L)` scores, the additive mask or head-transposed copies.
//!
//! Slot `i` of a row attends to slot `j` iff `j ≤ i` and both carry the same segment id (the
//! training mask, [`crate::PackedBatch`]). The forward keeps only the log-sum-exp of each query's
//! scores; the backward recomputes the probabilities from it (as FlashAttention does):
//!
//! * `P = softmax(s Q Kᵀ + mask)`, `O = P V`
//! * `dV = Pᵀ dO`, `dP = dO Vᵀ`, `dS = P ⊙ (dP − rowsum(dO ⊙ O))`
//! * `dQ = s dS K`, `dK = s dSᵀ Q`
//!
//! Work is split over (row, kv head) pairs; each task owns its kv head's `dK`, `dV` and the
//! `dQ` of the query heads that share it (GQA), so nothing is reduced across threads.

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{Real, cpu_slice, storage_slice, tensor};

/// The packing of one batch, built once and shared by every layer: for each slot the first slot
/// of the row its query may see.
#[derive(Debug, Clone)]
pub struct Segments {
    batch: usize,
    len: usize,
    ids: Vec<u32>,
    first: Vec<u32>,
    /// Every segment is one run of slots (always so for [`crate::PackedBatch::from_rows`]); if
    /// not, keys inside `[first, i]` are checked one by one.
    runs: bool,
}

impl Segments {
    /// From the `(batch, len)` row-major segment ids of a packed batch.
    pub fn new(batch: usize, len: usize, segment_ids: &[u32]) -> Result<Self> {
        if segment_ids.len() != batch * len || len == 0 {
            candle_core::bail!(
                "segments: {} ids for {batch} rows of {len}",
                segment_ids.len()
            )
        }
        let mut first = vec![0u32; batch * len];
        let mut runs = true;
        for r in 0..batch {
            let row = &segment_ids[r * len..(r + 1) * len];
            let mut seen: Vec<(u32, u32)> = Vec::new();
            for (i, &s) in row.iter().enumerate() {
                let f = match seen.iter().find(|(id, _)| *id == s) {
                    Some(&(_, f)) => {
                        if i > 0 && row[i - 1] != s {
                            runs = false;
                        }
                        f
                    }
                    None => {
                        seen.push((s, i as u32));
                        i as u32
                    }
                };
                first[r * len + i] = f;
            }
        }
        Ok(Self {
            batch,
            len,
            ids: segment_ids.to_vec(),
            first,
            runs,
        })
    }

    fn allowed(&self, row: usize, i: usize, j: usize) -> bool {
        self.runs || self.ids[row * self.len + i] == self.ids[row * self.len + j]
    }
}

/// Heads of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionHeads {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

/// `q (N, heads·d)`, `k`, `v (N, kv_heads·d)` with `N = batch·len` of `segments` →
/// `(N, heads·d)`, scores scaled by `1/√d`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    segments: &Arc<Segments>,
    heads: AttentionHeads,
) -> Result<Tensor> {
    let n = segments.batch * segments.len;
    let AttentionHeads {
        heads: h,
        kv_heads: kv,
        head_dim: d,
    } = heads;
    if kv == 0 || h % kv != 0 || d == 0 {
        candle_core::bail!("attention: {h} heads over {kv} kv heads of {d}")
    }
    if q.dims2()? != (n, h * d) || k.dims2()? != (n, kv * d) || v.dims2()? != (n, kv * d) {
        candle_core::bail!(
            "attention: q {:?} k {:?} v {:?} for {n} slots",
            q.shape(),
            k.shape(),
            v.shape()
        )
    }
    let op = Attention {
        segments: Arc::clone(segments),
        heads,
        lse: OnceLock::new(),
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

struct Attention {
    segments: Arc<Segments>,
    heads: AttentionHeads,
    /// Log-sum-exp of each query's scores, `(batch, heads, len)`, set by the forward.
    lse: OnceLock<Tensor>,
}

/// One head's `(L, d)` block out of a `(N, width)` activation, row `b`'s slots, transposed to
/// `(d, L)`: every inner loop below then runs over keys, long and contiguous.
#[inline(always)]
fn gather_t<T: Real>(src: &[T], (b, l): (usize, usize), width: usize, off: usize, d: usize) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); l * d];
    for i in 0..l {
        let at = (b * l + i) * width + off;
        for (c, &v) in src[at..at + d].iter().enumerate() {
            out[c * l + i] = v;
        }
    }
    out
}

/// `dst[j] += a · src[j]`.
#[inline(always)]
fn axpy<T: Real>(dst: &mut [T], a: T, src: &[T]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += a * s;
    }
}

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

/// One (row, kv head) task: the transposed keys and values of its slots.
struct Task<'a, T> {
    op: &'a Attention,
    b: usize,
    kh: usize,
    kt: Vec<T>,
    vt: Vec<T>,
}

impl<'a, T: Real> Task<'a, T> {
    fn new(op: &'a Attention, task: usize, k: &[T], v: &[T]) -> Self {
        let AttentionHeads { kv_heads: kv, head_dim: d, .. } = op.heads;
        let (b, kh) = (task / kv, task % kv);
        let at = (b, op.segments.len);
        Self {
            op,
            b,
            kh,
            kt: gather_t(k, at, kv * d, kh * d, d),
            vt: gather_t(v, at, kv * d, kh * d, d),
        }
    }

    /// Keys visible from slot `i`: `lo..=i`.
    #[inline(always)]
    fn lo(&self, i: usize) -> usize {
        self.op.segments.first[self.b * self.op.segments.len + i] as usize
    }

    /// Offset of query head `gi` of this task at slot `i` in a `(N, heads·d)` activation.
    #[inline(always)]
    fn at(&self, gi: usize, i: usize) -> usize {
        let AttentionHeads { heads: h, head_dim: d, .. } = self.op.heads;
        (self.b * self.op.segments.len + i) * h * d + (self.kh * self.op.groups() + gi) * d
    }

    /// `s[j] = scale · q · k_j` for `j` in `lo..=i`; masked keys get −∞.
    #[inline(always)]
    fn scores(&self, s: &mut [T], q: &[T], (lo, i): (usize, usize)) {
        let l = self.op.segments.len;
        let scale = T::from_f64(self.op.scale());
        let s = &mut s[lo..=i];
        s.fill(T::from_f64(0.0));
        for (c, &qc) in q.iter().enumerate() {
            axpy(s, qc, &self.kt[c * l + lo..=c * l + i]);
        }
        let seg = &*self.op.segments;
        for (j, v) in s.iter_mut().enumerate() {
            *v = if seg.allowed(self.b, i, lo + j) {
                *v * scale
            } else {
                T::from_f64(f64::NEG_INFINITY)
            };
        }
    }

    /// The g query heads' `(L, d)` outputs and L log-sum-exps.
    #[inline(always)]
    fn forward(&self, q: &[T]) -> (Vec<T>, Vec<T>) {
        let l = self.op.segments.len;
        let d = self.op.heads.head_dim;
        let g = self.op.groups();
        let zero = T::from_f64(0.0);
        let mut out = vec![zero; g * l * d];
        let mut lse = vec![zero; g * l];
        let mut s = vec![zero; l];
        for gi in 0..g {
            for i in 0..l {
                let lo = self.lo(i);
                let at = self.at(gi, i);
                self.scores(&mut s, &q[at..at + d], (lo, i));
                let row = &mut s[lo..=i];
                let m = row.iter().fold(row[row.len() - 1], |a, &x| if x > a { x } else { a });
                for x in row.iter_mut() {
                    *x = *x - m;
                }
                T::exp_slice(row);
                let mut sum = zero;
                for &x in row.iter() {
                    sum += x;
                }
                let inv = T::from_f64(1.0) / sum;
                let o = &mut out[(gi * l + i) * d..(gi * l + i + 1) * d];
                for (c, oc) in o.iter_mut().enumerate() {
                    *oc = dot(row, &self.vt[c * l + lo..=c * l + i]) * inv;
                }
                lse[gi * l + i] = m + sum.ln();
            }
        }
        (out, lse)
    }

    /// `(dQ (g, L, d), dK (L, d), dV (L, d))` of this task.
    #[inline(always)]
    fn backward(&self, q: &[T], o: &[T], lse: &[T], dout: &[T]) -> Block<T> {
        let seg = &*self.op.segments;
        let l = seg.len;
        let AttentionHeads { heads: h, head_dim: d, .. } = self.op.heads;
        let g = self.op.groups();
        let scale = T::from_f64(self.op.scale());
        let zero = T::from_f64(0.0);
        let mut dq = vec![zero; g * l * d];
        // dKᵀ and dVᵀ, (d, L): accumulated along keys.
        let mut dkt = vec![zero; l * d];
        let mut dvt = vec![zero; l * d];
        let (mut p, mut ds) = (vec![zero; l], vec![zero; l]);
        for gi in 0..g {
            let hq = self.kh * g + gi;
            for i in 0..l {
                let lo = self.lo(i);
                let at = self.at(gi, i);
                let (qi, doi, oi) = (&q[at..at + d], &dout[at..at + d], &o[at..at + d]);
                self.scores(&mut p, qi, (lo, i));
                let m = lse[(self.b * h + hq) * l + i];
                let pr = &mut p[lo..=i];
                for x in pr.iter_mut() {
                    *x = *x - m;
                }
                T::exp_slice(pr);
                // dP_j = dO_i · v_j, then dS = P ⊙ (dP − dO_i · O_i), scaled for dQ and dK.
                let dsr = &mut ds[lo..=i];
                dsr.fill(zero);
                for (c, &gc) in doi.iter().enumerate() {
                    axpy(dsr, gc, &self.vt[c * l + lo..=c * l + i]);
                }
                let di = dot(doi, oi);
                for (x, &pj) in dsr.iter_mut().zip(pr.iter()) {
                    *x = pj * (*x - di) * scale;
                }
                let dqi = &mut dq[(gi * l + i) * d..(gi * l + i + 1) * d];
                for c in 0..d {
                    let (lo_c, hi_c) = (c * l + lo, c * l + i);
                    dqi[c] = dot(dsr, &self.kt[lo_c..=hi_c]);
                    axpy(&mut dkt[lo_c..=hi_c], qi[c], dsr);
                    axpy(&mut dvt[lo_c..=hi_c], doi[c], pr);
                }
            }
        }
        (dq, transpose(&dkt, d, l), transpose(&dvt, d, l))
    }
}

/// The `(cols, rows)` transpose of a row-major `(rows, cols)` block.
fn transpose<T: Real>(m: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = m[r * cols + c];
        }
    }
    out
}

type Block<T> = (Vec<T>, Vec<T>, Vec<T>);

/// The task bodies compiled for AVX2 + FMA, chosen at run time where the CPU has them (the
/// crate itself targets baseline x86-64, SSE2).
#[cfg(target_arch = "x86_64")]
mod wide {
    use super::{Block, Real, Task};

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn forward<T: Real>(t: &Task<'_, T>, q: &[T]) -> (Vec<T>, Vec<T>) {
        t.forward(q)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn backward<T: Real>(t: &Task<'_, T>, ins: [&[T]; 4]) -> Block<T> {
        t.backward(ins[0], ins[1], ins[2], ins[3])
    }
}

fn wide_ok() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[allow(unsafe_code)]
fn run_forward<T: Real>(t: &Task<'_, T>, q: &[T]) -> (Vec<T>, Vec<T>) {
    #[cfg(target_arch = "x86_64")]
    if wide_ok() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above).
        return unsafe { wide::forward(t, q) };
    }
    t.forward(q)
}

#[allow(unsafe_code)]
fn run_backward<T: Real>(t: &Task<'_, T>, ins: [&[T]; 4]) -> Block<T> {
    #[cfg(target_arch = "x86_64")]
    if wide_ok() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above).
        return unsafe { wide::backward(t, ins) };
    }
    t.backward(ins[0], ins[1], ins[2], ins[3])
}

impl Attention {
    fn groups(&self) -> usize {
        self.heads.heads / self.heads.kv_heads
    }

    fn scale(&self) -> f64 {
        1.0 / (self.heads.head_dim as f64).sqrt()
    }

    /// `(O, lse)`.
    fn fwd<T: Real>(&self, q: &[T], k: &[T], v: &[T]) -> (Vec<T>, Vec<T>) {
        let seg = &*self.segments;
        let (bsz, l) = (seg.batch, seg.len);
        let AttentionHeads {
            heads: h,
            kv_heads: kv,
            head_dim: d,
        } = self.heads;
        let g = self.groups();
        let zero = T::from_f64(0.0);
        // Per (row, kv head): the (L, d) outputs and L log-sum-exps of its g query heads.
        let blocks: Vec<(Vec<T>, Vec<T>)> = (0..bsz * kv)
            .into_par_iter()
            .map(|task| run_forward(&Task::new(self, task, k, v), q))
            .collect();
        let mut out = vec![zero; bsz * l * h * d];
        let mut lse = vec![zero; bsz * h * l];
        for (task, (o, ls)) in blocks.into_iter().enumerate() {
            let (b, kh) = (task / kv, task % kv);
            for gi in 0..g {
                let hq = kh * g + gi;
                for i in 0..l {
                    let at = (b * l + i) * h * d + hq * d;
                    out[at..at + d].copy_from_slice(&o[(gi * l + i) * d..(gi * l + i + 1) * d]);
                }
                lse[(b * h + hq) * l..(b * h + hq + 1) * l]
                    .copy_from_slice(&ls[gi * l..(gi + 1) * l]);
            }
        }
        (out, lse)
    }

    /// `(dQ, dK, dV)`.
    fn bwd<T: Real>(&self, ins: [&[T]; 3], o: &[T], lse: &[T], dout: &[T]) -> [Vec<T>; 3] {
        let [q, k, v] = ins;
        let seg = &*self.segments;
        let (bsz, l) = (seg.batch, seg.len);
        let AttentionHeads {
            heads: h,
            kv_heads: kv,
            head_dim: d,
        } = self.heads;
        let g = self.groups();
        let zero = T::from_f64(0.0);
        let blocks: Vec<Block<T>> = (0..bsz * kv)
            .into_par_iter()
            .map(|task| run_backward(&Task::new(self, task, k, v), [q, o, lse, dout]))
            .collect();
        let mut dq = vec![zero; bsz * l * h * d];
        let mut dk = vec![zero; bsz * l * kv * d];
        let mut dv = vec![zero; bsz * l * kv * d];
        for (task, (bq, bk, bv)) in blocks.into_iter().enumerate() {
            let (b, kh) = (task / kv, task % kv);
            for i in 0..l {
                for gi in 0..g {
                    let at = (b * l + i) * h * d + (kh * g + gi) * d;
                    dq[at..at + d].copy_from_slice(&bq[(gi * l + i) * d..(gi * l + i + 1) * d]);
                }
                let at = (b * l + i) * kv * d + kh * d;
                dk[at..at + d].copy_from_slice(&bk[i * d..(i + 1) * d]);
                dv[at..at + d].copy_from_slice(&bv[i * d..(i + 1) * d]);
            }
        }
        [dq, dk, dv]
    }

    fn cpu<T: Real>(
        &self,
        ins: [&[T]; 3],
        wrap: fn(Vec<T>) -> CpuStorage,
    ) -> Result<(CpuStorage, Shape)> {
        let (out, lse) = self.fwd(ins[0], ins[1], ins[2]);
        let seg = &self.segments;
        let lse = tensor(lse, &Shape::from((seg.batch, self.heads.heads, seg.len)))?;
        let _ = self.lse.set(lse);
        let shape = Shape::from((seg.batch * seg.len, self.heads.heads * self.heads.head_dim));
        Ok((wrap(out), shape))
    }

    fn grads<T: Real>(
        &self,
        [q, k, v]: [&Tensor; 3],
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<[Tensor; 3]> {
        let Some(lse) = self.lse.get() else {
            candle_core::bail!("attention: backward before forward")
        };
        let g = grad.contiguous()?;
        let [dq, dk, dv] = {
            let guards = [q, k, v, res, lse, &g].map(|t| t.storage_and_layout());
            let s = |i: usize| storage_slice::<T>(&guards[i].0, guards[i].1);
            self.bwd([s(0)?, s(1)?, s(2)?], s(3)?, s(4)?, s(5)?)
        };
        Ok([
            tensor(dq, q.shape())?,
            tensor(dk, k.shape())?,
            tensor(dv, v.shape())?,
        ])
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "fused-packed-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        super::same_dtype(self.name(), s1, s2)?;
        match super::same_dtype(self.name(), s1, s3)? {
            DType::F32 => self.cpu(
                [cpu_slice(s1, l1)?, cpu_slice(s2, l2)?, cpu_slice(s3, l3)?],
                CpuStorage::F32,
            ),
            _ => self.cpu(
                [cpu_slice(s1, l1)?, cpu_slice(s2, l2)?, cpu_slice(s3, l3)?],
                CpuStorage::F64,
            ),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dq, dk, dv] = match q.dtype() {
            DType::F32 => self.grads::<f32>([q, k, v], res, grad)?,
            _ => self.grads::<f64>([q, k, v], res, grad)?,
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
