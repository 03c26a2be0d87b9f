//! The engine's paged KV pool on a GPU (`kernels/paged.cu`): attention over a layer's pool that
//! stores the step's new keys and values in the same launch (and splits and rotates the stacked
//! q/k/v rows as it reads them), and the plain write of new rows (for the batches that gather
//! their keys instead).

use std::cell::Cell;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Result, Shape, Tensor, bail};

use super::{THREADS, blocks, config, cuda_of, launch, output, suffix, tensor, u32_of, view};
use crate::cache::NewHeads;
use crate::kernels::PAGED;

/// The engine's attention over a layer's paged `pool` (keys in its first half of rows, values
/// in the second, rows of `d`) for the step's `heads`, storing their new keys and values into
/// the pool in the same launch, at the rows the step's `meta` (`PagedKvCache::attention_meta`)
/// gives; stacked q/k/v rows are split and rotated as the launch reads them. Each row's keys are
/// scored in `parts` stretches at once ([`crate::paged::PagedKvCache::key_parts`]; one: in
/// one pass). Returns `(rows, heads · d)` in the pool's dtype.
pub(crate) fn paged_attention(
    heads: NewHeads<'_>,
    pool: &Tensor,
    meta: &Tensor,
    (kv_heads, block_tokens): (usize, usize),
    scale: f64,
    parts: u32,
) -> Result<Tensor> {
    let dtype = pool.dtype();
    let fresh = |t: &Tensor| t.to_dtype(dtype)?.contiguous();
    let (source, rows, geometry) = match heads {
        NewHeads::Split { q, k, v } => {
            let (rows, heads, d) = q.dims3()?;
            if k.dims3()? != (rows, kv_heads, d) || v.shape() != k.shape() {
                bail!(
                    "paged attention: keys {:?} and values {:?} for queries {:?} over {kv_heads} kv heads",
                    k.shape(),
                    v.shape(),
                    q.shape()
                )
            }
            let source = Source {
                kernel: "paged_attention",
                tensors: vec![fresh(q)?, fresh(k)?, fresh(v)?],
                has_bias: None,
            };
            (source, rows, (heads, d))
        }
        NewHeads::Stacked {
            qkv,
            bias,
            cos,
            sin,
            geometry: (heads, kvh, d),
        } => {
            let (rows, width) = qkv.dims2()?;
            let bias_given = bias.is_some();
            let tables = (rows, d / 2);
            if kvh != kv_heads
                || width != (heads + 2 * kv_heads) * d
                || cos.dims2()? != tables
                || sin.dims2()? != tables
                || bias.is_some_and(|b| b.elem_count() != width)
            {
                bail!(
                    "paged attention: stacked rows {:?} (bias {:?}, angles {:?}) for {heads} + 2 × {kvh} heads of {d} over {kv_heads} kv heads",
                    qkv.shape(),
                    bias.map(Tensor::shape),
                    cos.shape()
                )
            }
            let qkv = fresh(qkv)?;
            // Without a bias the kernel is handed the rows in its place and told not to read it.
            let bias = match bias {
                Some(b) => fresh(b)?,
                None => qkv.clone(),
            };
            let source = Source {
                kernel: "paged_attention_qkv",
                tensors: vec![qkv, bias, fresh(cos)?, fresh(sin)?],
                has_bias: Some(u32::from(bias_given)),
            };
            (source, rows, (heads, d))
        }
    };
    let (heads, d) = geometry;
    if pool.dim(1)? != d {
        bail!(
            "paged attention: a pool {:?} for heads of {d}",
            pool.shape()
        )
    }
    let op = AttendStoring {
        source,
        rows,
        meta,
        geometry: (heads, kv_heads, d, block_tokens),
        scale: scale as f32,
        parts: parts.max(1),
        out: Cell::new(None),
    };
    pool.inplace_op1(&op)?;
    match op.out.take() {
        Some(out) => Ok(out),
        None => bail!("paged attention: the kernel was not launched"),
    }
}

/// The step's heads as the launch reads them: its kernel, and its tensor arguments in order, in
/// the pool's dtype and contiguous (q, k, v for `paged_attention_*`; the stacked rows, the bias,
/// cos and sin for `paged_attention_qkv_*`, whose flag `has_bias` follows the bias).
struct Source {
    kernel: &'static str,
    tensors: Vec<Tensor>,
    has_bias: Option<u32>,
}

/// One launch of `paged_attention_*` or `paged_attention_qkv_*`, in place on the pool (the
/// op's destination); the heads and the row tables are read, the output is left in `out`.
struct AttendStoring<'a> {
    source: Source,
    rows: usize,
    meta: &'a Tensor,
    /// Query heads, kv heads, head dim, tokens per block.
    geometry: (usize, usize, usize, usize),
    scale: f32,
    /// Stretches each row's keys are scored in ([`crate::paged::PagedKvCache::key_parts`]).
    parts: u32,
    out: Cell<Option<Tensor>>,
}

impl InplaceOp1 for AttendStoring<'_> {
    fn name(&self) -> &'static str {
        "paged-attention-storing"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("paged attention on the GPU: the pool is on the CPU")
    }

    fn cuda_fwd(&self, pool: &mut CudaStorage, pl: &Layout) -> Result<()> {
        let (heads, kv_heads, d, block_tokens) = self.geometry;
        let Some((p0, p1)) = pl.contiguous_offsets() else {
            bail!("paged attention: the pool is not contiguous")
        };
        let half = pl.shape().dims2()?.0 as u64 / 2;
        let rows = self.rows;
        let r32 = u32_of(rows, "rows")?;
        let dims = [heads, kv_heads, d, block_tokens].map(|x| x as u32);
        let Source {
            kernel,
            tensors,
            has_bias,
        } = &self.source;
        let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
        let meta = self.meta.storage_and_layout();
        let dev = pool.device.clone();
        let dtype = pool.dtype();
        by_dtype!(dtype, T => {
            let views = (guards.iter())
                .map(|(s, l)| view::<T>(cuda_of(s)?, l))
                .collect::<Result<Vec<_>>>()?;
            let mv = view::<u32>(cuda_of(&meta.0)?, meta.1)?;
            let mut out = output::<T>(&dev, rows * heads * d)?;
            // Each part's maximum, sum and values, when the keys are split.
            let parts = self.parts;
            let records = if parts > 1 { rows * heads * parts as usize * (d + 2) } else { 0 };
            let mut part = output::<f32>(&dev, records)?;
            let stream = dev.cuda_stream();
            let mut pv = pool.as_cuda_slice_mut::<T>()?.slice_mut(p0..p1);
            let f = PAGED.function(&dev, &format!("{kernel}_{}", suffix(dtype)))?;
            let mut a = stream.launch_builder(&f);
            // q, k, v; or the rows, the bias, whether to read it, cos, sin.
            a.arg(&views[0]).arg(&views[1]);
            if let Some(flag) = has_bias {
                a.arg(flag);
            }
            for v in &views[2..] {
                a.arg(v);
            }
            a.arg(&mut pv).arg(&mv).arg(&mut out).arg(&mut part).arg(&r32);
            a.arg(&dims[0]).arg(&dims[1]).arg(&dims[2]).arg(&dims[3]).arg(&half);
            a.arg(&self.scale);
            let mut cfg = config((r32, dims[0]), 32);
            cfg.grid_dim.2 = parts;
            launch(a, cfg)?;
            if parts > 1 {
                let f = PAGED.function(&dev, &format!("paged_combine_{}", suffix(dtype)))?;
                let mut a = stream.launch_builder(&f);
                a.arg(&part).arg(&mut out).arg(&dims[0]).arg(&dims[2]).arg(&parts);
                launch(a, config((r32, dims[0]), 32))?;
            }
            let shape = Shape::from((rows, heads * d));
            self.out.set(Some(tensor(out, &dev, &shape)));
            Ok(())
        })
    }
}

/// A step's new keys and values written into a layer's pool in one launch (`kernels/paged.cu`,
/// `kv_rows`): `pool (2 · half, width)` holds the keys in its first `half` rows and the values
/// in the rest; row `i` of `k` and of `v` `(n, width)` goes to row `rows[i]` (u32, on the pool's
/// device) of each half. Any of the pools' element types: the kernel copies words of their size.
pub(crate) fn kv_rows(
    (pool, pl): (&mut CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    rows: &Tensor,
) -> Result<()> {
    let (pool_rows, width) = pl.shape().dims2()?;
    let (n, w) = kl.shape().dims2()?;
    let dtype = pool.dtype();
    if vl.shape() != kl.shape() || w != width || rows.elem_count() != n {
        bail!(
            "kv rows: keys {:?} and values {:?} at {} rows of a pool {:?}",
            kl.shape(),
            vl.shape(),
            rows.elem_count(),
            pl.shape()
        )
    }
    if k.dtype() != dtype || v.dtype() != dtype {
        bail!("kv rows: {:?} values into a {dtype:?} pool", k.dtype())
    }
    let Some((p0, p1)) = pl.contiguous_offsets() else {
        bail!("kv rows: the pool is not contiguous")
    };
    let (n32, w32) = (u32_of(n, "kv rows")?, u32_of(width, "kv width")?);
    let half_rows = pool_rows as u64 / 2;
    let (rs, rl) = rows.storage_and_layout();
    let rv = view::<u32>(cuda_of(&rs)?, rl)?;
    let dev = pool.device.clone();
    let f = PAGED.function(&dev, &format!("kv_rows_b{}", dtype.size_in_bytes()))?;
    let stream = dev.cuda_stream();
    macro_rules! words {
        ($t:ty) => {{
            let (kv_, vv) = (view::<$t>(k, kl)?, view::<$t>(v, vl)?);
            let mut pv = pool.as_cuda_slice_mut::<$t>()?.slice_mut(p0..p1);
            let mut a = stream.launch_builder(&f);
            a.arg(&kv_).arg(&vv).arg(&rv).arg(&mut pv);
            a.arg(&n32).arg(&w32).arg(&half_rows);
            launch(a, config((blocks(n as u64 * width as u64), 1), THREADS))
        }};
    }
    match dtype {
        DType::F32 => words!(f32),
        DType::BF16 => words!(half::bf16),
        DType::F16 => words!(half::f16),
        DType::F64 => words!(f64),
        other => bail!("kv rows: no kernel for {other:?} pools"),
    }
}
