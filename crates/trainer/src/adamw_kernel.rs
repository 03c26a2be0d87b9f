//! The AdamW update in place over each parameter's flat f32 buffer, on the CPU and (in a `cuda`
//! build) on a GPU with Sluice's own kernels (`crates/model/kernels/adamw.cu`): three passes
//! (first moment, second moment, parameter) that allocate nothing, where the composition of
//! candle ops launches and allocates a dozen full-size temporaries per parameter and step.
//!
//! A step's parameters go through [`apply_many`]: on a GPU every parameter whose operands qualify
//! is updated by one launch (`adamw_many_f32`), where three launches per parameter (about 870 for
//! Qwen2.5-0.5B's shapes) each paid candle's dispatch.
//!
//! Every element goes through exactly the f32 operations, in the same order, as the composition
//! ([`compose`], kept for other devices and as the reference the tests compare against), so the
//! two give bit-identical weights and moments: resuming from a checkpoint written by either stays
//! exact.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Tensor, Var, bail};

/// The per-step constants of one AdamW update, as candle's `affine` would round them to f32.
#[derive(Debug, Clone, Copy)]
pub struct Update {
    /// Gradient scale from global-norm clipping.
    pub clip_scale: f64,
    /// β₁, β₂.
    pub beta1: f64,
    /// See `beta1`.
    pub beta2: f64,
    /// Bias corrections `1 − β₁ᵗ`, `1 − β₂ᵗ`.
    pub bc1: f64,
    /// See `bc1`.
    pub bc2: f64,
    /// ε.
    pub eps: f64,
    /// Learning rate.
    pub lr: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
}

/// Updates the f32 master weights `master` and the moments `m`, `v` from the gradient `g`: in
/// place when all four are contiguous f32 on the CPU or (`cuda` builds) a GPU, by the
/// composition otherwise.
pub fn apply(master: &Var, m: &mut Tensor, v: &mut Tensor, g: &Tensor, u: Update) -> Result<()> {
    let p = master.as_tensor();
    let in_place = |t: &Tensor| {
        let device = t.device();
        (device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda()))
            && t.dtype() == DType::F32
            && t.is_contiguous()
            && t.device().same_device(p.device())
    };
    if [p, &*m, &*v, g].into_iter().all(in_place) {
        m.inplace_op2(g, &Moment { first: true, u })?;
        v.inplace_op2(g, &Moment { first: false, u })?;
        p.inplace_op3(m, v, &Step { u })
    } else {
        let (next, m_next, v_next) = compose(p, m, v, g, u)?;
        *m = m_next;
        *v = v_next;
        master.set(&next)
    }
}

/// One parameter's operands for [`apply_many`].
pub struct Operands<'a> {
    /// The f32 master weights, updated in place.
    pub master: &'a Var,
    /// First moment.
    pub m: &'a mut Tensor,
    /// Second moment.
    pub v: &'a mut Tensor,
    /// The gradient.
    pub g: &'a Tensor,
}

/// [`apply`] for every parameter of a step. On a GPU (`cuda` builds), the parameters whose four
/// operands are contiguous f32 on the first one's device are updated by one kernel launch, the
/// rest one by one; the bits are [`apply`]'s either way. Each parameter comes with the index an
/// error names it by.
pub fn apply_many(params: Vec<(usize, Operands<'_>)>, u: Update) -> Result<()> {
    #[cfg(feature = "cuda")]
    let params = cuda::apply_together(params, u)?;
    for (i, o) in params {
        apply(o.master, o.m, o.v, o.g, u).map_err(|e| e.context(format!("parameter {i}")))?;
    }
    Ok(())
}

/// `Σ g²` over `grads` in one launch on a GPU (`cuda` builds) when all are contiguous f32 on one
/// device; `None` otherwise (the caller sums per tensor).
pub fn sum_of_squares(grads: &[&Tensor]) -> Result<Option<f64>> {
    #[cfg(feature = "cuda")]
    return cuda::sum_of_squares(grads);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = grads;
        Ok(None)
    }
}

/// Fresh copies of `params` in `dtype` (f32 or bf16) by one launch on a GPU (`cuda` builds),
/// when all are contiguous f32 on one device: a published snapshot, where a copy per parameter
/// was a launch each (about 290 for Qwen2.5-0.5B's shapes). The values are `to_dtype`'s. `None`
/// otherwise (the caller copies per tensor).
pub fn snapshot(params: &[&Tensor], dtype: DType) -> Result<Option<Vec<Tensor>>> {
    #[cfg(feature = "cuda")]
    return cuda::snapshot(params, dtype, false);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (params, dtype);
        Ok(None)
    }
}

/// [`snapshot`]'s copies made as variables: a step's parameters in the compute dtype, for
/// [`sluice_model::TrainableModel::set_step_weights`] to take as they are. `None` where
/// [`snapshot`] gives none.
pub fn step_copies(params: &[&Tensor], dtype: DType) -> Result<Option<Vec<Tensor>>> {
    #[cfg(feature = "cuda")]
    return cuda::snapshot(params, dtype, true);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (params, dtype);
        Ok(None)
    }
}

/// Adds one micro-batch's gradients (per parameter: its index and one gradient, or two for a
/// tied embedding, in f32 or bf16) to the step's f32 sums: on a GPU (`cuda` builds) every
/// parameter whose tensors qualify by one launch, with the bits of converting each gradient
/// and adding tensor by tensor. Hands back the parameters it did not take, for the caller to
/// add per tensor.
pub fn accumulate(
    sums: &mut [Option<Tensor>],
    grads: Vec<(usize, Vec<Tensor>)>,
) -> Result<Vec<(usize, Vec<Tensor>)>> {
    #[cfg(feature = "cuda")]
    return cuda::accumulate(sums, grads);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = sums;
        Ok(grads)
    }
}

/// The update as candle ops: `(next param, m, v)`, fresh tensors.
pub fn compose(
    p: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    u: Update,
) -> Result<(Tensor, Tensor, Tensor)> {
    let g = g.affine(u.clip_scale, 0.0)?;
    let m = (m.affine(u.beta1, 0.0)? + g.affine(1.0 - u.beta1, 0.0)?)?;
    let v = (v.affine(u.beta2, 0.0)? + g.sqr()?.affine(1.0 - u.beta2, 0.0)?)?;
    let m_hat = m.affine(1.0 / u.bc1, 0.0)?;
    let v_hat = v.affine(1.0 / u.bc2, 0.0)?;
    let adam = (m_hat / (v_hat.sqrt()? + u.eps)?)?;
    let next = (p.affine(1.0 - u.lr * u.weight_decay, 0.0)? - adam.affine(u.lr, 0.0)?)?.detach();
    Ok((next, m, v))
}

/// The f32 slice a contiguous layout covers.
fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("adamw: non-contiguous operand")
    };
    Ok(&s.as_slice::<f32>()?[a..b])
}

fn slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("adamw: non-contiguous operand")
    };
    match s {
        CpuStorage::F32(v) => Ok(&mut v[a..b]),
        _ => bail!("adamw: operand is not f32"),
    }
}

/// Elements per job of the CPU update: large enough that a job's bookkeeping is nothing
/// against streaming it, small enough that a large parameter splits over every thread.
const CHUNK: usize = 1 << 16;

/// `update(dst, inputs)` over matching chunks of `dst` and each of `inputs` (all of one
/// length) on the current rayon pool (the trainer's): each element's arithmetic is the same
/// whichever thread does it.
fn on_pool<const N: usize>(
    dst: &mut [f32],
    inputs: [&[f32]; N],
    update: impl Fn(&mut [f32], [&[f32]; N]) + Sync,
) {
    use rayon::prelude::*;
    dst.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, dst)| update(dst, inputs.map(|x| &x[i * CHUNK..][..dst.len()])));
}

/// `m ← β₁m + (1−β₁)g'` or `v ← β₂v + (1−β₂)g'²`, `g' = clip · g`.
struct Moment {
    first: bool,
    u: Update,
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> Result<()> {
        let u = self.u;
        let dst = slice_mut(dst, dst_l)?;
        let g = slice(g, g_l)?;
        if dst.len() != g.len() {
            bail!("adamw: moment and gradient sizes differ")
        }
        let clip = u.clip_scale as f32;
        // Each product is followed by `+ 0`, as `affine(x, 0)` computes it.
        if self.first {
            let (b, nb) = (u.beta1 as f32, (1.0 - u.beta1) as f32);
            on_pool(dst, [g], |dst, [g]| {
                for (m, &g) in dst.iter_mut().zip(g) {
                    let g = g * clip + 0.0;
                    *m = (*m * b + 0.0) + (g * nb + 0.0);
                }
            });
        } else {
            let (b, nb) = (u.beta2 as f32, (1.0 - u.beta2) as f32);
            on_pool(dst, [g], |dst, [g]| {
                for (v, &g) in dst.iter_mut().zip(g) {
                    let g = g * clip + 0.0;
                    *v = (*v * b + 0.0) + (g * g * nb + 0.0);
                }
            });
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
    ) -> Result<()> {
        let u = self.u;
        let (b, nb) = if self.first {
            (u.beta1, 1.0 - u.beta1)
        } else {
            (u.beta2, 1.0 - u.beta2)
        };
        let device = dst.device.clone();
        let (d0, d1) = cuda::range(dst_l)?;
        let (g0, g1) = cuda::range(g_l)?;
        if d1 - d0 != g1 - g0 {
            bail!("adamw: moment and gradient sizes differ")
        }
        let n = (d1 - d0) as u64;
        let func = sluice_model::kernels::ADAMW.function(&device, "adamw_moment_f32")?;
        let g = g.as_cuda_slice::<f32>()?.slice(g0..g1);
        let mut dst = dst.as_cuda_slice_mut::<f32>()?.slice_mut(d0..d1);
        let stream = device.cuda_stream();
        let mut launch = stream.launch_builder(&func);
        let (clip, b, nb, second) = (
            u.clip_scale as f32,
            b as f32,
            nb as f32,
            i32::from(!self.first),
        );
        launch
            .arg(&mut dst)
            .arg(&g)
            .arg(&n)
            .arg(&clip)
            .arg(&b)
            .arg(&nb)
            .arg(&second);
        cuda::launch(launch, n)
    }
}

/// `p ← (1 − lr·λ)p − lr · m̂ / (√v̂ + ε)`.
struct Step {
    u: Update,
}

impl InplaceOp3 for Step {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        m: &CpuStorage,
        m_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<()> {
        let u = self.u;
        let p = slice_mut(dst, dst_l)?;
        let (m, v) = (slice(m, m_l)?, slice(v, v_l)?);
        if p.len() != m.len() || p.len() != v.len() {
            bail!("adamw: parameter and moment sizes differ")
        }
        let (c1, c2) = ((1.0 / u.bc1) as f32, (1.0 / u.bc2) as f32);
        let (eps, lr, decay) = (
            u.eps as f32,
            u.lr as f32,
            (1.0 - u.lr * u.weight_decay) as f32,
        );
        on_pool(p, [m, v], |p, [m, v]| {
            for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
                let adam = (m * c1 + 0.0) / ((v * c2 + 0.0).sqrt() * 1.0 + eps);
                *p = (*p * decay + 0.0) - (adam * lr + 0.0);
            }
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        m: &candle_core::CudaStorage,
        m_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<()> {
        let u = self.u;
        let device = dst.device.clone();
        let (p0, p1) = cuda::range(dst_l)?;
        let (m0, m1) = cuda::range(m_l)?;
        let (v0, v1) = cuda::range(v_l)?;
        if p1 - p0 != m1 - m0 || p1 - p0 != v1 - v0 {
            bail!("adamw: parameter and moment sizes differ")
        }
        let n = (p1 - p0) as u64;
        let func = sluice_model::kernels::ADAMW.function(&device, "adamw_step_f32")?;
        let m = m.as_cuda_slice::<f32>()?.slice(m0..m1);
        let v = v.as_cuda_slice::<f32>()?.slice(v0..v1);
        let mut p = dst.as_cuda_slice_mut::<f32>()?.slice_mut(p0..p1);
        let (c1, c2) = ((1.0 / u.bc1) as f32, (1.0 / u.bc2) as f32);
        let (eps, lr, decay) = (
            u.eps as f32,
            u.lr as f32,
            (1.0 - u.lr * u.weight_decay) as f32,
        );
        let stream = device.cuda_stream();
        let mut launch = stream.launch_builder(&func);
        launch
            .arg(&mut p)
            .arg(&m)
            .arg(&v)
            .arg(&n)
            .arg(&c1)
            .arg(&c2)
            .arg(&eps)
            .arg(&lr)
            .arg(&decay);
        cuda::launch(launch, n)
    }
}

#[cfg(feature = "cuda")]
mod cuda;

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    }

    #[test]
    fn in_place_update_is_bit_identical_to_the_composition() -> Result<()> {
        let dev = Device::Cpu;
        for (shape, decay, clip) in [
            ((7usize, 5usize), 0.0, 1.0),
            ((1, 33), 0.1, 0.37),
            ((16, 3), 0.01, 1.0),
            // Chunks of the pool's split, the last one short.
            ((3, CHUNK + 7), 0.01, 0.5),
        ] {
            let p0 = Tensor::randn(0f32, 1.0, shape, &dev)?;
            let master = Var::from_tensor(&p0)?;
            let (mut m, mut v) = (
                Tensor::zeros(shape, DType::F32, &dev)?,
                Tensor::zeros(shape, DType::F32, &dev)?,
            );
            let (mut rp, mut rm, mut rv) = (p0.copy()?, m.copy()?, v.copy()?);
            for t in 1..=4 {
                let g = Tensor::randn(0f32, 1.0, shape, &dev)?;
                let u = Update {
                    clip_scale: clip,
                    beta1: 0.9,
                    beta2: 0.999,
                    bc1: 1.0 - 0.9f64.powi(t),
                    bc2: 1.0 - 0.999f64.powi(t),
                    eps: 1e-8,
                    lr: 1e-2,
                    weight_decay: decay,
                };
                apply(&master, &mut m, &mut v, &g, u)?;
                (rp, rm, rv) = compose(&rp, &rm, &rv, &g, u)?;
                assert_eq!(
                    bits(master.as_tensor()),
                    bits(&rp),
                    "weights, step {t}, shape {shape:?}"
                );
                assert_eq!(bits(&m), bits(&rm), "first moment, step {t}");
                assert_eq!(bits(&v), bits(&rv), "second moment, step {t}");
            }
            assert_ne!(
                bits(master.as_tensor()),
                bits(&p0),
                "the update moved the weights"
            );
        }
        Ok(())
    }

    #[test]
    fn strided_operands_take_the_composition() -> Result<()> {
        let dev = Device::Cpu;
        let p0 = Tensor::randn(0f32, 1.0, (4, 6), &dev)?;
        let master = Var::from_tensor(&p0)?;
        let (mut m, mut v) = (
            Tensor::zeros((4, 6), DType::F32, &dev)?,
            Tensor::zeros((4, 6), DType::F32, &dev)?,
        );
        // A transposed gradient is not contiguous: the fallback must give the same result.
        let g = Tensor::randn(0f32, 1.0, (6, 4), &dev)?.t()?;
        let u = Update {
            clip_scale: 1.0,
            beta1: 0.9,
            beta2: 0.999,
            bc1: 0.1,
            bc2: 0.001,
            eps: 1e-8,
            lr: 1e-2,
            weight_decay: 0.0,
        };
        apply(&master, &mut m, &mut v, &g, u)?;
        let (rp, _, _) = compose(
            &p0,
            &Tensor::zeros((4, 6), DType::F32, &dev)?,
            &Tensor::zeros((4, 6), DType::F32, &dev)?,
            &g,
            u,
        )?;
        assert_eq!(bits(master.as_tensor()), bits(&rp));
        Ok(())
    }
}
