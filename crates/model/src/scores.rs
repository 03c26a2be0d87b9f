//! Per-token log-probability and entropy (of the softmax of logits / temperature) from final
//! hidden states, in chunks of rows so the
//! `(N, vocab)` logits never exist at once — not in the forward pass, and not in the backward
//! pass either.
//!
//! Autograd would keep every chunk's logits alive until `backward`, so the computation is a
//! custom op: the forward computes the values chunk by chunk on detached tensors, keeping the
//! first chunks' logits up to a budget of bytes, and the backward forms the gradients from
//! those, recomputing the logits of the rest:
//!
//! * `d logp[t] / dz = onehot(t) − p`
//! * `d H / dz = −p ⊙ (log p + H)` where `H = −Σ p log p`
//!
//! and with `G = g_logp · (onehot − p) + g_H · (−p ⊙ (log p + H))` for one chunk,
//! `dL/dh = G W` and `dL/dW += Gᵀ h`.

use std::cell::Cell;
use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp2, D, Layout, Shape, Tensor};

use crate::ops::compute_dtype;

thread_local! {
    static RECOMPUTED: Cell<u64> = const { Cell::new(0) };
}

/// Chunks of logits the backward passes run on this thread have formed again, their forward
/// having not kept them ([`crate::ForwardOptions::kept_logits_bytes`]): for tests and
/// benchmarks.
pub fn recomputed_logit_chunks() -> u64 {
    RECOMPUTED.with(Cell::get)
}

/// Counts one chunk formed again by a backward ([`recomputed_logit_chunks`]).
pub(crate) fn count_recomputed_chunk() {
    RECOMPUTED.with(|c| c.set(c.get() + 1));
}

/// A forward's allowance of kept logits: chunks are kept in order while they fit, so the
/// backward's chunk `i` was kept iff `i` is below the number kept.
pub(crate) struct KeptBudget(Option<usize>);

impl KeptBudget {
    pub(crate) fn new(bytes: usize) -> Self {
        Self(Some(bytes))
    }

    /// Whether the next chunk, of `bytes`, is kept (none is after one that was not).
    pub(crate) fn keep(&mut self, bytes: usize) -> bool {
        match self.0 {
            Some(left) if bytes <= left => {
                self.0 = Some(left - bytes);
                true
            }
            _ => {
                self.0 = None;
                false
            }
        }
    }
}

/// Output column 0 is `log p(target)`, column 1 the entropy, both in the compute dtype
/// (f32, or f64 for f64 models). The logits' matrix product runs in `hidden`'s dtype (bf16
/// under mixed precision, on tensor cores), everything after it in the compute dtype. With
/// `fused`, f32/f64 CPU tensors take the one-pass kernel of [`crate::fused`] instead of the
/// composition below. When a gradient may be taken (`hidden` or `head` is part of a graph),
/// the forward keeps the logits of its first chunks, in order while they fit in `keep_bytes`,
/// and the backward reads them where it would form them again.
pub(crate) fn token_scores(
    hidden: &Tensor,
    head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    temperature: f64,
    fused: bool,
    keep_bytes: usize,
) -> candle_core::Result<Tensor> {
    let chunk_rows = chunk_rows.max(1);
    let inv_temperature = 1.0 / temperature;
    let keep_bytes = if hidden.track_op() || head.track_op() {
        keep_bytes
    } else {
        0
    };
    if fused && crate::fused::supported(hidden) && head.dtype() == hidden.dtype() {
        let targets: Vec<u32> = targets.to_vec1()?;
        return crate::fused::token_scores(
            hidden,
            head,
            &targets,
            chunk_rows,
            inv_temperature,
            keep_bytes,
        );
    }
    let (values, kept) = forward_values(
        &hidden.detach(),
        &head.detach(),
        targets,
        chunk_rows,
        inv_temperature,
        keep_bytes,
    )?;
    hidden.apply_op2(
        head,
        TokenScoreOp {
            targets: targets.clone(),
            chunk_rows,
            inv_temperature,
            values,
            kept: Mutex::new(kept),
        },
    )
}

/// One chunk's `(c, V)` logits, `h wᵀ` in the product dtype.
fn chunk_logits(h: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    h.matmul(&w.t()?)
}

/// One chunk's `(log p, log p(target), entropy)` from its logits in the product dtype.
fn chunk_values(
    logits: &Tensor,
    targets: &Tensor,
    inv_temperature: f64,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    // (c, V) logits divided by the temperature, in the compute dtype.
    let cdt = compute_dtype(logits.dtype());
    let logits = (logits.to_dtype(cdt)? * inv_temperature)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp = shifted.broadcast_sub(&lse)?;
    let target_logp = logp.gather(&targets.unsqueeze(1)?, 1)?;
    let p = logp.exp()?;
    let entropy = (p.mul(&logp)?.sum_keepdim(D::Minus1)? * -1.0)?;
    Ok((logp, target_logp, entropy))
}

/// One chunk's `(log p(target), entropy)` columns from its logits: on a GPU one kernel per row
/// ([`crate::fused::on_device`]), elsewhere [`chunk_values`].
fn chunk_scores(
    logits: &Tensor,
    targets: &Tensor,
    inv_temperature: f64,
) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::fused::on_device(logits) {
        return crate::fused::device::token_scores(logits, targets, inv_temperature);
    }
    let (_, target_logp, entropy) = chunk_values(logits, targets, inv_temperature)?;
    Tensor::cat(&[target_logp, entropy], 1)
}

/// One chunk's gradient with respect to its logits (before the 1/T scaling's chain rule is
/// applied: it is included), in the logits' (product) dtype, for the output gradient `g`
/// `(c, 2)`.
fn chunk_logit_grads(
    logits: &Tensor,
    targets: &Tensor,
    g: &Tensor,
    inv_temperature: f64,
) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::fused::on_device(logits) {
        let g = g.to_dtype(candle_core::DType::F32)?.contiguous()?;
        return crate::fused::device::token_score_grads(logits, targets, &g, inv_temperature);
    }
    let g_logp = g.narrow(1, 0, 1)?.contiguous()?;
    let g_ent = g.narrow(1, 1, 1)?;
    let (logp, _, entropy) = chunk_values(logits, targets, inv_temperature)?;
    let p = logp.exp()?;
    // G = −p ⊙ (g_logp + g_H (log p + H)), then + g_logp at the target column.
    let inner = logp.broadcast_add(&entropy)?.broadcast_mul(&g_ent)?;
    let gz = (p.mul(&inner.broadcast_add(&g_logp)?)? * -1.0)?;
    // Gradient with respect to the scaled logits, then through the 1/T scaling.
    (gz.scatter_add(&targets.unsqueeze(1)?, &g_logp, 1)? * inv_temperature)?
        .to_dtype(logits.dtype())
}

/// The `(N, 2)` values, and the logits of the first chunks while they fit in `keep_bytes`.
fn forward_values(
    hidden: &Tensor,
    head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    inv_temperature: f64,
    keep_bytes: usize,
) -> candle_core::Result<(Tensor, Vec<Tensor>)> {
    let w = head.to_dtype(hidden.dtype())?;
    let n = hidden.dim(0)?;
    let mut parts = Vec::with_capacity(n.div_ceil(chunk_rows));
    let mut kept = Vec::new();
    let mut budget = KeptBudget::new(keep_bytes);
    for start in (0..n).step_by(chunk_rows) {
        let len = chunk_rows.min(n - start);
        let logits = chunk_logits(&hidden.narrow(0, start, len)?, &w)?;
        let t = targets.narrow(0, start, len)?;
        parts.push(chunk_scores(&logits, &t, inv_temperature)?);
        if budget.keep(logits.elem_count() * logits.dtype().size_in_bytes()) {
            kept.push(logits);
        }
    }
    Ok((Tensor::cat(&parts, 0)?, kept))
}

/// The stashed values as CPU storage (the op's forward output).
fn stashed_cpu(t: &Tensor) -> candle_core::Result<(CpuStorage, Shape)> {
    use candle_core::backend::BackendStorage;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
        _ => candle_core::bail!("token scores: values are not on the CPU"),
    }
}

/// The stashed values as CUDA storage. Compiled on every build (candle has a stand-in CUDA
/// backend without the `cuda` feature), so this path is type-checked in CPU CI too.
fn stashed_cuda(t: &Tensor) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
    use candle_core::backend::BackendStorage;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
        _ => candle_core::bail!("token scores: values are not on the GPU"),
    }
}

/// The differentiable node: forward hands back the stashed values, backward takes the kept
/// logits chunk by chunk and recomputes the rest.
struct TokenScoreOp {
    targets: Tensor,
    chunk_rows: usize,
    inv_temperature: f64,
    values: Tensor,
    /// The first chunks' logits, in the product dtype (taken by the backward).
    kept: Mutex<Vec<Tensor>>,
}

impl CustomOp2 for TokenScoreOp {
    fn name(&self) -> &'static str {
        "token-scores"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        stashed_cpu(&self.values)
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        stashed_cuda(&self.values)
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        head: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // A head outside the graph (frozen under LoRA) takes no gradient: its product is
        // skipped.
        let want_w = head.track_op();
        let hidden = hidden.detach();
        let head = head.detach();
        // Products in hidden's dtype (as the forward), the rest and the sum of dW in cdt.
        let pdt = hidden.dtype();
        let cdt = compute_dtype(pdt);
        let w = head.to_dtype(pdt)?;
        let grad_res = grad_res.to_dtype(cdt)?;
        let n = hidden.dim(0)?;
        let mut grad_w = want_w
            .then(|| Tensor::zeros(w.shape(), cdt, w.device()))
            .transpose()?;
        let mut grad_h = Vec::with_capacity(n.div_ceil(self.chunk_rows));
        let kept = std::mem::take(&mut *self.kept.lock().unwrap_or_else(|e| e.into_inner()));
        let mut kept = kept.into_iter();
        for start in (0..n).step_by(self.chunk_rows) {
            let len = self.chunk_rows.min(n - start);
            let h = hidden.narrow(0, start, len)?;
            let t = self.targets.narrow(0, start, len)?;
            let g = grad_res.narrow(0, start, len)?;
            let logits = match kept.next() {
                Some(logits) => logits,
                None => {
                    count_recomputed_chunk();
                    chunk_logits(&h, &w)?
                }
            };
            let gz = chunk_logit_grads(&logits, &t, &g, self.inv_temperature)?;
            drop(logits);
            grad_h.push(gz.matmul(&w)?);
            if let Some(sum) = grad_w.take() {
                grad_w = Some((sum + gz.t()?.matmul(&h)?.to_dtype(cdt)?)?);
            }
        }
        let grad_h = Tensor::cat(&grad_h, 0)?.to_dtype(hidden.dtype())?;
        let grad_w = grad_w.map(|g| g.to_dtype(head.dtype())).transpose()?;
        Ok((Some(grad_h), grad_w))
    }
}
