//! The engine's stacked products taken apart: a layer's q, k and v weights stacked into one
//! matrix give one product whose rows hold a token's q, k and v heads side by side, and gate and
//! up stacked give rows of gate then up. These split them, applying what follows each product
//! (RoPE on q and k, SwiGLU), in one pass over the rows, and fuse each residual add with the norm
//! after it: on the CPU here, on a GPU one launch each of `kernels/fused.cu`. Inference only:
//! the outputs track no gradient.

use candle_core::{DType, Result, Shape, Tensor};

use super::{Real, row_blocks, storage_slice, tensor};

/// Splits `qkv (rows, (heads + 2·kv_heads)·head_dim)` plus `bias` (one row's width, added to
/// every row) into q `(rows, heads·head_dim)` and k, v `(rows, kv_heads·head_dim)`, q and k
/// rotated as [`super::rope`] rotates them (`cos`, `sin`: `(rows, head_dim/2)`; all of `qkv`'s
/// dtype).
pub fn split_rope(
    qkv: &Tensor,
    bias: Option<&Tensor>,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (rows, width) = qkv.dims2()?;
    let half = head_dim / 2;
    if head_dim == 0 || !head_dim.is_multiple_of(2) || width != (heads + 2 * kv_heads) * head_dim {
        candle_core::bail!(
            "split rope: {:?} is not rows of {heads} + 2 × {kv_heads} heads of {head_dim}",
            qkv.shape()
        )
    }
    if cos.elem_count() != rows * half || sin.elem_count() != rows * half {
        candle_core::bail!(
            "split rope: tables {:?} for {rows} rows of {half}",
            cos.shape()
        )
    }
    if cos.dtype() != qkv.dtype() || sin.dtype() != qkv.dtype() {
        candle_core::bail!(
            "split rope: x {:?} vs tables {:?}",
            qkv.dtype(),
            cos.dtype()
        )
    }
    if let Some(b) = bias
        && (b.elem_count() != width || b.dtype() != qkv.dtype())
    {
        candle_core::bail!(
            "split rope: bias {:?} {:?} for rows of {width}",
            b.shape(),
            b.dtype()
        )
    }
    let (qkv, cos, sin) = (qkv.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    let bias = bias.map(Tensor::contiguous).transpose()?;
    #[cfg(feature = "cuda")]
    if super::device::supported(&qkv) {
        let bias = bias.as_ref();
        return super::device::split_rope(&qkv, bias, &cos, &sin, heads, kv_heads, head_dim);
    }
    let split = Split {
        heads,
        kv_heads,
        d: head_dim,
    };
    match qkv.dtype() {
        DType::F32 => split.run::<f32>(&qkv, bias.as_ref(), &cos, &sin),
        DType::F64 => split.run::<f64>(&qkv, bias.as_ref(), &cos, &sin),
        other => candle_core::bail!("split rope: no kernel for {other:?} on {:?}", qkv.device()),
    }
}

/// `silu(gate) ⊙ up` of `gate_up (rows, 2·inter)`, each row a token's gate then up, as
/// `(rows, inter)`: the values [`super::swiglu`] gives for the two halves.
pub fn swiglu_rows(gate_up: &Tensor) -> Result<Tensor> {
    let (rows, width) = gate_up.dims2()?;
    if !width.is_multiple_of(2) {
        candle_core::bail!(
            "swiglu rows: {:?} is not rows of gate then up",
            gate_up.shape()
        )
    }
    let gate_up = gate_up.contiguous()?;
    #[cfg(feature = "cuda")]
    if super::device::supported(&gate_up) {
        return super::device::swiglu_rows(&gate_up);
    }
    match gate_up.dtype() {
        DType::F32 => swiglu_rows_cpu::<f32>(&gate_up, rows, width / 2),
        DType::F64 => swiglu_rows_cpu::<f64>(&gate_up, rows, width / 2),
        other => candle_core::bail!(
            "swiglu rows: no kernel for {other:?} on {:?}",
            gate_up.device()
        ),
    }
}

fn swiglu_rows_cpu<T: Real>(gate_up: &Tensor, rows: usize, inter: usize) -> Result<Tensor> {
    let (s, l) = gate_up.storage_and_layout();
    let x = storage_slice::<T>(&s, l)?;
    let mut out = vec![T::from_f64(0.0); rows * inter];
    let wide = super::avx2_fma();
    row_blocks(&mut out, inter, |first, block| {
        for (r, y) in block.chunks_exact_mut(inter).enumerate() {
            let row = &x[(first + r) * 2 * inter..(first + r + 1) * 2 * inter];
            let (gate, up) = row.split_at(inter);
            super::elementwise::swiglu_dispatch(y, gate, up, wide);
        }
    });
    tensor(out, &Shape::from((rows, inter)))
}

/// `(x + y, rms_norm(x + y) ⊙ weight)`: a residual add and the norm that follows it (rows of
/// `weight.len()`). On a GPU one launch of `kernels/fused.cu`; on the CPU the add and
/// [`super::rms_norm`].
pub fn add_rms_norm(x: &Tensor, y: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let d = weight.elem_count();
    if x.shape() != y.shape() || d == 0 || x.dim(candle_core::D::Minus1)? != d {
        candle_core::bail!(
            "add rms norm: {:?} + {:?} is not rows of {d}",
            x.shape(),
            y.shape()
        )
    }
    let (x, y, weight) = (x.contiguous()?, y.contiguous()?, weight.contiguous()?);
    #[cfg(feature = "cuda")]
    if super::device::supported(&x) && y.dtype() == x.dtype() && weight.dtype() == x.dtype() {
        return super::device::add_rms_norm(&x, &y, &weight, eps);
    }
    let sum = (x + y)?;
    let normed = crate::ops::rms_norm(&sum, &weight, eps, crate::ops::Kernels::Fused)?;
    Ok((sum, normed))
}

/// The heads of a stacked q/k/v row.
struct Split {
    heads: usize,
    kv_heads: usize,
    d: usize,
}

impl Split {
    fn run<T: Real>(
        &self,
        qkv: &Tensor,
        bias: Option<&Tensor>,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        use rayon::prelude::*;
        /// Elements per parallel job: a decode step's rows stay on one thread (waking the pool
        /// costs more than they take), a prompt chunk's are split.
        const JOB_ELEMENTS: usize = 1 << 17;
        let guards = [qkv, cos, sin].map(|t| t.storage_and_layout());
        let [(xs, xl), (cs, cl), (ss, sl)] = &guards;
        let (x, cos, sin) = (
            storage_slice::<T>(xs, xl)?,
            storage_slice::<T>(cs, cl)?,
            storage_slice::<T>(ss, sl)?,
        );
        let bias_guard = bias.map(Tensor::storage_and_layout);
        let bias = match &bias_guard {
            Some((s, l)) => Some(storage_slice::<T>(s, l)?),
            None => None,
        };
        let (d, half) = (self.d, self.d / 2);
        let (qw, kw) = (self.heads * d, self.kv_heads * d);
        let width = qw + 2 * kw;
        let rows = x.len() / width;
        let zero = T::from_f64(0.0);
        let (mut q, mut k, mut v) = (
            vec![zero; rows * qw],
            vec![zero; rows * kw],
            vec![zero; rows * kw],
        );
        q.par_chunks_mut(qw)
            .zip(k.par_chunks_mut(kw))
            .zip(v.par_chunks_mut(kw))
            .with_min_len(JOB_ELEMENTS.div_ceil(width))
            .enumerate()
            .for_each_init(Vec::new, |biased, (row, ((q, k), v))| {
                let mut src = &x[row * width..(row + 1) * width];
                if let Some(b) = bias {
                    biased.clear();
                    biased.extend(src.iter().zip(b).map(|(&x, &b)| x + b));
                    src = biased;
                }
                let c = &cos[row * half..(row + 1) * half];
                let s = &sin[row * half..(row + 1) * half];
                let (src_q, rest) = src.split_at(qw);
                let (src_k, src_v) = rest.split_at(kw);
                rotate(q, src_q, c, s, d);
                rotate(k, src_k, c, s, d);
                v.copy_from_slice(src_v);
            });
        Ok((
            tensor(q, &Shape::from((rows, qw)))?,
            tensor(k, &Shape::from((rows, kw)))?,
            tensor(v, &Shape::from((rows, kw)))?,
        ))
    }
}

/// Each head of `d` in `x` rotated by the angles `c`, `s` into `y` (the forward of `rope`).
fn rotate<T: Real>(y: &mut [T], x: &[T], c: &[T], s: &[T], d: usize) {
    let half = d / 2;
    for (xh, yh) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let (x1, x2) = xh.split_at(half);
        let (y1, y2) = yh.split_at_mut(half);
        for j in 0..half {
            y1[j] = x1[j] * c[j] - x2[j] * s[j];
            y2[j] = x2[j] * c[j] + x1[j] * s[j];
        }
    }
}
