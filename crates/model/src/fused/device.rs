//! The fused training ops on a CUDA device (`cuda` builds): launches of Sluice's kernels
//! `kernels/fused.cu` (RMSNorm, SwiGLU, RoPE), `kernels/attention.cu` (attention over packed
//! segments) and `kernels/scores.cu` (the token scores' rows) for f32 and bf16 tensors, forward
//! and backward. The mathematics is the CPU ops';
//! `crates/model/tests/cuda_emu` runs the same kernels, launched as here, on the CPU.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Layout, Result, Shape, Storage, Tensor, bail};

use crate::kernels::{FUSED, SCORES};

/// Threads of a norm's row and of the elementwise kernels (`THREADS` in the emulation harness).
const THREADS: u32 = 256;
/// Rows each block sums for a norm's weight gradient (`CHUNK_ROWS` in the harness).
const DW_CHUNK_ROWS: u32 = 64;
/// The most blocks an elementwise launch takes; its threads then stride over the rest.
const MAX_BLOCKS: u64 = 4096;

/// Whether the kernels handle tensors like `t`: f32 or bf16 on a CUDA device.
pub(crate) fn supported(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cuda(_)) && matches!(t.dtype(), DType::F32 | DType::BF16)
}

/// Runs `$body` with `$t` the element type of `$dtype` (f32 or bf16).
macro_rules! by_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            other => bail!("no CUDA kernel for {other:?}"),
        }
    };
}

mod attention;
mod paged;

pub(crate) use attention::{DeviceSlots, attention, attention_bwd, attention_head_dim};
pub(crate) use paged::{kv_rows, paged_attention};

/// The kernels' name suffix for `dtype`.
fn suffix(dtype: DType) -> &'static str {
    if dtype == DType::BF16 { "bf16" } else { "f32" }
}

fn u32_of(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{what} {n} exceeds u32")))
}

/// The contiguous elements of a CUDA storage seen through `layout`.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, layout: &Layout) -> Result<CudaView<'a, T>> {
    let Some((a, b)) = layout.contiguous_offsets() else {
        bail!(
            "fused op on the GPU: non-contiguous input {:?}",
            layout.shape()
        )
    };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// `t`'s storage, which must be on a CUDA device.
fn cuda_of(s: &Storage) -> Result<&CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => bail!("fused op: a tensor is not on the GPU"),
    }
}

/// A fresh buffer of `n` elements that the kernel about to be launched writes whole.
fn output<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every caller launches, right after, a kernel that writes each of the `n` elements
    // before anything reads them (on the device's stream, so in order), or returns no tensor
    // of them when there is no work (`n` = 0).
    #[allow(unsafe_code)]
    unsafe {
        dev.alloc::<T>(n.max(1))
    }
}

/// A tensor owning `slice`, outside any graph.
fn tensor<T: CudaDType + DeviceRepr>(
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: &Shape,
) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape.clone(), BackpropOp::none(), false)
}

fn config(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Blocks of [`THREADS`] for `n` elements (or slots of work), at most [`MAX_BLOCKS`].
fn blocks(n: u64) -> u32 {
    n.div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS) as u32
}

/// Launches a prepared call; a grid without blocks (no rows) launches nothing.
fn launch(mut args: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
    if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 {
        return Ok(());
    }
    // SAFETY: every caller pushes the kernel's parameters in order with their types (device
    // buffers of the element type the kernel's suffix names, sized for the grid it passes).
    #[allow(unsafe_code)]
    unsafe { args.launch(cfg) }.w()?;
    Ok(())
}

/// RMSNorm forward: `x` rows of `w.len()`.
pub(crate) fn rms_norm(
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    eps: f64,
) -> Result<CudaStorage> {
    let dev = &x.device;
    let (n, d) = (xl.shape().elem_count(), wl.shape().elem_count());
    let (d32, eps) = (u32_of(d, "rms norm width")?, eps as f32);
    let rows = u32_of(n / d.max(1), "rms norm rows")?;
    by_dtype!(x.dtype(), T => {
        let (xv, wv) = (view::<T>(x, xl)?, view::<T>(w, wl)?);
        let mut y = output::<T>(dev, n)?;
        let f = FUSED.function(dev, &format!("rms_fwd_{}", suffix(x.dtype())))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&xv).arg(&wv).arg(&mut y).arg(&d32).arg(&eps);
        launch(a, config((rows, 1), THREADS))?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })
}

/// The engine's residual add and the norm after it, `(x + y, rms_norm(x + y) ⊙ w)`, in one
/// launch where the composition took two.
pub(crate) fn add_rms_norm(
    x: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let guards = [x, y, w].map(|t| t.storage_and_layout());
    let [(xs, xl), (ys, yl), (ws, wl)] = &guards;
    let (xs, ys, ws) = (cuda_of(xs)?, cuda_of(ys)?, cuda_of(ws)?);
    let dev = &xs.device;
    let (n, d) = (x.elem_count(), w.elem_count());
    let (d32, eps) = (u32_of(d, "rms norm width")?, eps as f32);
    let rows = u32_of(n / d.max(1), "rms norm rows")?;
    by_dtype!(x.dtype(), T => {
        let (xv, yv, wv) = (view::<T>(xs, xl)?, view::<T>(ys, yl)?, view::<T>(ws, wl)?);
        let (mut sum, mut normed) = (output::<T>(dev, n)?, output::<T>(dev, n)?);
        let f = FUSED.function(dev, &format!("add_rms_fwd_{}", suffix(x.dtype())))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&xv).arg(&yv).arg(&wv).arg(&mut sum).arg(&mut normed).arg(&d32).arg(&eps);
        launch(a, config((rows, 1), THREADS))?;
        Ok((tensor(sum, dev, x.shape()), tensor(normed, dev, x.shape())))
    })
}

/// RMSNorm backward: `(dx, dw)` for the output gradient `g`.
pub(crate) fn rms_norm_bwd(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    if x.elem_count() == 0 {
        return Ok((x.zeros_like()?, w.zeros_like()?));
    }
    let guards = [x, w, g].map(|t| t.storage_and_layout());
    let [(xs, xl), (ws, wl), (gs, gl)] = &guards;
    let (xs, ws, gs) = (cuda_of(xs)?, cuda_of(ws)?, cuda_of(gs)?);
    let dev = &xs.device;
    let (n, d) = (x.elem_count(), w.elem_count());
    let rows = n / d.max(1);
    let chunks = u32_of(rows, "rms norm rows")?.div_ceil(DW_CHUNK_ROWS);
    let (d32, rows32, eps) = (u32_of(d, "rms norm width")?, rows as u32, eps as f32);
    let sfx = suffix(x.dtype());
    by_dtype!(x.dtype(), T => {
        let (xv, wv, gv) = (view::<T>(xs, xl)?, view::<T>(ws, wl)?, view::<T>(gs, gl)?);
        let stream = dev.cuda_stream();
        let mut dx = output::<T>(dev, n)?;
        let mut inv = output::<f32>(dev, rows)?;
        let f = FUSED.function(dev, &format!("rms_bwd_dx_{sfx}"))?;
        let mut a = stream.launch_builder(&f);
        a.arg(&xv).arg(&wv).arg(&gv).arg(&mut dx).arg(&mut inv).arg(&d32).arg(&eps);
        launch(a, config((rows32, 1), THREADS))?;
        let mut part = output::<f32>(dev, chunks as usize * d)?;
        let f = FUSED.function(dev, &format!("rms_bwd_dw_part_{sfx}"))?;
        let mut a = stream.launch_builder(&f);
        a.arg(&xv).arg(&gv).arg(&inv).arg(&mut part).arg(&rows32).arg(&d32).arg(&DW_CHUNK_ROWS);
        launch(a, config((d32.div_ceil(THREADS), chunks), THREADS))?;
        let mut dw = output::<T>(dev, d)?;
        let f = FUSED.function(dev, &format!("rms_bwd_dw_sum_{sfx}"))?;
        let mut a = stream.launch_builder(&f);
        a.arg(&part).arg(&mut dw).arg(&chunks).arg(&d32);
        launch(a, config((d32.div_ceil(THREADS), 1), THREADS))?;
        Ok((tensor(dx, dev, x.shape()), tensor(dw, dev, w.shape())))
    })
}

/// `silu(gate) ⊙ up`.
pub(crate) fn swiglu(
    gate: &CudaStorage,
    gl: &Layout,
    up: &CudaStorage,
    ul: &Layout,
) -> Result<CudaStorage> {
    let dev = &gate.device;
    let n = gl.shape().elem_count();
    by_dtype!(gate.dtype(), T => {
        let (gv, uv) = (view::<T>(gate, gl)?, view::<T>(up, ul)?);
        let mut out = output::<T>(dev, n)?;
        let f = FUSED.function(dev, &format!("swiglu_fwd_{}", suffix(gate.dtype())))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        let n64 = n as u64;
        a.arg(&gv).arg(&uv).arg(&mut out).arg(&n64);
        launch(a, config((blocks(n64), 1), THREADS))?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })
}

/// SwiGLU backward: `(d gate, d up)`, computed by one kernel into one buffer.
pub(crate) fn swiglu_bwd(gate: &Tensor, up: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    let n = gate.elem_count();
    let both = {
        let guards = [gate, up, g].map(|t| t.storage_and_layout());
        let [(a, al), (b, bl), (c, cl)] = &guards;
        let (a, b, c) = (cuda_of(a)?, cuda_of(b)?, cuda_of(c)?);
        let dev = &a.device;
        by_dtype!(gate.dtype(), T => {
            let (av, bv, cv) = (view::<T>(a, al)?, view::<T>(b, bl)?, view::<T>(c, cl)?);
            let mut grads = output::<T>(dev, 2 * n)?;
            let f = FUSED.function(dev, &format!("swiglu_bwd_{}", suffix(gate.dtype())))?;
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            let n64 = n as u64;
            l.arg(&av).arg(&bv).arg(&cv).arg(&mut grads).arg(&n64);
            launch(l, config((blocks(n64), 1), THREADS))?;
            tensor(grads, dev, &Shape::from((2, n)))
        })
    };
    Ok((
        both.get(0)?.reshape(gate.shape())?,
        both.get(1)?.reshape(up.shape())?,
    ))
}

/// Rotates each head of `x (rows, width)` by `sign ·` the angles in `cos`, `sin` (`(rows, d/2)`).
pub(crate) fn rope(
    x: &CudaStorage,
    xl: &Layout,
    cos: &Tensor,
    sin: &Tensor,
    head_dim: usize,
    sign: f32,
) -> Result<CudaStorage> {
    let dev = &x.device;
    let n = xl.shape().elem_count();
    let rows = cos.elem_count() / (head_dim / 2).max(1);
    let width = u32_of(n / rows.max(1), "rope width")?;
    let d = u32_of(head_dim, "head dim")?;
    let guards = [cos, sin].map(|t| t.storage_and_layout());
    let [(cs, cl), (ss, sl)] = &guards;
    let (cs, ss) = (cuda_of(cs)?, cuda_of(ss)?);
    by_dtype!(x.dtype(), T => {
        let (xv, cv, sv) = (view::<T>(x, xl)?, view::<T>(cs, cl)?, view::<T>(ss, sl)?);
        let mut y = output::<T>(dev, n)?;
        let f = FUSED.function(dev, &format!("rope_{}", suffix(x.dtype())))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        let rows64 = rows as u64;
        a.arg(&xv).arg(&cv).arg(&sv).arg(&mut y).arg(&rows64).arg(&width).arg(&d).arg(&sign);
        launch(a, config((blocks(n as u64 / 2), 1), THREADS))?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })
}

/// The engine's stacked q/k/v product `qkv (rows, (heads + 2·kv_heads)·d)` plus `bias` split
/// into q `(rows, heads·d)` and k, v `(rows, kv_heads·d)`, q and k rotated by the rows' angles in
/// `cos`, `sin` (`(rows, d/2)`): one launch where the bias, two rotations and the split's copies
/// took six.
pub(crate) fn split_rope(
    qkv: &Tensor,
    bias: Option<&Tensor>,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let rows = qkv.dim(0)?;
    // Without a bias the kernel is handed `qkv` in its place and told not to read it.
    let has_bias = u32::from(bias.is_some());
    let guards = [qkv, bias.unwrap_or(qkv), cos, sin].map(|t| t.storage_and_layout());
    let [(xs, xl), (bs, bl), (cs, cl), (ss, sl)] = &guards;
    let (xs, bs, cs, ss) = (cuda_of(xs)?, cuda_of(bs)?, cuda_of(cs)?, cuda_of(ss)?);
    let dev = &xs.device;
    let (hq, hk, d) = (
        u32_of(heads, "query heads")?,
        u32_of(kv_heads, "key/value heads")?,
        u32_of(head_dim, "head dim")?,
    );
    by_dtype!(qkv.dtype(), T => {
        let (xv, bv) = (view::<T>(xs, xl)?, view::<T>(bs, bl)?);
        let (cv, sv) = (view::<T>(cs, cl)?, view::<T>(ss, sl)?);
        let mut q = output::<T>(dev, rows * heads * head_dim)?;
        let mut k = output::<T>(dev, rows * kv_heads * head_dim)?;
        let mut v = output::<T>(dev, rows * kv_heads * head_dim)?;
        let f = FUSED.function(dev, &format!("split_rope_{}", suffix(qkv.dtype())))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        let rows64 = rows as u64;
        a.arg(&xv).arg(&bv).arg(&has_bias).arg(&cv).arg(&sv);
        a.arg(&mut q).arg(&mut k).arg(&mut v);
        a.arg(&rows64).arg(&hq).arg(&hk).arg(&d);
        let pairs = rows64 * u64::from(hq + 2 * hk) * u64::from(d / 2);
        launch(a, config((blocks(pairs), 1), THREADS))?;
        Ok((
            tensor(q, dev, &Shape::from((rows, heads * head_dim))),
            tensor(k, dev, &Shape::from((rows, kv_heads * head_dim))),
            tensor(v, dev, &Shape::from((rows, kv_heads * head_dim))),
        ))
    })
}

/// `silu(gate) ⊙ up` of the engine's stacked product `gate_up (rows, 2·inter)` (each row a
/// token's gate then up) as `(rows, inter)`.
pub(crate) fn swiglu_rows(gate_up: &Tensor) -> Result<Tensor> {
    let (rows, width) = gate_up.dims2()?;
    let inter = width / 2;
    let (s, l) = gate_up.storage_and_layout();
    let s = cuda_of(&s)?;
    let dev = &s.device;
    by_dtype!(gate_up.dtype(), T => {
        let xv = view::<T>(s, l)?;
        let mut out = output::<T>(dev, rows * inter)?;
        let f = FUSED.function(dev, &format!("swiglu_rows_{}", suffix(gate_up.dtype())))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        let (rows64, inter32) = (rows as u64, u32_of(inter, "intermediate width")?);
        a.arg(&xv).arg(&mut out).arg(&rows64).arg(&inter32);
        launch(a, config((blocks(rows64 * inter as u64), 1), THREADS))?;
        Ok(tensor(out, dev, &Shape::from((rows, inter))))
    })
}

/// Per row of `logits (rows, V)`: `[log p(target), entropy]` of `softmax(logits · inv_t)`, as
/// an f32 `(rows, 2)` tensor (`kernels/scores.cu`).
pub(crate) fn token_scores(logits: &Tensor, targets: &Tensor, inv_t: f64) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    let logits = logits.contiguous()?;
    let guards = [&logits, targets].map(|t| t.storage_and_layout());
    let [(zs, zl), (ts, tl)] = &guards;
    let (zs, ts) = (cuda_of(zs)?, cuda_of(ts)?);
    let dev = &zs.device;
    let (rows32, v32, inv_t) = (
        u32_of(rows, "rows")?,
        u32_of(vocab, "vocabulary")?,
        inv_t as f32,
    );
    let tv = view::<u32>(ts, tl)?;
    by_dtype!(logits.dtype(), T => {
        let zv = view::<T>(zs, zl)?;
        let mut out = output::<f32>(dev, 2 * rows)?;
        let f = SCORES.function(dev, &format!("scores_fwd_{}", suffix(logits.dtype())))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&zv).arg(&tv).arg(&mut out).arg(&v32).arg(&inv_t);
        launch(a, config((rows32, 1), THREADS))?;
        Ok(tensor(out, dev, &Shape::from((rows, 2))))
    })
}

/// The gradient with respect to `logits` (in their dtype) for the output gradient `grad`, f32
/// `(rows, 2)`, of [`token_scores`], the `1/T` of the scaling included.
pub(crate) fn token_score_grads(
    logits: &Tensor,
    targets: &Tensor,
    grad: &Tensor,
    inv_t: f64,
) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    let logits = logits.contiguous()?;
    let guards = [&logits, targets, grad].map(|t| t.storage_and_layout());
    let [(zs, zl), (ts, tl), (gs, gl)] = &guards;
    let (zs, ts, gs) = (cuda_of(zs)?, cuda_of(ts)?, cuda_of(gs)?);
    let dev = &zs.device;
    let (rows32, v32, inv_t) = (
        u32_of(rows, "rows")?,
        u32_of(vocab, "vocabulary")?,
        inv_t as f32,
    );
    let (tv, gv) = (view::<u32>(ts, tl)?, view::<f32>(gs, gl)?);
    by_dtype!(logits.dtype(), T => {
        let zv = view::<T>(zs, zl)?;
        let mut gz = output::<T>(dev, rows * vocab)?;
        let f = SCORES.function(dev, &format!("scores_bwd_{}", suffix(logits.dtype())))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&zv).arg(&tv).arg(&gv).arg(&mut gz).arg(&v32).arg(&inv_t);
        launch(a, config((rows32, 1), THREADS))?;
        Ok(tensor(gz, dev, logits.shape()))
    })
}
