//! The log-prob/entropy head ([`crate::scores`]) as one pass per chunk of rows: the chunk's
//! `(c, vocab)` logits are one gemm into one buffer, and every row's max, log-sum-exp, target
//! log-prob and entropy are read off it in place, where the composition makes about ten
//! `(c, vocab)` tensors per chunk. The backward turns each chunk's logits into the logit
//! gradient in the same buffer, and forms `dh = G W` and `dW += Gᵀ h` by gemm: the logits
//! the forward kept (up to its budget, chunk by chunk in order), or recomputed.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::{
    Bf16Products, Dst, Mat, Real, Rhs, cpu_slice, product, product_new, same_dtype, storage_slice,
    tensor,
};

/// `(N, 2)`: `log softmax(z/T)[target]` and the entropy, for `hidden (N, H)`, `head (V, H)`;
/// up to `keep_bytes` of the chunks' logits kept for the backward.
pub(crate) fn token_scores(
    hidden: &Tensor,
    head: &Tensor,
    targets: &[u32],
    chunk_rows: usize,
    inv_temperature: f64,
    keep_bytes: usize,
) -> Result<Tensor> {
    let (n, _) = hidden.dims2()?;
    let (vocab, _) = head.dims2()?;
    if targets.len() != n || targets.iter().any(|&t| t as usize >= vocab) {
        candle_core::bail!(
            "token scores: {} targets for {n} rows of {vocab}",
            targets.len()
        )
    }
    let op = Head {
        targets: targets.to_vec(),
        chunk_rows: chunk_rows.max(1),
        inv_temperature,
        keep_bytes,
        kept: Mutex::new(Vec::new()),
        tiles: super::products::bf16_products(),
    };
    hidden.contiguous()?.apply_op2(&head.contiguous()?, op)
}

struct Head {
    targets: Vec<u32>,
    chunk_rows: usize,
    inv_temperature: f64,
    /// Bytes of logits the forward may keep for the backward.
    keep_bytes: usize,
    /// The first chunks' logits as the forward left them: a [`KeptLogits`] of the op's dtype
    /// each.
    kept: Mutex<Vec<Box<dyn std::any::Any + Send>>>,
    /// Whether its products run on the AMX tiles: the scope the op was made in
    /// ([`super::Bf16Products`]), kept for its backward.
    tiles: bool,
}

/// One chunk's logits after [`row_stats`] (scaled and shifted by each row's max), and per
/// row its `[log Σ e, 1 / Σ e, entropy]`: what the backward reads of them.
struct KeptLogits<T> {
    z: Vec<T>,
    stats: Vec<T>,
}

/// Scales a row of logits by `inv_t` and shifts it by its max, in place; `e` gets `exp` of the
/// shifted row. Returns `(log Σ e, 1 / Σ e)`: the log-sum-exp of the shifted row and the
/// normaliser of `p = e / Σ e`.
fn row_stats<T: Real>(z: &mut [T], e: &mut [T], inv_t: T) -> (T, T) {
    let mut m = z[0] * inv_t;
    for x in z.iter_mut() {
        *x *= inv_t;
        if *x > m {
            m = *x;
        }
    }
    for (x, ev) in z.iter_mut().zip(e.iter_mut()) {
        *x -= m;
        *ev = *x;
    }
    T::exp_slice(e);
    let mut sum = T::from_f64(0.0);
    for &v in e.iter() {
        sum += v;
    }
    (sum.ln(), T::from_f64(1.0) / sum)
}

impl Head {
    /// The logits of rows `start..start + c`, `(c, V)`, unscaled; `wt` is the head `(V, H)`
    /// read transposed ([`Head::head_t`]).
    fn logits<T: Real>(
        &self,
        h: &[T],
        wt: &Rhs<'_, T>,
        (start, c): (usize, usize),
        dims: (usize, usize),
    ) -> Vec<T> {
        let (hd, vocab) = dims;
        let rows = Mat::rows(&h[start * hd..(start + c) * hd], hd);
        product_new(c, vocab, hd, rows, wt)
    }

    /// The head `w (V, H)` as the logits' product reads it, `(H, V)`: packed once for every
    /// chunk when the products are on the tiles.
    fn head_t<T: Real>(w: &[T], (hd, vocab): (usize, usize)) -> Rhs<'_, T> {
        T::rhs(Mat::transposed(w, hd), hd, vocab)
    }

    fn fwd<T: Real>(&self, h: &[T], w: &[T]) -> Vec<T> {
        let _tiles = Bf16Products::enter(self.tiles);
        let n = self.targets.len();
        let hd = h.len() / n.max(1);
        let vocab = w.len() / hd.max(1);
        let inv_t = T::from_f64(self.inv_temperature);
        let mut out = vec![T::from_f64(0.0); n * 2];
        let mut e = vec![T::from_f64(0.0); vocab];
        let mut kept = Vec::new();
        let mut budget = crate::scores::KeptBudget::new(self.keep_bytes);
        let wt = Self::head_t(w, (hd, vocab));
        for start in (0..n).step_by(self.chunk_rows) {
            let c = self.chunk_rows.min(n - start);
            let mut z = self.logits(h, &wt, (start, c), (hd, vocab));
            let mut stats = Vec::with_capacity(3 * c);
            for (r, row) in z.chunks_exact_mut(vocab).enumerate() {
                let (lse, inv_sum) = row_stats(row, &mut e, inv_t);
                let mut pz = T::from_f64(0.0);
                for (&ev, &zv) in e.iter().zip(row.iter()) {
                    pz += ev * zv;
                }
                let t = self.targets[start + r] as usize;
                let entropy = lse - pz * inv_sum;
                out[(start + r) * 2] = row[t] - lse;
                out[(start + r) * 2 + 1] = entropy;
                stats.extend([lse, inv_sum, entropy]);
            }
            if budget.keep(std::mem::size_of_val(z.as_slice())) {
                kept.push(Box::new(KeptLogits { z, stats }) as Box<dyn std::any::Any + Send>);
            }
        }
        *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = kept;
        out
    }

    /// `(dh, dw)`; `dw` only when `want_w` (a head in the graph: not frozen).
    fn bwd<T: Real>(&self, h: &[T], w: &[T], grad: &[T], want_w: bool) -> (Vec<T>, Option<Vec<T>>) {
        let _tiles = Bf16Products::enter(self.tiles);
        let n = self.targets.len();
        let hd = h.len() / n.max(1);
        let vocab = w.len() / hd.max(1);
        let zero = T::from_f64(0.0);
        let inv_t = T::from_f64(self.inv_temperature);
        let mut dh = vec![zero; n * hd];
        let mut dw = want_w.then(|| vec![zero; vocab * hd]);
        let mut e = vec![zero; vocab];
        let kept = std::mem::take(&mut *self.kept.lock().unwrap_or_else(|e| e.into_inner()));
        let mut kept = kept.into_iter();
        // G = −p ⊙ (g_logp + g_H (log p + H)), + g_logp at the target; then the 1/T. `row` is
        // row `r`'s shifted logits, `e` their exponentials.
        let grad_row = |row: &mut [T], e: &[T], [lse, inv_sum, entropy]: [T; 3], r: usize| {
            let (g_logp, g_ent) = (grad[r * 2], grad[r * 2 + 1]);
            for (x, &ev) in row.iter_mut().zip(e.iter()) {
                let p = ev * inv_sum;
                let logp = *x - lse;
                *x = -p * (g_logp + g_ent * (logp + entropy)) * inv_t;
            }
            row[self.targets[r] as usize] += g_logp * inv_t;
        };
        // The head as the backward's products read it: transposed for the logits formed again
        // (packed at the first such chunk), as it is for `dh = G W`.
        let wt = std::cell::OnceCell::new();
        let w_rows = T::rhs(Mat::rows(w, hd), vocab, hd);
        for start in (0..n).step_by(self.chunk_rows) {
            let c = self.chunk_rows.min(n - start);
            // The logits the forward kept, else formed again: the same values either way, and
            // `e` is exp of the same shifted row, so the gradients are the same to the bit.
            let z = match kept.next().map(|k| k.downcast::<KeptLogits<T>>()) {
                Some(Ok(k)) => {
                    let KeptLogits { mut z, stats } = *k;
                    for (r, row) in z.chunks_exact_mut(vocab).enumerate() {
                        e.copy_from_slice(row);
                        T::exp_slice(&mut e);
                        let stats = [0, 1, 2].map(|i| stats[3 * r + i]);
                        grad_row(row, &e, stats, start + r);
                    }
                    z
                }
                _ => {
                    crate::scores::count_recomputed_chunk();
                    let wt = wt.get_or_init(|| Self::head_t(w, (hd, vocab)));
                    let mut z = self.logits(h, wt, (start, c), (hd, vocab));
                    for (r, row) in z.chunks_exact_mut(vocab).enumerate() {
                        let (lse, inv_sum) = row_stats(row, &mut e, inv_t);
                        let mut pz = zero;
                        for (&ev, &zv) in e.iter().zip(row.iter()) {
                            pz += ev * zv;
                        }
                        grad_row(row, &e, [lse, inv_sum, lse - pz * inv_sum], start + r);
                    }
                    z
                }
            };
            product(
                c,
                hd,
                vocab,
                Dst::rows(&mut dh[start * hd..(start + c) * hd], hd),
                Mat::rows(&z, vocab),
                &w_rows,
            );
            if let Some(dw) = &mut dw {
                let h_rows = T::rhs(Mat::rows(&h[start * hd..(start + c) * hd], hd), c, hd);
                product(
                    vocab,
                    hd,
                    c,
                    Dst::adding(dw, hd),
                    Mat::transposed(&z, vocab),
                    &h_rows,
                );
            }
        }
        (dh, dw)
    }
}

impl CustomOp2 for Head {
    fn name(&self) -> &'static str {
        "fused-token-scores"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = Shape::from((self.targets.len(), 2));
        Ok(match same_dtype("fused-token-scores", s1, s2)? {
            DType::F32 => (
                CpuStorage::F32(self.fwd(cpu_slice(s1, l1)?, cpu_slice(s2, l2)?)),
                shape,
            ),
            _ => (
                CpuStorage::F64(self.fwd(cpu_slice(s1, l1)?, cpu_slice(s2, l2)?)),
                shape,
            ),
        })
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        head: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        fn run<T: Real>(
            op: &Head,
            hidden: &Tensor,
            head: &Tensor,
            grad: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let g = grad.contiguous()?;
            let (dh, dw) = {
                let (hs, hl) = hidden.storage_and_layout();
                let (ws, wl) = head.storage_and_layout();
                let (gs, gl) = g.storage_and_layout();
                op.bwd::<T>(
                    storage_slice(&hs, hl)?,
                    storage_slice(&ws, wl)?,
                    storage_slice(&gs, gl)?,
                    // A head outside the graph (frozen under LoRA) takes no gradient.
                    head.track_op(),
                )
            };
            Ok((
                Some(tensor(dh, hidden.shape())?),
                dw.map(|dw| tensor(dw, head.shape())).transpose()?,
            ))
        }
        match hidden.dtype() {
            DType::F32 => run::<f32>(self, hidden, head, grad),
            _ => run::<f64>(self, hidden, head, grad),
        }
    }
}
