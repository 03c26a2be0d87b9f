//! RMSNorm and SwiGLU: one pass over the rows forward, one backward, nothing stashed (the
//! backward recomputes the row statistics and the sigmoid from the op's inputs).

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::{Real, cpu_slice, fixed_row_blocks, row_blocks, same_dtype, storage_slice, tensor};

/// RMSNorm over rows of `weight.len()` elements: `w ⊙ x / sqrt(mean(x²) + eps)`. `x` may have
/// any shape whose last dimension is that length (or whose element count is a multiple of it:
/// the q/k norms of `(N, heads·d)` activations normalise each head's `d` values).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let d = weight.elem_count();
    if d == 0 || !x.elem_count().is_multiple_of(d) {
        candle_core::bail!("rms norm: {:?} is not rows of {d}", x.shape())
    }
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps })
}

/// `silu(gate) ⊙ up` for two tensors of one shape.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        candle_core::bail!("swiglu: gate {:?} vs up {:?}", gate.shape(), up.shape())
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

struct RmsNorm {
    eps: f64,
}

/// `1 / √(mean(row²) + eps)`, the sum in order (one scalar chain, the same in every caller).
pub(crate) fn rms_inv<T: Real>(row: &[T], eps: T) -> T {
    let mut sum = T::from_f64(0.0);
    for &v in row {
        sum += v * v;
    }
    let mean = sum / T::from_f64(row.len() as f64);
    T::from_f64(1.0) / (mean + eps).sqrt()
}

fn rms_fwd<T: Real>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let d = w.len();
    let eps = T::from_f64(eps);
    let mut out = vec![T::from_f64(0.0); x.len()];
    row_blocks(&mut out, d, |first, block| {
        for (r, y) in block.chunks_exact_mut(d).enumerate() {
            let xr = &x[(first + r) * d..(first + r + 1) * d];
            let inv = rms_inv(xr, eps);
            for ((y, &xv), &wv) in y.iter_mut().zip(xr).zip(w) {
                *y = xv * inv * wv;
            }
        }
    });
    out
}

/// `(dx, dw)`: with `x̂ = x·r`, `dx = r (w⊙g − x̂ · Σ(w⊙g⊙x̂) / d)` and `dw = Σ_rows g⊙x̂`.
fn rms_bwd<T: Real>(x: &[T], w: &[T], g: &[T], eps: f64, want_dx: bool) -> (Vec<T>, Vec<T>) {
    let d = w.len();
    let eps = T::from_f64(eps);
    let zero = T::from_f64(0.0);
    let mut dx = vec![zero; if want_dx { x.len() } else { 0 }];
    let rows = x.len() / d;
    let row = |r: usize, dx: Option<&mut [T]>, dw: &mut [T]| {
        let xr = &x[r * d..(r + 1) * d];
        let gr = &g[r * d..(r + 1) * d];
        let inv = rms_inv(xr, eps);
        let mut dot = zero;
        for ((&xv, &gv), (&wv, dw)) in xr.iter().zip(gr).zip(w.iter().zip(dw.iter_mut())) {
            let xh = xv * inv;
            dot += wv * gv * xh;
            *dw += gv * xh;
        }
        if let Some(dx) = dx {
            let c = dot / T::from_f64(d as f64);
            for (((dx, &xv), &gv), &wv) in dx.iter_mut().zip(xr).zip(gr).zip(w) {
                *dx = inv * (wv * gv - xv * inv * c);
            }
        }
    };
    // `dw` sums over rows: fixed blocks keep its bits independent of the thread count.
    const DW_BLOCK_ROWS: usize = 256;
    let partials = if want_dx {
        fixed_row_blocks(&mut dx, d, DW_BLOCK_ROWS, |first, block| {
            let mut dw = vec![zero; d];
            for (i, dxr) in block.chunks_exact_mut(d).enumerate() {
                row(first + i, Some(dxr), &mut dw);
            }
            dw
        })
    } else {
        let mut dw = vec![zero; d];
        for r in 0..rows {
            row(r, None, &mut dw);
        }
        vec![dw]
    };
    let mut parts = partials.into_iter();
    let mut dw = parts.next().unwrap_or_else(|| vec![zero; d]);
    for p in parts {
        for (a, b) in dw.iter_mut().zip(p) {
            *a += b;
        }
    }
    (dx, dw)
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = l1.shape().clone();
        Ok(match same_dtype(self.name(), s1, s2)? {
            candle_core::DType::F32 => (
                CpuStorage::F32(rms_fwd(cpu_slice(s1, l1)?, cpu_slice(s2, l2)?, self.eps)),
                shape,
            ),
            _ => (
                CpuStorage::F64(rms_fwd(cpu_slice(s1, l1)?, cpu_slice(s2, l2)?, self.eps)),
                shape,
            ),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = super::device::rms_norm(s1, l1, s2, l2, self.eps)?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.grads(x, w, grad, [x.track_op(), w.track_op()])
    }
}

impl RmsNorm {
    /// `(dx, dw)`, each only when `want`ed.
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
        [want_dx, want_dw]: [bool; 2],
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if super::device::supported(x) {
            let (dx, dw) = super::device::rms_norm_bwd(x, w, &grad.contiguous()?, self.eps)?;
            return Ok((want_dx.then_some(dx), want_dw.then_some(dw)));
        }
        fn run<T: Real>(
            x: &Tensor,
            w: &Tensor,
            g: &Tensor,
            eps: f64,
            [want_dx, want_dw]: [bool; 2],
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let (dx, dw) = {
                let (xs, xl) = x.storage_and_layout();
                let (ws, wl) = w.storage_and_layout();
                let (gs, gl) = g.storage_and_layout();
                rms_bwd::<T>(
                    storage_slice(&xs, xl)?,
                    storage_slice(&ws, wl)?,
                    storage_slice(&gs, gl)?,
                    eps,
                    want_dx,
                )
            };
            let dx = if want_dx {
                Some(tensor(dx, x.shape())?)
            } else {
                None
            };
            let dw = if want_dw {
                Some(tensor(dw, w.shape())?)
            } else {
                None
            };
            Ok((dx, dw))
        }
        let g = grad.contiguous()?;
        let want = [want_dx, want_dw];
        match x.dtype() {
            candle_core::DType::F32 => run::<f32>(x, w, &g, self.eps, want),
            _ => run::<f64>(x, w, &g, self.eps, want),
        }
    }
}

/// `(dx, dw)` of [`rms_norm`] for its output's gradient `grad`, both computed: the
/// hand-written layer backward's (`crate::layer_grads`), which runs its forward without a graph.
pub(crate) fn rms_norm_grads(
    x: &Tensor,
    w: &Tensor,
    eps: f64,
    grad: &Tensor,
) -> Result<(Tensor, Tensor)> {
    match (RmsNorm { eps }).grads(x, w, grad, [true, true])? {
        (Some(dx), Some(dw)) => Ok((dx, dw)),
        _ => candle_core::bail!("rms norm: a wanted gradient was not computed"),
    }
}

struct SwiGlu;

/// `e^−x` of each element of `src` into `dst`.
#[inline(always)]
fn exp_neg<T: Real>(dst: &mut [T], src: &[T]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = -x;
    }
    T::exp_slice(dst);
}

fn swiglu_fwd<T: Real>(gate: &[T], up: &[T]) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); gate.len()];
    let wide = super::avx2_fma();
    row_blocks(&mut out, 1, |first, block| {
        let n = block.len();
        swiglu_dispatch(block, &gate[first..first + n], &up[first..first + n], wide);
    });
    out
}

/// `silu(gate) ⊙ up` into `out`: the composition's silu, `g / (1 + e^−g)`. Elementwise, so
/// the AVX2 body gives the same values as the baseline one.
#[inline(always)]
fn swiglu_block<T: Real>(out: &mut [T], gate: &[T], up: &[T]) {
    let one = T::from_f64(1.0);
    exp_neg(out, gate);
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (one + *o) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn swiglu_wide<T: Real>(out: &mut [T], gate: &[T], up: &[T]) {
    swiglu_block(out, gate, up);
}

#[allow(unsafe_code)]
pub(super) fn swiglu_dispatch<T: Real>(out: &mut [T], gate: &[T], up: &[T], wide: bool) {
    #[cfg(target_arch = "x86_64")]
    if wide {
        // SAFETY: `wide` is `avx2_fma()`: the CPU has AVX2 and FMA.
        return unsafe { swiglu_wide(out, gate, up) };
    }
    let _ = wide;
    swiglu_block(out, gate, up);
}

/// `d gate = g ⊙ up ⊙ σ(gate)(1 + gate(1 − σ(gate)))`, `d up = g ⊙ silu(gate)`: in blocks
/// small enough for L1, σ(gate) into `d gate` and both gradients from it while the block is
/// there (three passes over the whole tensors before, each from memory), over the pool.
fn swiglu_bwd<T: Real>(gate: &[T], up: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
    use rayon::prelude::*;
    /// Elements a block: 16 KB of f32 per tensor, five tensors.
    const BLOCK: usize = 4096;
    let zero = T::from_f64(0.0);
    let mut dgate = vec![zero; gate.len()];
    let mut dup = vec![zero; gate.len()];
    let wide = super::avx2_fma();
    dgate
        .par_chunks_mut(BLOCK)
        .zip(dup.par_chunks_mut(BLOCK))
        .enumerate()
        .for_each(|(b, (dg, du))| {
            let at = b * BLOCK..b * BLOCK + dg.len();
            let ins = [&gate[at.clone()], &up[at.clone()], &g[at]];
            swiglu_bwd_dispatch(dg, du, ins, wide);
        });
    (dgate, dup)
}

/// One block of [`swiglu_bwd`]: `[gate, up, g]` in, the two gradients out.
#[inline(always)]
fn swiglu_bwd_block<T: Real>(dgate: &mut [T], dup: &mut [T], [gate, up, g]: [&[T]; 3]) {
    let one = T::from_f64(1.0);
    exp_neg(dgate, gate);
    let ins = gate.iter().zip(up).zip(g);
    for ((dg, du), ((&x, &u), &gv)) in dgate.iter_mut().zip(dup.iter_mut()).zip(ins) {
        let s = one / (one + *dg);
        *du = gv * x * s;
        *dg = gv * u * s * (one + x * (one - s));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn swiglu_bwd_wide<T: Real>(dgate: &mut [T], dup: &mut [T], ins: [&[T]; 3]) {
    swiglu_bwd_block(dgate, dup, ins);
}

#[allow(unsafe_code)]
fn swiglu_bwd_dispatch<T: Real>(dgate: &mut [T], dup: &mut [T], ins: [&[T]; 3], wide: bool) {
    #[cfg(target_arch = "x86_64")]
    if wide {
        // SAFETY: `wide` is `avx2_fma()`: the CPU has AVX2 and FMA.
        return unsafe { swiglu_bwd_wide(dgate, dup, ins) };
    }
    let _ = wide;
    swiglu_bwd_block(dgate, dup, ins);
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = l1.shape().clone();
        Ok(match same_dtype(self.name(), s1, s2)? {
            candle_core::DType::F32 => (
                CpuStorage::F32(swiglu_fwd(cpu_slice(s1, l1)?, cpu_slice(s2, l2)?)),
                shape,
            ),
            _ => (
                CpuStorage::F64(swiglu_fwd(cpu_slice(s1, l1)?, cpu_slice(s2, l2)?)),
                shape,
            ),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::device::swiglu(s1, l1, s2, l2)?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dgate, dup) = swiglu_grads(gate, up, grad)?;
        Ok((Some(dgate), Some(dup)))
    }
}

/// `(d gate, d up)` of [`swiglu`] for its output's gradient `grad`.
pub(crate) fn swiglu_grads(gate: &Tensor, up: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if super::device::supported(gate) {
        return super::device::swiglu_bwd(gate, up, &grad.contiguous()?);
    }
    fn run<T: Real>(gate: &Tensor, up: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let (dgate, dup) = {
            let (a, al) = gate.storage_and_layout();
            let (b, bl) = up.storage_and_layout();
            let (c, cl) = g.storage_and_layout();
            swiglu_bwd::<T>(
                storage_slice(&a, al)?,
                storage_slice(&b, bl)?,
                storage_slice(&c, cl)?,
            )
        };
        Ok((tensor(dgate, gate.shape())?, tensor(dup, up.shape())?))
    }
    let g = grad.contiguous()?;
    match gate.dtype() {
        candle_core::DType::F32 => run::<f32>(gate, up, &g),
        _ => run::<f64>(gate, up, &g),
    }
}
