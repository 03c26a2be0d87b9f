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

use super::{Dst, Mat, Real, cpu_slice, storage_slice, tensor};

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

/// Queries per block: each block's scores are one `(QUERY_BLOCK, keys)` product, so memory stays
/// bounded for long rows and the causal waste is half of one diagonal block.
const QUERY_BLOCK: usize = 64;

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
struct Task<'a, T> {
    op: &'a Attention,
    b: usize,
    kh: usize,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
}

/// One block of queries `i0..i1` and the keys `klo..i1` they may see.
#[derive(Clone, Copy)]
struct Span {
    i0: usize,
    i1: usize,
    klo: usize,
}

impl Span {
    fn rows(&self) -> usize {
        self.i1 - self.i0
    }
    fn keys(&self) -> usize {
        self.i1 - self.klo
    }
}

impl<'a, T: Real> Task<'a, T> {
    fn new(op: &'a Attention, task: usize, [q, k, v]: [&'a [T]; 3]) -> Self {
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

    /// The query blocks of this row.
    fn spans(&self) -> Vec<Span> {
        let l = self.l();
        let first = &self.op.segments.first[self.b * l..(self.b + 1) * l];
        (0..l)
            .step_by(QUERY_BLOCK)
            .map(|i0| {
                let i1 = (i0 + QUERY_BLOCK).min(l);
                let klo = first[i0..i1].iter().copied().min().unwrap_or(0) as usize;
                Span { i0, i1, klo }
            })
            .collect()
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

    /// `(span.rows, span.keys)` probabilities of query head `hq`: `s Q Kᵀ`, masked, then
    /// `exp(· − lse)` with the given per-query `lse`, or (without one) softmax-normalised
    /// with each row's log-sum-exp written to `lse_out`.
    #[inline(always)]
    fn probs(&self, hq: usize, sp: Span, lse: Option<&[T]>, lse_out: &mut [T]) -> Vec<T> {
        let AttentionHeads {
            heads: h,
            kv_heads: kv,
            head_dim: d,
        } = self.op.heads;
        let (rows, keys) = (sp.rows(), sp.keys());
        let zero = T::from_f64(0.0);
        let mut s = vec![zero; rows * keys];
        let q0 = self.q_at(hq, sp.i0);
        let k0 = self.kv_at(sp.klo);
        T::matmul(
            rows,
            keys,
            d,
            Dst::rows(&mut s, keys),
            Mat {
                data: &self.q[q0..],
                rs: h * d,
                cs: 1,
            },
            Mat {
                data: &self.k[k0..],
                rs: 1,
                cs: kv * d,
            },
        );
        let scale = T::from_f64(self.op.scale());
        let seg = &*self.op.segments;
        let first = &seg.first[self.b * self.l()..];
        for (r, row) in s.chunks_exact_mut(keys).enumerate() {
            let i = sp.i0 + r;
            let lo = first[i] as usize;
            for (jj, x) in row.iter_mut().enumerate() {
                let j = sp.klo + jj;
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
                    .fold(row[i - sp.klo], |a, &x| if x > a { x } else { a }),
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
                let v0 = self.kv_at(sp.klo);
                T::matmul(
                    sp.rows(),
                    d,
                    sp.keys(),
                    Dst::rows(&mut out[(gi * l + sp.i0) * d..(gi * l + sp.i1) * d], d),
                    Mat::rows(&p, sp.keys()),
                    Mat {
                        data: &self.v[v0..],
                        rs: kv * d,
                        cs: 1,
                    },
                );
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
            let k0 = self.kv_at(sp.klo);
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
                let mut ds = vec![zero; rows * keys];
                T::matmul(
                    rows,
                    keys,
                    d,
                    Dst::rows(&mut ds, keys),
                    d_out,
                    Mat {
                        data: &self.v[k0..],
                        rs: 1,
                        cs: kv * d,
                    },
                );
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
                // dQ = dS K, dK += dSᵀ Q, dV += Pᵀ dO.
                T::matmul(
                    rows,
                    d,
                    keys,
                    Dst::rows(&mut dq[(gi * l + sp.i0) * d..(gi * l + sp.i1) * d], d),
                    Mat::rows(&ds, keys),
                    Mat {
                        data: &self.k[k0..],
                        rs: kv * d,
                        cs: 1,
                    },
                );
                let kr = sp.klo * d..sp.i1 * d;
                T::matmul(
                    keys,
                    d,
                    rows,
                    Dst::adding(&mut dk[kr.clone()], d),
                    Mat::transposed(&ds, keys),
                    Mat {
                        data: &self.q[q0..],
                        rs: h * d,
                        cs: 1,
                    },
                );
                T::matmul(
                    keys,
                    d,
                    rows,
                    Dst::adding(&mut dv[kr], d),
                    Mat::transposed(&p, keys),
                    d_out,
                );
            }
        }
        (dq, dk, dv)
    }
}

type Block<T> = (Vec<T>, Vec<T>, Vec<T>);

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

fn wide_ok() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[allow(unsafe_code)]
fn run_forward<T: Real>(t: &Task<'_, T>) -> (Vec<T>, Vec<T>) {
    #[cfg(target_arch = "x86_64")]
    if wide_ok() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above).
        return unsafe { wide::forward(t) };
    }
    t.forward()
}

#[allow(unsafe_code)]
fn run_backward<T: Real>(t: &Task<'_, T>, ins: [&[T]; 3]) -> Block<T> {
    #[cfg(target_arch = "x86_64")]
    if wide_ok() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above).
        return unsafe { wide::backward(t, ins) };
    }
    t.backward(ins[0], ins[1], ins[2])
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
            .map(|task| run_forward(&Task::new(self, task, [q, k, v])))
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
            .map(|task| run_backward(&Task::new(self, task, [q, k, v]), [o, lse, dout]))
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
