//! The CUDA paths of the AdamW update, the gradient norm and the published snapshot: launches
//! of `crates/model/kernels/adamw.cu`, per parameter and for every parameter of a step at once.

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Layout, Result, Storage, Tensor, bail};

use super::{Operands, Update};

/// Elements one block of `adamw_many_f32` updates (the emulated test's harness: 65536).
const CHUNK: usize = 1 << 16;

/// Updates, by one launch, every parameter whose operands are contiguous f32 on the first
/// such parameter's GPU; hands back the others with their positions.
pub(super) fn apply_together(
    params: Vec<(usize, Operands<'_>)>,
    u: Update,
) -> Result<Vec<(usize, Operands<'_>)>> {
    let device = params.iter().find_map(|(_, o)| match o.master.device() {
        Device::Cuda(d) => Some(d.clone()),
        _ => None,
    });
    let Some(device) = device else {
        return Ok(params);
    };
    let fits = |o: &Operands<'_>| {
        [o.master.as_tensor(), &*o.m, &*o.v, o.g]
            .into_iter()
            .all(|t| {
                t.dtype() == DType::F32
                    && t.is_contiguous()
                    && matches!(t.device(), Device::Cuda(d) if d.same_device(&device))
                    && t.elem_count() == o.g.elem_count()
            })
    };
    let (together, rest): (Vec<_>, Vec<_>) = params.into_iter().partition(|(_, o)| fits(o));
    if !together.is_empty() {
        launch_many(&device, &together, u)?;
    }
    Ok(rest)
}

fn launch_many(
    device: &candle_core::CudaDevice,
    params: &[(usize, Operands<'_>)],
    u: Update,
) -> Result<()> {
    let stream = device.cuda_stream();
    let guards: Vec<_> = params
        .iter()
        .map(|(_, o)| [o.master.as_tensor(), &*o.m, &*o.v, o.g].map(Tensor::storage_and_layout))
        .collect();
    // Device addresses of each parameter's p, m, v and g, in four runs; the guards that
    // order them on the stream live until the launch is issued.
    let mut addresses = vec![0u64; 4 * params.len()];
    let mut syncs = Vec::with_capacity(4 * params.len());
    let mut sizes = Vec::with_capacity(params.len());
    for (k, four) in guards.iter().enumerate() {
        for (j, (storage, layout)) in four.iter().enumerate() {
            let (ptr, sync) = address(&stream, storage, layout)?;
            addresses[j * params.len() + k] = ptr;
            syncs.push(sync);
        }
        sizes.push(four[0].1.shape().elem_count());
    }
    let Some(chunks) = Chunks::of(device, &sizes)? else {
        return Ok(());
    };
    let table = device.clone_htod(&addresses)?;
    let n = params.len();
    let [p, m, v, g] = [0, 1, 2, 3].map(|j| table.slice(j * n..(j + 1) * n));
    let func = sluice_model::kernels::ADAMW.function(device, "adamw_many_f32")?;
    let (c1, c2) = ((1.0 / u.bc1) as f32, (1.0 / u.bc2) as f32);
    let k = [
        u.clip_scale as f32,
        u.beta1 as f32,
        (1.0 - u.beta1) as f32,
        u.beta2 as f32,
        (1.0 - u.beta2) as f32,
        c1,
        c2,
        u.eps as f32,
        u.lr as f32,
        (1.0 - u.lr * u.weight_decay) as f32,
    ];
    let mut launch = stream.launch_builder(&func);
    launch
        .arg(&p)
        .arg(&m)
        .arg(&v)
        .arg(&g)
        .arg(&chunks.param)
        .arg(&chunks.at)
        .arg(&chunks.len);
    for c in &k {
        launch.arg(c);
    }
    let cfg = chunks.config();
    // SAFETY: the arguments are adamw_many_f32's, in order: four tables of `n` device
    // addresses, each of a live, contiguous f32 buffer of the parameter's size (checked by
    // `apply_together`, held by `guards` for the launch), the chunk tables within those
    // sizes, and ten f32 constants. The kernel writes p, m and v in place, as the in-place
    // ops do, on the stream that orders every use of these tensors.
    #[allow(unsafe_code)]
    unsafe { launch.launch(cfg) }.w()?;
    drop(syncs);
    Ok(())
}

/// `Σ g²` over `grads` by one launch (`sumsq_many_f32`) and one read-back, when all are
/// contiguous f32 on one GPU; `None` otherwise.
pub(super) fn sum_of_squares(grads: &[&Tensor]) -> Result<Option<f64>> {
    let Some(device) = one_gpu_f32(grads) else {
        return Ok(None);
    };
    let stream = device.cuda_stream();
    let guards: Vec<_> = grads.iter().map(|g| g.storage_and_layout()).collect();
    let mut addresses = Vec::with_capacity(grads.len());
    let mut syncs = Vec::with_capacity(grads.len());
    for (storage, layout) in &guards {
        let (ptr, sync) = address(&stream, storage, layout)?;
        addresses.push(ptr);
        syncs.push(sync);
    }
    let sizes: Vec<usize> = grads.iter().map(|g| g.elem_count()).collect();
    let Some(chunks) = Chunks::of(&device, &sizes)? else {
        return Ok(Some(0.0));
    };
    let table = device.clone_htod(&addresses)?;
    let mut partial = device.alloc_zeros::<f32>(chunks.blocks as usize)?;
    let func = sluice_model::kernels::ADAMW.function(&device, "sumsq_many_f32")?;
    let mut launch = stream.launch_builder(&func);
    launch
        .arg(&table)
        .arg(&chunks.param)
        .arg(&chunks.at)
        .arg(&chunks.len)
        .arg(&mut partial);
    // SAFETY: sumsq_many_f32's arguments in order: a table of the gradients' device
    // addresses (live, contiguous f32 buffers held by `guards`), the chunk tables within
    // their sizes, and one f32 output per chunk (block).
    #[allow(unsafe_code)]
    unsafe { launch.launch(chunks.config()) }.w()?;
    drop(syncs);
    let partial = device.clone_dtoh(&partial)?;
    Ok(Some(partial.iter().map(|&s| f64::from(s)).sum()))
}

/// Fresh copies of `params` (contiguous f32 on one GPU) in `dtype` (f32 or bf16) by one launch
/// of `snapshot_many_f32`, made as variables when `variables` (a step's leaf copies); `None`
/// when they do not qualify.
pub(super) fn snapshot(
    params: &[&Tensor],
    dtype: DType,
    variables: bool,
) -> Result<Option<Vec<Tensor>>> {
    let Some(device) = one_gpu_f32(params) else {
        return Ok(None);
    };
    if !matches!(dtype, DType::F32 | DType::BF16) {
        return Ok(None);
    }
    let stream = device.cuda_stream();
    let guards: Vec<_> = params.iter().map(|p| p.storage_and_layout()).collect();
    let mut addresses = Vec::with_capacity(2 * params.len());
    let mut syncs = Vec::with_capacity(2 * params.len());
    for (storage, layout) in &guards {
        let (ptr, sync) = address(&stream, storage, layout)?;
        addresses.push(ptr);
        syncs.push(sync);
    }
    // SAFETY (both arms): `snapshot_many_f32`, launched below before anything reads them,
    // writes every element of every buffer (its chunks cover each parameter's size).
    #[allow(unsafe_code)]
    let fresh: Vec<Storage> = params
        .iter()
        .map(|p| -> Result<Storage> {
            let n = p.elem_count().max(1);
            let storage = if dtype == DType::BF16 {
                CudaStorage::wrap_cuda_slice(
                    unsafe { device.alloc::<half::bf16>(n) }?,
                    device.clone(),
                )
            } else {
                CudaStorage::wrap_cuda_slice(unsafe { device.alloc::<f32>(n) }?, device.clone())
            };
            Ok(Storage::Cuda(storage))
        })
        .collect::<Result<_>>()?;
    // Declared after `fresh`, so dropped before it on every path.
    let mut fresh_syncs = Vec::with_capacity(params.len());
    for (storage, p) in fresh.iter().zip(params) {
        let (ptr, sync) = address(&stream, storage, &Layout::contiguous(p.shape()))?;
        addresses.push(ptr);
        fresh_syncs.push(sync);
    }
    let sizes: Vec<usize> = params.iter().map(|p| p.elem_count()).collect();
    if let Some(chunks) = Chunks::of(&device, &sizes)? {
        let table = device.clone_htod(&addresses)?;
        let n = params.len();
        let (src, dst) = (table.slice(0..n), table.slice(n..2 * n));
        let func = sluice_model::kernels::ADAMW.function(&device, "snapshot_many_f32")?;
        let to_bf16 = i32::from(dtype == DType::BF16);
        let mut launch = stream.launch_builder(&func);
        launch
            .arg(&src)
            .arg(&dst)
            .arg(&chunks.param)
            .arg(&chunks.at)
            .arg(&chunks.len)
            .arg(&to_bf16);
        // SAFETY: snapshot_many_f32's arguments in order: tables of `n` source addresses (live,
        // contiguous f32 buffers held by `guards`) and `n` destination addresses (fresh
        // buffers of the same sizes in `dtype`), the chunk tables within those sizes, and the
        // dtype flag.
        #[allow(unsafe_code)]
        unsafe { launch.launch(chunks.config()) }.w()?;
    }
    drop((fresh_syncs, syncs));
    let tensors = fresh
        .into_iter()
        .zip(params)
        .map(|(storage, p)| {
            Tensor::from_storage(storage, p.shape().clone(), BackpropOp::none(), variables)
        })
        .collect();
    Ok(Some(tensors))
}

/// One parameter's gradients of a micro-batch (one, or two for a tied embedding) for
/// [`accumulate`], with its index.
pub(super) type Gradients = (usize, Vec<Tensor>);

/// Adds one micro-batch's gradients to the step's f32 sums `sums` by one launch of
/// `accumulate_many_f32`, for every parameter whose gradients (one or two, f32 or bf16) and sum
/// (contiguous f32, or none yet) are contiguous on one GPU; hands back the others. A first sum
/// is a fresh buffer, never the gradient itself: later micro-batches add to the sums in place,
/// and the caller may still hold its gradients.
pub(super) fn accumulate(
    sums: &mut [Option<Tensor>],
    grads: Vec<Gradients>,
) -> Result<Vec<Gradients>> {
    let device = grads
        .iter()
        .flat_map(|(_, g)| g)
        .find_map(|g| match g.device() {
            Device::Cuda(d) => Some(d.clone()),
            _ => None,
        });
    let Some(device) = device else {
        return Ok(grads);
    };
    let on = |t: &Tensor| {
        t.is_contiguous() && matches!(t.device(), Device::Cuda(d) if d.same_device(&device))
    };
    let fits = |(i, gs): &Gradients| {
        let n = gs.first().map_or(0, Tensor::elem_count);
        (1..=2).contains(&gs.len())
            && gs.iter().all(|g| {
                on(g) && matches!(g.dtype(), DType::F32 | DType::BF16) && g.elem_count() == n
            })
            && sums.get(*i).is_some_and(|s| {
                s.as_ref()
                    .is_none_or(|s| on(s) && s.dtype() == DType::F32 && s.elem_count() == n)
            })
    };
    let (launched, rest): (Vec<_>, Vec<_>) = grads.into_iter().partition(fits);
    if !launched.is_empty() {
        launch_accumulate(&device, sums, &launched)?;
    }
    Ok(rest)
}

/// `accumulate_many_f32`'s flags (crates/model/kernels/adamw.cu).
const ACC_FRESH: u32 = 1;
const ACC_G_BF16: u32 = 2;
const ACC_H: u32 = 4;
const ACC_H_BF16: u32 = 8;

fn launch_accumulate(
    device: &candle_core::CudaDevice,
    sums: &mut [Option<Tensor>],
    grads: &[Gradients],
) -> Result<()> {
    let mut flags = Vec::with_capacity(grads.len());
    for (i, gs) in grads {
        let mut f = 0;
        if sums[*i].is_none() {
            let n = gs[0].elem_count().max(1);
            // SAFETY: `accumulate_many_f32`, launched below before anything reads it, writes
            // every element of a fresh sum (its chunks cover the parameter's size).
            #[allow(unsafe_code)]
            let fresh = unsafe { device.alloc::<f32>(n) }?;
            let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(fresh, device.clone()));
            let shape = gs[0].shape().clone();
            sums[*i] = Some(Tensor::from_storage(
                storage,
                shape,
                BackpropOp::none(),
                false,
            ));
            f |= ACC_FRESH;
        }
        if gs[0].dtype() == DType::BF16 {
            f |= ACC_G_BF16;
        }
        if let Some(h) = gs.get(1) {
            f |= ACC_H;
            if h.dtype() == DType::BF16 {
                f |= ACC_H_BF16;
            }
        }
        flags.push(f);
    }
    let stream = device.cuda_stream();
    let sum_guards: Vec<_> = grads
        .iter()
        .map(|(i, _)| sums[*i].as_ref().map(Tensor::storage_and_layout))
        .collect();
    let grad_guards: Vec<Vec<_>> = grads
        .iter()
        .map(|(_, gs)| gs.iter().map(Tensor::storage_and_layout).collect())
        .collect();
    let n = grads.len();
    // Device addresses of each parameter's sum, g and h (0: none), in three runs.
    let mut addresses = vec![0u64; 3 * n];
    let mut syncs = Vec::with_capacity(3 * n);
    for (k, (sum, gs)) in sum_guards.iter().zip(&grad_guards).enumerate() {
        let Some((storage, layout)) = sum else {
            bail!("accumulate: a sum went missing")
        };
        let (ptr, sync) = address(&stream, storage, layout)?;
        addresses[k] = ptr;
        syncs.push(sync);
        for (j, (storage, layout)) in gs.iter().enumerate() {
            let (ptr, sync) = address(&stream, storage, layout)?;
            addresses[(j + 1) * n + k] = ptr;
            syncs.push(sync);
        }
    }
    let sizes: Vec<usize> = grads.iter().map(|(_, gs)| gs[0].elem_count()).collect();
    let Some(chunks) = Chunks::of(device, &sizes)? else {
        return Ok(());
    };
    let table = device.clone_htod(&addresses)?;
    let flags = device.clone_htod(&flags)?;
    let [sum, g, h] = [0, 1, 2].map(|j| table.slice(j * n..(j + 1) * n));
    let func = sluice_model::kernels::ADAMW.function(device, "accumulate_many_f32")?;
    let mut launch = stream.launch_builder(&func);
    launch
        .arg(&sum)
        .arg(&g)
        .arg(&h)
        .arg(&flags)
        .arg(&chunks.param)
        .arg(&chunks.at)
        .arg(&chunks.len);
    // SAFETY: accumulate_many_f32's arguments in order: three tables of `n` device addresses
    // (the sums: live, contiguous f32 buffers of the parameter's size, each parameter once;
    // g and h: live, contiguous buffers of that size in the dtype `flags` names, h 0 where
    // the flags say there is none), all held by the guards for the launch; the flags; and the
    // chunk tables within those sizes. The kernel writes the sums only.
    #[allow(unsafe_code)]
    unsafe { launch.launch(chunks.config()) }.w()?;
    drop(syncs);
    Ok(())
}

/// The GPU every one of `tensors` lies on as contiguous f32, if one does.
fn one_gpu_f32(tensors: &[&Tensor]) -> Option<candle_core::CudaDevice> {
    let Some(Device::Cuda(device)) = tensors.first().map(|t| t.device().clone()) else {
        return None;
    };
    let fits = |t: &&Tensor| {
        t.dtype() == DType::F32
            && t.is_contiguous()
            && matches!(t.device(), Device::Cuda(d) if d.same_device(&device))
    };
    tensors.iter().all(fits).then_some(device)
}

/// The device address of a contiguous f32 or bf16 storage's first element, and the guard
/// that orders its use on `stream`.
fn address<'a>(
    stream: &'a std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    storage: &'a Storage,
    layout: &Layout,
) -> Result<(
    u64,
    candle_core::cuda_backend::cudarc::driver::SyncOnDrop<'a>,
)> {
    let Storage::Cuda(s) = storage else {
        bail!("adamw: an operand left the GPU")
    };
    let (start, _) = range(layout)?;
    let (ptr, sync, size) = match storage.dtype() {
        DType::BF16 => {
            let (ptr, sync) = s.as_cuda_slice::<half::bf16>()?.device_ptr(stream);
            (ptr, sync, std::mem::size_of::<half::bf16>())
        }
        _ => {
            let (ptr, sync) = s.as_cuda_slice::<f32>()?.device_ptr(stream);
            (ptr, sync, std::mem::size_of::<f32>())
        }
    };
    Ok((ptr + (start * size) as u64, sync))
}

/// The many-buffer kernels' chunk tables on the device: block `b` takes `len[b]` elements
/// from element `at[b]` of buffer `param[b]`.
struct Chunks {
    param: candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
    at: candle_core::cuda_backend::cudarc::driver::CudaSlice<u64>,
    len: candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
    blocks: u32,
}

impl Chunks {
    /// For buffers of `sizes` elements; `None` when they hold none.
    fn of(device: &candle_core::CudaDevice, sizes: &[usize]) -> Result<Option<Self>> {
        let (mut param, mut at, mut len) = (Vec::new(), Vec::new(), Vec::new());
        for (k, &n) in sizes.iter().enumerate() {
            for start in (0..n).step_by(CHUNK) {
                param.push(k as u32);
                at.push(start as u64);
                len.push(CHUNK.min(n - start) as u32);
            }
        }
        if param.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self {
            blocks: param.len() as u32,
            param: device.clone_htod(&param)?,
            at: device.clone_htod(&at)?,
            len: device.clone_htod(&len)?,
        }))
    }

    fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The element range of a contiguous layout.
pub(super) fn range(l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("adamw: non-contiguous operand"),
    }
}

/// Launches a grid-stride kernel over `n` elements: enough blocks to fill the GPU, each
/// thread looping over the rest.
pub(super) fn launch(mut launch: LaunchArgs<'_>, n: u64) -> Result<()> {
    const THREADS: u64 = 256;
    let blocks = n.div_ceil(THREADS).clamp(1, 65_535) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature in adamw.cu (pointers to `n`
    // f32s each, then scalars of the declared types), and every range was checked above.
    #[allow(unsafe_code)]
    unsafe { launch.launch(cfg) }.w()?;
    Ok(())
}
