//! The packed-segment attention on a GPU: the kernels on CUDA cores (`kernels/attention.cu`)
//! and on tensor cores (`kernels/attention_tc.cu`), the batch's slot arrays uploaded once, and
//! each call's launch geometry.

use std::sync::OnceLock;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Result, Shape, Tensor, bail};

use super::super::attention::{AttentionHeads, Segments};
use super::{THREADS, blocks, config, cuda_of, launch, output, suffix, tensor, u32_of, view};
use crate::kernels::{ATTENTION, ATTENTION_TC, Module};

/// Whether the attention kernels are compiled for heads of `head_dim` (`HEAD_DIMS` in
/// attention.cu).
pub(crate) fn attention_head_dim(head_dim: usize) -> bool {
    matches!(head_dim, 16 | 32 | 64 | 128)
}

/// Queries (keys) per block of the attention kernels for heads of `d` (`Tile<D>::ROWS`).
fn attention_rows(d: usize) -> u32 {
    if d <= 64 { 64 } else { 32 }
}

/// Threads a query (a key) takes in the forward and dK/dV kernels on CUDA cores, each holding
/// its share of the columns (`Tile<D>::PARTS`): whole rows of 128 spilled out of registers.
fn attention_parts(d: usize) -> u32 {
    if d <= 64 { 1 } else { 2 }
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

/// A batch's slot arrays on one device, uploaded once and shared by every layer.
pub(crate) struct SlotArrays {
    device: CudaDevice,
    seg: CudaSlice<u32>,
    prefix: CudaSlice<u32>,
    first: CudaSlice<u32>,
    /// The tiles of 64 × 64 slots that hold a visible pair ([`Segments::visible_tiles`]).
    tiles: CudaSlice<u32>,
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
                tiles: dev.clone_htod(seg.visible_tiles())?,
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
    /// Threads per block of the dQ kernel.
    threads: u32,
    /// Threads per block of the forward and dK/dV kernels: `threads` times the threads a row
    /// takes.
    split_threads: u32,
    /// The kernels' module and the prefix of their names.
    kernels: (Module, &'static str),
    /// The tensor-core kernels: dK and dV as each query head's share in f32, then their sum.
    tensor_cores: bool,
    /// Dynamic shared memory of the forward, dK/dV and dQ kernels (0: static only).
    shared: [u32; 3],
    runs: i32,
    scale: f32,
}

impl Geometry {
    /// For inputs of `dtype` on `dev`: bf16 heads of 64 and 128 take the tensor-core kernels
    /// (`attention_tc.cu`: 64 rows a block, 4 warps, tiles in dynamic shared memory), the rest
    /// those on CUDA cores (`attention.cu`: a thread a row, two for the forward's and dK/dV's
    /// rows of 128).
    fn new(seg: &Segments, heads: AttentionHeads, dtype: DType, dev: &CudaDevice) -> Result<Self> {
        let (b, l) = seg.shape();
        let d = heads.head_dim;
        if !attention_head_dim(d) {
            bail!("attention on the GPU: no kernel for heads of {d} (16, 32, 64, 128)")
        }
        let tensor_cores = dtype == DType::BF16 && matches!(d, 64 | 128);
        let (rows, (threads, split_threads), kernels, shared) = if tensor_cores {
            (
                64,
                (128, 128),
                (ATTENTION_TC, "attn_tc"),
                tensor_core_shared(dev, d)?,
            )
        } else {
            let rows = attention_rows(d);
            let threads = (rows, rows * attention_parts(d));
            (rows, threads, (ATTENTION, "attn"), [0; 3])
        };
        Ok(Self {
            b: u32_of(b, "attention rows")?,
            l: u32_of(l, "attention length")?,
            h: u32_of(heads.heads, "heads")?,
            kv: u32_of(heads.kv_heads, "kv heads")?,
            d,
            rows,
            threads,
            split_threads,
            kernels,
            tensor_cores,
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
        let threads = match name {
            "fwd" | "bwd_kv" => self.split_threads,
            _ => self.threads,
        };
        let mut cfg = config(blocks, threads);
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
        a.arg(&slots.tiles).arg(&g.runs).arg(&mut o).arg(&mut lse);
        a.arg(&g.l).arg(&g.h).arg(&g.kv).arg(&g.scale);
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
        if g.tensor_cores {
            // A block per query head into f32 shares (N, H·D), then each kv head's group summed.
            let (mut pk, mut pv) = (output::<f32>(dev, qn)?, output::<f32>(dev, qn)?);
            let (f, cfg) = g.kernel(dev, "bwd_kv", q.dtype(), (g.tiles(), g.b * g.h))?;
            let mut a = stream.launch_builder(&f);
            a.arg(&qv).arg(&kv_).arg(&vv).arg(&gv).arg(&lv).arg(&delta);
            a.arg(&slots.seg).arg(&slots.prefix).arg(&slots.first).arg(&slots.tiles);
            a.arg(&g.runs).arg(&mut pk).arg(&mut pv).arg(&g.l).arg(&g.h).arg(&g.kv);
            a.arg(&g.scale);
            launch(a, cfg)?;
            let f = ATTENTION_TC.function(dev, &format!("attn_tc_kv_sum_{sfx}"))?;
            let mut a = stream.launch_builder(&f);
            a.arg(&pk).arg(&pv).arg(&mut dk).arg(&mut dv).arg(&g.h).arg(&g.kv).arg(&d32);
            let n_kv = kn as u64;
            a.arg(&n_kv);
            launch(a, config((blocks(n_kv), 1), THREADS))?;
        } else {
            let (f, cfg) = g.kernel(dev, "bwd_kv", q.dtype(), (g.tiles(), g.b * g.kv))?;
            let mut a = stream.launch_builder(&f);
            a.arg(&qv).arg(&kv_).arg(&vv).arg(&gv).arg(&lv).arg(&delta);
            a.arg(&slots.seg).arg(&slots.prefix).arg(&slots.first).arg(&slots.tiles).arg(&g.runs);
            a.arg(&mut dk).arg(&mut dv).arg(&g.l).arg(&g.h).arg(&g.kv).arg(&g.scale);
            launch(a, cfg)?;
        }

        let mut dq = output::<T>(dev, qn)?;
        let (f, cfg) = g.kernel(dev, "bwd_q", q.dtype(), (g.tiles(), g.b * g.h))?;
        let mut a = stream.launch_builder(&f);
        a.arg(&qv).arg(&kv_).arg(&vv).arg(&gv).arg(&lv).arg(&delta);
        a.arg(&slots.seg).arg(&slots.prefix).arg(&slots.first).arg(&slots.tiles).arg(&g.runs);
        a.arg(&mut dq).arg(&g.l).arg(&g.h).arg(&g.kv).arg(&g.scale);
        launch(a, cfg)?;
        Ok([tensor(dq, dev, q.shape()), tensor(dk, dev, k.shape()), tensor(dv, dev, v.shape())])
    })
}
