//! Rotary embedding ("rotate half", HF Llama/Qwen) applied in place of the composition's
//! narrow / broadcast / `cat` over a head-transposed copy: tokens stay rows of `(N, heads·d)`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::{Real, cpu_slice, row_blocks, storage_slice, tensor};

/// Rotates each `head_dim`-wide head of `x (N, heads·head_dim)` by the angles of its row:
/// `cos`, `sin` are `(N, head_dim/2)` (any shape with those elements), of `x`'s dtype.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, head_dim: usize) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Rope::new(x, cos, sin, head_dim)?)
}

/// The gradient of [`rope`]'s input for its output's gradient `grad` (the rotation by minus
/// the angles): the hand-written layer backward's (`crate::layer_grads`).
pub(crate) fn rope_grad(
    grad: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    head_dim: usize,
) -> Result<Tensor> {
    Rope::new(grad, cos, sin, head_dim)?.unrotate(grad)
}

struct Rope {
    cos: Tensor,
    sin: Tensor,
    head_dim: usize,
}

impl Rope {
    /// The op for `x (N, heads·head_dim)`, its shapes checked.
    fn new(x: &Tensor, cos: &Tensor, sin: &Tensor, head_dim: usize) -> Result<Self> {
        let (n, width) = x.dims2()?;
        let half = head_dim / 2;
        if head_dim == 0 || !head_dim.is_multiple_of(2) || !width.is_multiple_of(head_dim) {
            candle_core::bail!("rope: {:?} is not rows of heads of {head_dim}", x.shape())
        }
        if cos.elem_count() != n * half || sin.elem_count() != n * half {
            candle_core::bail!("rope: tables {:?} for {n} rows of {half}", cos.shape())
        }
        Ok(Self {
            cos: cos.contiguous()?.detach(),
            sin: sin.contiguous()?.detach(),
            head_dim,
        })
    }

    /// Rotates `x` by `+angle` (`sign = 1`, forward) or `−angle` (`sign = −1`: the backward,
    /// the rotation's transpose).
    fn rotate<T: Real>(&self, x: &[T], sign: f64) -> Result<Vec<T>> {
        let (cs, cl) = self.cos.storage_and_layout();
        let (ss, sl) = self.sin.storage_and_layout();
        let cos = storage_slice::<T>(&cs, cl)?;
        let sin = storage_slice::<T>(&ss, sl)?;
        let d = self.head_dim;
        let half = d / 2;
        let width = x.len() / (cos.len() / half).max(1);
        let sign = T::from_f64(sign);
        let mut out = vec![T::from_f64(0.0); x.len()];
        row_blocks(&mut out, width, |first, block| {
            for (r, yrow) in block.chunks_exact_mut(width).enumerate() {
                let row = first + r;
                let c = &cos[row * half..(row + 1) * half];
                let s = &sin[row * half..(row + 1) * half];
                let xrow = &x[row * width..(row + 1) * width];
                for (xh, yh) in xrow.chunks_exact(d).zip(yrow.chunks_exact_mut(d)) {
                    let (x1, x2) = xh.split_at(half);
                    let (y1, y2) = yh.split_at_mut(half);
                    for j in 0..half {
                        let (cj, sj) = (c[j], sign * s[j]);
                        y1[j] = x1[j] * cj - x2[j] * sj;
                        y2[j] = x2[j] * cj + x1[j] * sj;
                    }
                }
            }
        });
        Ok(out)
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        if s.dtype() != self.cos.dtype() {
            candle_core::bail!("rope: x {:?} vs tables {:?}", s.dtype(), self.cos.dtype())
        }
        let shape = l.shape().clone();
        Ok(match s.dtype() {
            DType::F32 => (CpuStorage::F32(self.rotate(cpu_slice(s, l)?, 1.0)?), shape),
            DType::F64 => (CpuStorage::F64(self.rotate(cpu_slice(s, l)?, 1.0)?), shape),
            other => candle_core::bail!("rope: no fused kernel for {other:?}"),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        if s.dtype() != self.cos.dtype() {
            candle_core::bail!("rope: x {:?} vs tables {:?}", s.dtype(), self.cos.dtype())
        }
        let y = super::device::rope(s, l, &self.cos, &self.sin, self.head_dim, 1.0)?;
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if grad.shape() != x.shape() {
            candle_core::bail!("rope: gradient {:?} for {:?}", grad.shape(), x.shape())
        }
        self.unrotate(grad).map(Some)
    }
}

impl Rope {
    /// The rotation's transpose (by minus the angles) applied to `grad`: the backward.
    fn unrotate(&self, grad: &Tensor) -> Result<Tensor> {
        let g = grad.contiguous()?;
        #[cfg(feature = "cuda")]
        if super::device::supported(&g) {
            let (s, l) = g.storage_and_layout();
            let candle_core::Storage::Cuda(s) = &*s else {
                candle_core::bail!("rope: the gradient is not on the GPU")
            };
            let dx = super::device::rope(s, l, &self.cos, &self.sin, self.head_dim, -1.0)?;
            let dx = candle_core::Storage::Cuda(dx);
            let op = candle_core::op::BackpropOp::none();
            return Ok(Tensor::from_storage(dx, g.shape().clone(), op, false));
        }
        let (gs, gl) = g.storage_and_layout();
        match g.dtype() {
            DType::F32 => tensor(
                self.rotate::<f32>(storage_slice(&gs, gl)?, -1.0)?,
                g.shape(),
            ),
            _ => tensor(
                self.rotate::<f64>(storage_slice(&gs, gl)?, -1.0)?,
                g.shape(),
            ),
        }
    }
}
