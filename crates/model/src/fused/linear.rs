//! `x Wᵀ (+ b)` as one node. candle's own `x.matmul(&w.t())` is a matmul node over a transpose
//! node: its backward forms `dWᵀ`, then zero-fills and adds it, then transposes, zero-fills and
//! adds again through a strided copy, per weight per micro-batch. Here `dW = gᵀ x` is formed in
//! the weight's own `(out, in)` layout by one gemm. On a GPU the same node runs the backend's
//! product (cuBLAS) forward, and two products backward.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::{
    Bf16Products, Mat, Real, Rhs, cpu_slice, product_new, same_dtype, storage_slice, tensor,
};

/// `x (N, in) · w (out, in)ᵀ + b (out)` → `(N, out)`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (n, i) = x.dims2()?;
    let (o, wi) = w.dims2()?;
    if i != wi {
        candle_core::bail!("linear: x {:?} vs weight {:?}", x.shape(), w.shape())
    }
    let op = Linear::new(n, i, o);
    if !super::supported(x) {
        // On a GPU (f32 or bf16, one dtype): the node with the backend's product; elsewhere, and
        // for empty products, candle's.
        let node = super::on_device(x) && w.dtype() == x.dtype() && n * i * o > 0;
        let y = if node {
            x.contiguous()?.apply_op2(&w.contiguous()?, op)?
        } else {
            x.matmul(&w.t()?)?
        };
        return match b {
            None => Ok(y),
            Some(b) => y.broadcast_add(b),
        };
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match b {
        None => x.apply_op2(&w, op),
        Some(b) => {
            if b.elem_count() != o {
                candle_core::bail!("linear: bias {:?} for {o} outputs", b.shape())
            }
            x.apply_op3(&w, &b.contiguous()?, op)
        }
    }
}

/// `(dx, dw, db)` of [`linear`] for its output's gradient `grad`, every one computed: the
/// hand-written layer backward's (`crate::layer_grads`), which runs its forward without a graph.
/// On the CPU the fused op's own kernels; elsewhere two products of the backend and, with a
/// bias, its gradient summed over the rows in f32 (as the forward's `broadcast_add` would give
/// it in the bias's dtype).
pub(crate) fn linear_grads(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    grad: &Tensor,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    match wanted_grads(x, w, b, grad, true)? {
        (Some(dx), Some(dw), db) => Ok((dx, dw, db)),
        _ => candle_core::bail!("linear: a wanted gradient was not computed"),
    }
}

/// `dx` of [`linear`] alone, for a frozen weight and bias (LoRA's backward,
/// [`crate::low_rank`]): the product `dW` would cost is not formed.
pub(crate) fn linear_input_grad(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<Tensor> {
    match wanted_grads(x, w, None, grad, false)? {
        (Some(dx), ..) => Ok(dx),
        _ => candle_core::bail!("linear: the input's gradient was not computed"),
    }
}

/// `dx`, and `dw` and `db` (with a bias) when `weights`.
fn wanted_grads(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    grad: &Tensor,
    weights: bool,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let ((n, i), o) = (x.dims2()?, w.dim(0)?);
    if super::supported(x) {
        let (op, want) = (
            Linear::new(n, i, o),
            [true, weights, weights && b.is_some()],
        );
        return match x.dtype() {
            DType::F32 => op.bwd::<f32>(x, w, b, grad, want),
            _ => op.bwd::<f64>(x, w, b, grad, want),
        };
    }
    let (dx, dw) = Linear::bwd_products(x, w, grad, [true, weights])?;
    let db = b.filter(|_| weights).map(|b| {
        let sum = grad.to_dtype(DType::F32)?.sum(0)?;
        sum.to_dtype(b.dtype())?.reshape(b.shape())
    });
    Ok((dx, dw, db.transpose()?))
}

#[derive(Clone, Copy)]
pub(crate) struct Linear {
    pub(crate) n: usize,
    pub(crate) i: usize,
    pub(crate) o: usize,
    /// Whether its CPU products run on the AMX tiles: the scope the op was made in
    /// ([`super::Bf16Products`]), kept for its backward, which candle's graph may run outside
    /// that scope.
    tiles: bool,
}

impl Linear {
    /// `(N, in) · (out, in)ᵀ` in this thread's precision ([`super::Bf16Products`]).
    pub(crate) fn new(n: usize, i: usize, o: usize) -> Self {
        let tiles = super::products::bf16_products();
        Self { n, i, o, tiles }
    }

    fn fwd<T: Real>(&self, x: &[T], w: &[T], b: Option<&[T]>) -> Vec<T> {
        let Self { n, i, o, tiles } = *self;
        let _tiles = Bf16Products::enter(tiles);
        let wt = T::rhs(Mat::transposed(w, i), i, o);
        let few_rows = match wt {
            // The few-rows kernel is f32's: on the tiles every product takes them.
            Rhs::View(_) => T::linear_few_rows(n, i, o, x, w),
            Rhs::Tiles(_) => None,
        };
        let mut y = few_rows.unwrap_or_else(|| product_new(n, o, i, Mat::rows(x, i), &wt));
        // Then the bias, one add per output.
        if let Some(b) = b {
            for row in y.chunks_exact_mut(o) {
                for (v, &b) in row.iter_mut().zip(b) {
                    *v += b;
                }
            }
        }
        y
    }

    fn cpu<T: Real>(
        &self,
        x: &[T],
        w: &[T],
        b: Option<&[T]>,
        wrap: fn(Vec<T>) -> CpuStorage,
    ) -> (CpuStorage, Shape) {
        (wrap(self.fwd(x, w, b)), Shape::from((self.n, self.o)))
    }

    /// `x (N, in) · w (out, in)ᵀ` by the backend's own product, `w` read through its transposed
    /// layout (no copy): the forward on a GPU (cuBLAS). Generic so the CPU tests run this call.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn product<S: BackendStorage>(
        &self,
        x: &S,
        xl: &Layout,
        w: &S,
        wl: &Layout,
    ) -> Result<S> {
        x.matmul(w, (1, self.n, self.o, self.i), xl, &wl.transpose(0, 1)?)
    }

    /// `(dx, dw)` as two products of candle ops on any device, each only when `want`ed:
    /// `dx (N, in) = g w`, `dw (out, in) = gᵀ x` (the transposed operand a view, the result in
    /// the weight's own layout).
    pub(crate) fn bwd_products(
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
        [want_dx, want_dw]: [bool; 2],
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let dx = want_dx.then(|| g.matmul(w)).transpose()?;
        let dw = want_dw.then(|| g.t()?.matmul(x)).transpose()?;
        Ok((dx, dw))
    }

    /// `(dx, dw, db)`, each only when `want`ed (and `db` when there is a bias).
    fn bwd<T: Real>(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        grad: &Tensor,
        [want_dx, want_dw, want_db]: [bool; 3],
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Self { n, i, o, tiles } = *self;
        let _tiles = Bf16Products::enter(tiles);
        let g = grad.contiguous()?;
        let (gs, gl) = g.storage_and_layout();
        let g = storage_slice::<T>(&gs, gl)?;
        let (xs, xl) = x.storage_and_layout();
        let xv = storage_slice::<T>(&xs, xl)?;
        let (ws, wl) = w.storage_and_layout();
        let wv = storage_slice::<T>(&ws, wl)?;
        let zero = T::from_f64(0.0);
        let dx = if want_dx {
            // dx (N, in) = g (N, out) · w (out, in)
            let w = T::rhs(Mat::rows(wv, i), o, i);
            let dx = product_new(n, i, o, Mat::rows(g, o), &w);
            Some(tensor(dx, x.shape())?)
        } else {
            None
        };
        let dw = if want_dw {
            // dw (out, in) = gᵀ (out, N) · x (N, in)
            let x = T::rhs(Mat::rows(xv, i), n, i);
            let dw = product_new(o, i, n, Mat::transposed(g, o), &x);
            Some(tensor(dw, w.shape())?)
        } else {
            None
        };
        let db = match b {
            Some(b) if want_db => {
                let mut db = vec![zero; o];
                for row in g.chunks_exact(o) {
                    for (d, &v) in db.iter_mut().zip(row) {
                        *d += v;
                    }
                }
                Some(tensor(db, b.shape())?)
            }
            _ => None,
        };
        Ok((dx, dw, db))
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok(match same_dtype("fused-linear", s1, s2)? {
            DType::F32 => self.cpu(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                None,
                CpuStorage::F32,
            ),
            _ => self.cpu(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                None,
                CpuStorage::F64,
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
        let y = self.product(s1, l1, s2, l2)?;
        Ok((y, Shape::from((self.n, self.o))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let want = [x.track_op(), w.track_op()];
        if !x.device().is_cpu() {
            return Self::bwd_products(x, w, grad, want);
        }
        let want = [want[0], want[1], false];
        let (dx, dw, _) = match x.dtype() {
            DType::F32 => self.bwd::<f32>(x, w, None, grad, want)?,
            _ => self.bwd::<f64>(x, w, None, grad, want)?,
        };
        Ok((dx, dw))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "fused-linear-bias"
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
        same_dtype("fused-linear-bias", s2, s3)?;
        Ok(match same_dtype("fused-linear-bias", s1, s2)? {
            DType::F32 => self.cpu(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                Some(cpu_slice(s3, l3)?),
                CpuStorage::F32,
            ),
            _ => self.cpu(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                Some(cpu_slice(s3, l3)?),
                CpuStorage::F64,
            ),
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let want = [x.track_op(), w.track_op(), b.track_op()];
        match x.dtype() {
            DType::F32 => self.bwd::<f32>(x, w, Some(b), grad, want),
            _ => self.bwd::<f64>(x, w, Some(b), grad, want),
        }
    }
}
