//! The fused training ops on a CUDA device (`cuda` builds): launches of Sluice's kernels
//! `kernels/fused.cu` (RMSNorm, SwiGLU, RoPE), `kernels/attention.cu` (attention over packed
//! segments) and `kernels/scores.cu` (the token scores' rows) for f32 and bf16 tensors, forward
//! and backward. The mathematics is the CPU ops';
//! `crates/model/tests/cuda_emu` runs the same kernels, launched as here, on the CPU.

use std::sync::OnceLock;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Layout, Result, Shape, Storage, Tensor, bail};

use super::attention::{AttentionHeads, Segments};
use crate::kernels::{ATTENTION, ATTENTION_TC, FUSED, Module, PAGED, SCORES};

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

/// Whether the attention kernels are compiled for heads of `head_dim` (`HEAD_DIMS` in
/// attention.cu).
pub(crate) fn attention_head_dim(head_dim: usize) -> bool {
    matches!(head_dim, 16 | 32 | 64 | 128)
}

/// Queries (keys) per block of the attention kernels for heads of `d` (`Tile<D>::ROWS`).
fn attention_rows(d: usize) -> u32 {
    if d <= 64 { 64 } else { 32 }
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

/// The tensor-core attention kernels' dynamic shared memory in bytes, `[fwd, bwd_kv, bwd_q]`
/// for heads of `d` (64 or 128), as `attn_tc_shared_bytes` reports it (read once).
fn tensor_core_shared(dev: &CudaDevice, d: usize) -> Result<[u32; 3]> {
    static BYTES: OnceLock<[u32; 6]> = OnceLock::new();
    let bytes = match BYTES.get() {
        Some(b) => *b,
        None => {
            let f = ATTENTION_TC.function(dev, "attn_tc_shared_bytes")?;
            let mut out = dev.alloc_zeros::<u32>(6)?;
            let stream = dev.cuda_stream();
            let mut a = stream.launch_builder(&f);
            a.arg(&mut out);
            launch(a, config((1, 1), 1))?;
            let v = dev.clone_dtoh(&out)?;
            let b = [v[0], v[1], v[2], v[3], v[4], v[5]];
            *BYTES.get_or_init(|| b)
        }
    };
    Ok(if d == 128 {
        [bytes[3], bytes[4], bytes[5]]
    } else {
        [bytes[0], bytes[1], bytes[2]]
    })
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

/// A batch's slot arrays on one device, uploaded once and shared by every layer.
pub(crate) struct SlotArrays {
    device: CudaDevice,
    seg: CudaSlice<u32>,
    prefix: CudaSlice<u32>,
    first: CudaSlice<u32>,
}

/// [`Segments`]' cache of its [`SlotArrays`]: empty when cloned.
#[derive(Default)]
pub(crate) struct DeviceSlots(OnceLock<SlotArrays>);

impl Clone for DeviceSlots {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for DeviceSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "DeviceSlots(on a GPU)"
        } else {
            "DeviceSlots"
        })
    }
}

impl DeviceSlots {
    /// The arrays on `dev`: the cached ones, else uploaded (and cached for the first device).
    fn on<'a>(
        &'a self,
        seg: &Segments,
        dev: &CudaDevice,
        fresh: &'a mut Option<SlotArrays>,
    ) -> Result<&'a SlotArrays> {
        let upload = || -> Result<SlotArrays> {
            Ok(SlotArrays {
                device: dev.clone(),
                seg: dev.clone_htod(seg.ids())?,
                prefix: dev.clone_htod(seg.prefixes())?,
                first: dev.clone_htod(seg.first())?,
            })
        };
        if self.0.get().is_none() {
            let _ = self.0.set(upload()?);
        }
        match self.0.get() {
            Some(a) if a.device.same_device(dev) => Ok(a),
            _ => Ok(fresh.insert(upload()?)),
        }
    }
}

/// The launch geometry of one attention call.
struct Geometry {
    b: u32,
    l: u32,
    h: u32,
    kv: u32,
    d: usize,
    /// Queries (keys) per block.
    rows: u32,
    /// Threads per block.
    threads: u32,
    /// The kernels' module and the prefix of their names.
    kernels: (Module, &'static str),
    /// Dynamic shared memory of the forward, dK/dV and dQ kernels (0: static only).
    shared: [u32; 3],
    runs: i32,
    scale: f32,
}

impl Geometry {
    /// For inputs of `dtype` on `dev`: bf16 heads of 64 and 128 take the tensor-core kernels
    /// (`attention_tc.cu`: 64 rows a block, 4 warps, tiles in dynamic shared memory), the rest
    /// those on CUDA cores (`attention.cu`: a thread a row).
    fn new(seg: &Segments, heads: AttentionHeads, dtype: DType, dev: &CudaDevice) -> Result<Self> {
        let (b, l) = seg.shape();
        let d = heads.head_dim;
        if !attention_head_dim(d) {
            bail!("attention on the GPU: no kernel for heads of {d} (16, 32, 64, 128)")
        }
        let tensor_cores = dtype == DType::BF16 && matches!(d, 64 | 128);
        let (rows, threads, kernels, shared) = if tensor_cores {
            (
                64,
                128,
                (ATTENTION_TC, "attn_tc"),
                tensor_core_shared(dev, d)?,
            )
        } else {
            let rows = attention_rows(d);
            (rows, rows, (ATTENTION, "attn"), [0; 3])
        };
        Ok(Self {
            b: u32_of(b, "attention rows")?,
            l: u32_of(l, "attention length")?,
            h: u32_of(heads.heads, "heads")?,
            kv: u32_of(heads.kv_heads, "kv heads")?,
            d,
            rows,
            threads,
            kernels,
            shared,
            runs: i32::from(seg.runs()),
            scale: 1.0 / (d as f32).sqrt(),
        })
    }

    fn tiles(&self) -> u32 {
        self.l.div_ceil(self.rows)
    }

    fn slots(&self) -> usize {
        self.b as usize * self.l as usize
    }

    /// The kernel `name` (`fwd`, `bwd_kv`, `bwd_q`) for inputs of `dtype`, allowed the dynamic
    /// shared memory it takes, and its launch over `blocks` (grid dims).
    fn kernel(
        &self,
        dev: &CudaDevice,
        name: &str,
        dtype: DType,
        blocks: (u32, u32),
    ) -> Result<(CudaFunction, LaunchConfig)> {
        let (module, prefix) = self.kernels;
        let f = module.function(
            dev,
            &format!("{prefix}_{name}_{}_{}", suffix(dtype), self.d),
        )?;
        let shared = match name {
            "fwd" => self.shared[0],
            "bwd_kv" => self.shared[1],
            _ => self.shared[2],
        };
        if shared > 0 {
            use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as Attr;
            let max = Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(max, shared as i32).w()?;
        }
        let mut cfg = config(blocks, self.threads);
        cfg.shared_mem_bytes = shared;
        Ok((f, cfg))
    }
}

/// Attention forward: `(O, lse)` with `lse` `(B, H, L)` f32 for the backward.
pub(crate) fn attention(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    seg: &Segments,
    heads: AttentionHeads,
) -> Result<(CudaStorage, Tensor)> {
    let dev = &q.0.device;
    let g = Geometry::new(seg, heads, q.0.dtype(), dev)?;
    let mut fresh = None;
    let slots = seg.device_slots().on(seg, dev, &mut fresh)?;
    let n = g.slots();
    by_dtype!(q.0.dtype(), T => {
        let (qv, kv_, vv) = (view::<T>(q.0, q.1)?, view::<T>(k.0, k.1)?, view::<T>(v.0, v.1)?);
        let mut o = output::<T>(dev, n * heads.heads * g.d)?;
        let mut lse = output::<f32>(dev, n * heads.heads)?;
        let (f, cfg) = g.kernel(dev, "fwd", q.0.dtype(), (g.tiles(), g.b * g.h))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&qv).arg(&kv_).arg(&vv).arg(&slots.seg).arg(&slots.prefix).arg(&slots.first);
        a.arg(&g.runs).arg(&mut o).arg(&mut lse).arg(&g.l).arg(&g.h).arg(&g.kv).arg(&g.scale);
        launch(a, cfg)?;
        let lse = tensor(lse, dev, &Shape::from((g.b as usize, heads.heads, g.l as usize)));
        Ok((CudaStorage::wrap_cuda_slice(o, dev.clone()), lse))
    })
}

/// Attention backward: `[dQ, dK, dV]` from the inputs, the forward's output and log-sum-exps,
/// and the output gradient.
pub(crate) fn attention_bwd(
    [q, k, v]: [&Tensor; 3],
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    seg: &Segments,
    heads: AttentionHeads,
) -> Result<[Tensor; 3]> {
    let guards = [q, k, v, out, lse, dout].map(|t| t.storage_and_layout());
    let c = |i: usize| cuda_of(&guards[i].0).map(|s| (s, guards[i].1));
    let ((qs, ql), (ks, kl), (vs, vl), (os, ol), (ls, ll), (gs, gl)) =
        (c(0)?, c(1)?, c(2)?, c(3)?, c(4)?, c(5)?);
    let dev = &qs.device;
    let g = Geometry::new(seg, heads, q.dtype(), dev)?;
    let mut fresh = None;
    let slots = seg.device_slots().on(seg, dev, &mut fresh)?;
    let n = g.slots();
    let (qn, kn) = (n * heads.heads * g.d, n * heads.kv_heads * g.d);
    let sfx = suffix(q.dtype());
    let stream = dev.cuda_stream();
    by_dtype!(q.dtype(), T => {
        let (qv, kv_, vv) = (view::<T>(qs, ql)?, view::<T>(ks, kl)?, view::<T>(vs, vl)?);
        let (ov, gv, lv) = (view::<T>(os, ol)?, view::<T>(gs, gl)?, view::<f32>(ls, ll)?);
        let mut delta = output::<f32>(dev, n * heads.heads)?;
        let f = ATTENTION.function(dev, &format!("attn_delta_{sfx}"))?;
        let mut a = stream.launch_builder(&f);
        let (d32, rows64) = (g.d as u32, (n * heads.heads) as u64);
        a.arg(&ov).arg(&gv).arg(&mut delta).arg(&g.l).arg(&g.h).arg(&d32).arg(&rows64);
        launch(a, config((blocks(rows64 * 32), 1), THREADS))?;

        let (mut dk, mut dv) = (output::<T>(dev, kn)?, output::<T>(dev, kn)?);
        let (f, cfg) = g.kernel(dev, "bwd_kv", q.dtype(), (g.tiles(), g.b * g.kv))?;
        let mut a = stream.launch_builder(&f);
        a.arg(&qv).arg(&kv_).arg(&vv).arg(&gv).arg(&lv).arg(&delta);
        a.arg(&slots.seg).arg(&slots.prefix).arg(&slots.first).arg(&g.runs);
        a.arg(&mut dk).arg(&mut dv).arg(&g.l).arg(&g.h).arg(&g.kv).arg(&g.scale);
        launch(a, cfg)?;

        let mut dq = output::<T>(dev, qn)?;
        let (f, cfg) = g.kernel(dev, "bwd_q", q.dtype(), (g.tiles(), g.b * g.h))?;
        let mut a = stream.launch_builder(&f);
        a.arg(&qv).arg(&kv_).arg(&vv).arg(&gv).arg(&lv).arg(&delta);
        a.arg(&slots.seg).arg(&slots.prefix).arg(&slots.first).arg(&g.runs);
        a.arg(&mut dq).arg(&g.l).arg(&g.h).arg(&g.kv).arg(&g.scale);
        launch(a, cfg)?;
        Ok([tensor(dq, dev, q.shape()), tensor(dk, dev, k.shape()), tensor(dv, dev, v.shape())])
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

/// The engine's attention over the paged pools (`kernels/paged.cu`): `q (rows, heads, d)`, the
/// layer's `keys`/`values` pools `(blocks · kv_heads · block_tokens, d)` and the step's `meta`
/// (`PagedKvCache::attention_meta`) → `(rows, heads · d)` in the pools' dtype.
pub(crate) fn paged_attention(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    meta: &Tensor,
    (kv_heads, block_tokens): (usize, usize),
    scale: f64,
) -> Result<Tensor> {
    let (rows, heads, d) = q.dims3()?;
    let q = q.to_dtype(keys.dtype())?.contiguous()?;
    let guards = [&q, keys, values, meta].map(|t| t.storage_and_layout());
    let [(qs, ql), (ks, kl), (vs, vl), (ms, ml)] = &guards;
    let (qs, ks, vs, ms) = (cuda_of(qs)?, cuda_of(ks)?, cuda_of(vs)?, cuda_of(ms)?);
    let dev = &qs.device;
    let r32 = u32_of(rows, "rows")?;
    let dims = [heads, kv_heads, d, block_tokens].map(|x| x as u32);
    let scale = scale as f32;
    by_dtype!(keys.dtype(), T => {
        let (qv, kv_, vv) = (view::<T>(qs, ql)?, view::<T>(ks, kl)?, view::<T>(vs, vl)?);
        let mv = view::<u32>(ms, ml)?;
        let mut out = output::<T>(dev, rows * heads * d)?;
        let f = PAGED.function(dev, &format!("paged_attention_{}", suffix(keys.dtype())))?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&qv).arg(&kv_).arg(&vv).arg(&mv).arg(&mut out).arg(&r32);
        a.arg(&dims[0]).arg(&dims[1]).arg(&dims[2]).arg(&dims[3]).arg(&scale);
        launch(a, config((r32, dims[0]), 32))?;
        Ok(tensor(out, dev, &Shape::from((rows, heads * d))))
    })
}
