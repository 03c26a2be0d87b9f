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
/// of the row its query may see (its shared prefix's first slot when it continues one).
#[derive(Debug, Clone)]
pub struct Segments {
    batch: usize,
    len: usize,
    ids: Vec<u32>,
    /// Per slot, the segment it also sees (0 for none).
    prefixes: Vec<u32>,
    first: Vec<u32>,
    /// Every segment is one run of slots and none continues a prefix (always so for
    /// [`crate::PackedBatch::from_rows`]); if not, keys inside `[first, i]` are checked one by one.
    runs: bool,
    /// Per row and tile of queries, the tiles of keys holding a visible pair ([`visible_tiles`]),
    /// computed when first asked for (by a GPU's launch; the CPU's kernels do not read it).
    tiles: OnceLock<Vec<u32>>,
    /// The slot arrays on a GPU, uploaded by the first layer that needs them.
    #[cfg(feature = "cuda")]
    device: super::device::DeviceSlots,
}

impl Segments {
    /// From the `(batch, len)` row-major segment ids of a packed batch without shared prefixes.
    pub fn new(batch: usize, len: usize, segment_ids: &[u32]) -> Result<Self> {
        Self::with_prefixes(batch, len, segment_ids, &vec![0; segment_ids.len()])
    }

    /// From the segment ids and prefix ids of a packed batch ([`crate::PackedBatch`]): a slot
    /// also sees the earlier slots of its prefix segment, which must start before it.
    pub fn with_prefixes(
        batch: usize,
        len: usize,
        segment_ids: &[u32],
        prefix_ids: &[u32],
    ) -> Result<Self> {
        if segment_ids.len() != batch * len || prefix_ids.len() != segment_ids.len() || len == 0 {
            candle_core::bail!(
                "segments: {} ids and {} prefix ids for {batch} rows of {len}",
                segment_ids.len(),
                prefix_ids.len()
            )
        }
        let mut first = vec![0u32; batch * len];
        let mut runs = prefix_ids.iter().all(|&p| p == 0);
        for r in 0..batch {
            let row = &segment_ids[r * len..(r + 1) * len];
            let mut seen: Vec<(u32, u32)> = Vec::new();
            for (i, &s) in row.iter().enumerate() {
                let mut f = match seen.iter().find(|(id, _)| *id == s) {
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
                let p = prefix_ids[r * len + i];
                if p != 0 {
                    match seen.iter().find(|(id, _)| *id == p && *id != s) {
                        Some(&(_, pf)) => f = f.min(pf),
                        None => candle_core::bail!(
                            "segments: slot {i} of row {r} continues segment {p}, which does not \
                             start before it"
                        ),
                    }
                }
                first[r * len + i] = f;
            }
        }
        Ok(Self {
            batch,
            len,
            ids: segment_ids.to_vec(),
            prefixes: prefix_ids.to_vec(),
            first,
            runs,
            tiles: OnceLock::new(),
            #[cfg(feature = "cuda")]
            device: Default::default(),
        })
    }

    #[cfg(feature = "cuda")]
    pub(super) fn device_slots(&self) -> &super::device::DeviceSlots {
        &self.device
    }

    /// Per slot (row-major, `batch · len`), the first slot of its row that its query may see.
    pub fn first(&self) -> &[u32] {
        &self.first
    }

    /// The segment id of every slot.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The prefix segment every slot continues (0 for none).
    pub fn prefixes(&self) -> &[u32] {
        &self.prefixes
    }

    /// Whether every segment is one run of slots and none continues a prefix: then a slot sees
    /// exactly the slots from [`Segments::first`] up to itself.
    pub fn runs(&self) -> bool {
        self.runs
    }

    /// Per row and tile of 64 queries, a bit per tile of 64 keys (in
    /// `len.div_ceil(64).div_ceil(32)` words), set iff some query of the one sees some key of the
    /// other: the GPU kernels skip the tiles whose bit is clear.
    pub fn visible_tiles(&self) -> &[u32] {
        self.tiles.get_or_init(|| {
            let shape = (self.batch, self.len);
            visible_tiles(shape, &self.ids, &self.prefixes, &self.first, self.runs)
        })
    }

    /// These segments with every tile marked visible: the GPU kernels then walk every key tile
    /// from each block's first visible slot, as they did before [`Segments::visible_tiles`]
    /// (same results; `sluice bench kernels` times what the mask saves).
    pub fn walking_every_tile(self) -> Self {
        let (tiles, words) = tiles::mask_shape(self.len);
        let _ = self.tiles.set(vec![u32::MAX; self.batch * tiles * words]);
        self
    }

    /// `(batch, len)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.batch, self.len)
    }

    fn allowed(&self, row: usize, i: usize, j: usize) -> bool {
        if self.runs {
            return true;
        }
        let (at_i, at_j) = (row * self.len + i, row * self.len + j);
        crate::batch::segment_visible(self.ids[at_i], self.prefixes[at_i], self.ids[at_j])
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
    let op = Attention::new([q, k, v], segments, heads)?;
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

/// [`attention`] without a graph, its op kept for the backward: the hand-written layer
/// backward's (`crate::layer_grads`). `q`, `k` and `v` must be contiguous, and are what
/// [`KeptAttention::grads`] takes again.
pub(crate) fn attention_kept(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    segments: &Arc<Segments>,
    heads: AttentionHeads,
) -> Result<(Tensor, KeptAttention)> {
    if ![q, k, v].iter().all(|t| t.is_contiguous()) {
        candle_core::bail!("attention: q, k and v must be contiguous")
    }
    let op = Attention::new([q, k, v], segments, heads)?;
    let out = q.apply_op3_no_bwd(k, v, &op)?;
    Ok((out, KeptAttention(op)))
}

/// The op of one [`attention_kept`] forward, with the log-sum-exps its backward reads.
pub(crate) struct KeptAttention(Attention);

impl KeptAttention {
    /// `[dq, dk, dv]` for the output `out` of the forward over `q`, `k`, `v` and its gradient.
    pub(crate) fn grads(
        &self,
        [q, k, v]: [&Tensor; 3],
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<[Tensor; 3]> {
        match CustomOp3::bwd(&self.0, q, k, v, out, grad)? {
            (Some(dq), Some(dk), Some(dv)) => Ok([dq, dk, dv]),
            _ => candle_core::bail!("attention: a gradient was not computed"),
        }
    }
}

impl Attention {
    /// The op for `q (N, heads·d)`, `k`, `v (N, kv_heads·d)`, its shapes checked.
    fn new(
        [q, k, v]: [&Tensor; 3],
        segments: &Arc<Segments>,
        heads: AttentionHeads,
    ) -> Result<Self> {
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
        Ok(Self {
            segments: Arc::clone(segments),
            heads,
            lse: OnceLock::new(),
        })
    }
}

struct Attention {
    segments: Arc<Segments>,
    heads: AttentionHeads,
    /// Log-sum-exp of each query's scores, `(batch, heads, len)`, set by the forward.
    lse: OnceLock<Tensor>,
}

mod task;
mod tiles;

use tiles::visible_tiles;

use task::{Block, Task, run_backward, run_forward};

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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let seg = &*self.segments;
        let (o, lse) = super::device::attention((s1, l1), (s2, l2), (s3, l3), seg, self.heads)?;
        let _ = self.lse.set(lse);
        let (b, l) = seg.shape();
        Ok((
            o,
            Shape::from((b * l, self.heads.heads * self.heads.head_dim)),
        ))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if super::device::supported(q) {
            let Some(lse) = self.lse.get() else {
                candle_core::bail!("attention: backward before forward")
            };
            let g = grad.contiguous()?;
            let [dq, dk, dv] =
                super::device::attention_bwd([q, k, v], res, lse, &g, &self.segments, self.heads)?;
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        let [dq, dk, dv] = match q.dtype() {
            DType::F32 => self.grads::<f32>([q, k, v], res, grad)?,
            _ => self.grads::<f64>([q, k, v], res, grad)?,
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
