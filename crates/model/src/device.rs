//! [`device()`]: a config's `cpu` / `cuda:N` as a candle device, with an error that says why a
//! CUDA device cannot be had (a CPU-only build, no driver, no such device) instead of a panic.
//!
//! With the `cuda` feature, CUDA's libraries (driver, NVRTC, cuBLAS, cuBLASLt, cuRAND) are
//! loaded here, the first time a CUDA device is asked for, with their symbols made global. A
//! binary linked as `docs/gpu.md` describes (`SLUICE_CUDA_LINK_DIR`) records no dependency on
//! them and binds its calls into them lazily: it starts and runs CPU configs on a machine
//! without CUDA, and its first CUDA call finds what was loaded here. In a binary linked against
//! the libraries the usual way they are already loaded and this is a no-op.

use crate::error::{ModelError, Result};

/// The candle device for a config's `device` value. `cuda:N` needs the `cuda` feature, a CUDA
/// driver and a device `N`; otherwise the error says which of them is missing.
pub fn device(device: sluice_core::config::Device) -> Result<candle_core::Device> {
    match device {
        sluice_core::config::Device::Cpu => Ok(candle_core::Device::Cpu),
        sluice_core::config::Device::Cuda(i) => cuda(i),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(ordinal: u32) -> Result<candle_core::Device> {
    Err(ModelError::Device {
        device: format!("cuda:{ordinal}"),
        reason:
            "this sluice was built without CUDA (build with `--features cuda`, see docs/gpu.md)"
                .into(),
    })
}

/// One candle device per ordinal for the whole process: candle tells devices apart by the
/// context it opened, not by ordinal, so two `new_cuda(0)` would be "different devices" and
/// every snapshot passed between the trainer and an engine on the same GPU would be copied.
#[cfg(feature = "cuda")]
fn cuda(ordinal: u32) -> Result<candle_core::Device> {
    use std::sync::Mutex;
    static OPENED: Mutex<Vec<(u32, candle_core::Device)>> = Mutex::new(Vec::new());
    let name = format!("cuda:{ordinal}");
    libraries::load().map_err(|reason| ModelError::Device {
        device: name.clone(),
        reason,
    })?;
    let mut opened = OPENED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, d)) = opened.iter().find(|(o, _)| *o == ordinal) {
        return Ok(d.clone());
    }
    let d = candle_core::Device::new_cuda(ordinal as usize).map_err(|e| ModelError::Device {
        device: name.clone(),
        reason: format!("no usable CUDA device {ordinal} ({e})"),
    })?;
    if let candle_core::Device::Cuda(cuda) = &d {
        // cudarc gives every buffer a read and a write event, created with it and destroyed
        // with it, but records or waits on them only in "multi-stream mode", which a context
        // enters when `CudaContext::new_stream` is called. candle's `new_cuda` issues work on
        // the per-thread default stream and never calls it, nor does Sluice: the events of this
        // process are never used, and each candle op paid for creating and destroying two.
        // SAFETY: with no stream of this context ever made by `new_stream`, cudarc synchronises
        // nothing between streams whether tracking is on or off (its waits and records are
        // gated on multi-stream mode), so turning it off changes no ordering; it only skips
        // the events' creation for buffers allocated from now on (before any, here).
        #[allow(unsafe_code)]
        unsafe {
            cuda.disable_event_tracking();
        }
        // The pool keeps what it has mapped ([`release_freed_memory`]).
        release_threshold(cuda, u64::MAX).map_err(|reason| ModelError::Device {
            device: name,
            reason: format!("keeping freed memory in the device's pool: {reason}"),
        })?;
    }
    opened.push((ordinal, d.clone()));
    Ok(d)
}

/// Waits until the work this thread gave `device` is done; nothing on the CPU.
///
/// candle issues a thread's GPU work on that thread's own default stream, so two threads'
/// kernels are not ordered with each other. A tensor written on one thread and handed to
/// another (the trainer's published weights, an engine's model built where the engine's
/// thread will run it) must be finished first: the receiving thread's kernels would otherwise
/// read it while the writes are still queued. The roles are kept one thread each on a GPU
/// (the trainer's compute pool, the engine replica's thread), so these hand-overs are the only
/// places that need the wait.
pub fn settle(device: &candle_core::Device) -> Result<()> {
    if device.is_cuda() {
        device.synchronize().map_err(|e| ModelError::Device {
            device: format!("{device:?}"),
            reason: format!("waiting for this thread's work on the device: {e}"),
        })?;
    }
    Ok(())
}

/// Makes `device`'s CUDA context current on the calling thread; nothing on the CPU.
///
/// A GPU buffer frees itself when its last tensor goes, on whatever thread that is, and cudarc
/// frees it without making its context current first: on a thread that never did GPU work (a
/// tokio worker dropping the last reference to a weight snapshot) the free fails, the memory is
/// lost, and the failure is parked in the context to surface as the error of the next GPU call
/// anywhere in the process (an engine's weight swap, a trainer step). Owners of GPU tensors
/// that travel between threads call this as they drop.
pub fn bind(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cuda) = device {
        // A failure here leaves the free to fail as before; nothing better can be done in a drop.
        let _ = cuda.cuda_stream().context().bind_to_thread();
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
}

/// Runs `f` with the CUDA profiler API's collection on (`cuProfilerStart`, then
/// `cuProfilerStop` once `f`'s work on the device has finished), so a profiler started with
/// collection off (`ncu --profile-from-start off`) sees only `f`'s kernels. On the CPU, `f`.
pub fn profiled<T>(device: &candle_core::Device, f: impl FnOnce() -> T) -> Result<T> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        use candle_core::cuda_backend::cudarc::driver::{profiler_start, profiler_stop};
        let failed = |what: &str, e: &dyn std::fmt::Display| ModelError::Device {
            device: format!("{device:?}"),
            reason: format!("{what} the profiler's collection: {e}"),
        };
        bind(device);
        settle(device)?;
        profiler_start().map_err(|e| failed("starting", &e))?;
        let out = f();
        settle(device)?;
        profiler_stop().map_err(|e| failed("stopping", &e))?;
        return Ok(out);
    }
    let _ = device;
    Ok(f())
}

/// The most device memory in use at once since the last [`reset_peak_memory`], in bytes: the
/// high watermark of the device's memory pool, which candle allocates from where the device
/// has stream-ordered allocation. `None` on the CPU, or where the driver cannot tell.
pub fn peak_memory(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cuda) = device {
        return pool_watermark(cuda, false);
    }
    let _ = device;
    None
}

/// Starts [`peak_memory`] over from the memory in use now; nothing on the CPU.
pub fn reset_peak_memory(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cuda) = device {
        let _ = pool_watermark(cuda, true);
    }
    let _ = device;
}

/// Lets the device's memory pool give back to the driver, at each synchronisation, the freed
/// memory it holds past its first `bytes` (`false`: keep it all, as Sluice does from the
/// device's opening; `true`: give it all back, CUDA's default). Only for comparisons
/// (`sluice bench trainer --release-freed-memory`); nothing on the CPU.
///
/// candle allocates from the device's stream-ordered pool, and every step synchronises (the
/// trainer's publish, an engine's sampled tokens): with CUDA's default threshold of 0 the pool
/// unmapped every freed buffer there, and the next step mapped the memory again, gigabytes a
/// training step at `[8, 2048]`. PyTorch's caching allocator keeps its memory likewise.
pub fn release_freed_memory(device: &candle_core::Device, release: bool) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cuda) = device {
        let bytes = if release { 0 } else { u64::MAX };
        return release_threshold(cuda, bytes).map_err(|reason| ModelError::Device {
            device: format!("{device:?}"),
            reason: format!("setting the memory pool's release threshold: {reason}"),
        });
    }
    let _ = (device, release);
    Ok(())
}

/// Sets the device pool's `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` to `bytes`; nothing where the
/// device has no stream-ordered allocation (cudarc then allocates outside any pool).
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn release_threshold(
    cuda: &candle_core::CudaDevice,
    bytes: u64,
) -> std::result::Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    // SAFETY: the device is the one of a context that exists (candle's, bound above).
    let pool =
        unsafe { result::device::get_mem_pool(ctx.cu_device()) }.map_err(|e| e.to_string())?;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // The attribute is a `cuuint64_t`.
    let mut value = bytes;
    let at = (&raw mut value).cast::<std::ffi::c_void>();
    // SAFETY: the pool is the device's own; `at` points to a `u64`.
    unsafe { result::mem_pool::set_attribute(pool, attr, at) }.map_err(|e| e.to_string())
}

/// The device pool's `CU_MEMPOOL_ATTR_USED_MEM_HIGH`, reset to what is in use first when
/// `reset`.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn pool_watermark(cuda: &candle_core::CudaDevice, reset: bool) -> Option<u64> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    if !ctx.has_async_alloc() {
        return None;
    }
    ctx.bind_to_thread().ok()?;
    // SAFETY: the device is the one of a context that exists (candle's, bound above).
    let pool = unsafe { result::device::get_mem_pool(ctx.cu_device()) }.ok()?;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
    // The attribute is a `cuuint64_t`; setting it takes zero only.
    let mut value: u64 = 0;
    let at = (&raw mut value).cast::<std::ffi::c_void>();
    if reset {
        // SAFETY: the pool is the device's own; `at` points to a `u64` holding 0.
        unsafe { result::mem_pool::set_attribute(pool, attr, at) }.ok()?;
    }
    // SAFETY: as above; the driver writes one `u64` to `at`.
    unsafe { result::mem_pool::get_attribute(pool, attr, at) }.ok()?;
    Some(value)
}

#[cfg(feature = "cuda")]
mod libraries {
    //! The libraries candle calls into, loaded once per process and never unloaded.

    use std::sync::OnceLock;

    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

    /// CUDA's major version the bindings were built for (`CUDARC_CUDA_VERSION`, e.g. `13000`,
    /// set by `scripts/cuda-toolchain`); the libraries' file names carry it.
    fn cuda_major() -> &'static str {
        match option_env!("CUDARC_CUDA_VERSION") {
            Some(v) if v.len() >= 4 => &v[..v.len() - 3],
            _ => "13",
        }
    }

    /// The driver first: without it nothing else matters, and its absence is the common case
    /// (a machine with no GPU). cuBLASLt before cuBLAS, which depends on it.
    fn names() -> Vec<String> {
        let major = cuda_major();
        vec![
            "libcuda.so.1".into(),
            format!("libnvrtc.so.{major}"),
            format!("libcublasLt.so.{major}"),
            format!("libcublas.so.{major}"),
            "libcurand.so.10".into(),
        ]
    }

    static LOADED: OnceLock<Result<Vec<Library>, String>> = OnceLock::new();

    /// Loads every library once; the same answer afterwards.
    pub(super) fn load() -> Result<(), String> {
        match LOADED.get_or_init(open_all) {
            Ok(_) => Ok(()),
            Err(reason) => Err(reason.clone()),
        }
    }

    fn open_all() -> Result<Vec<Library>, String> {
        let mut loaded = Vec::new();
        for name in names() {
            // SAFETY: these are NVIDIA's libraries, whose initialisers have no preconditions;
            // RTLD_GLOBAL makes their symbols visible to this binary's lazily bound calls.
            #[allow(unsafe_code)]
            let library = unsafe { Library::open(Some(&name), RTLD_NOW | RTLD_GLOBAL) };
            match library {
                Ok(library) => loaded.push(library),
                Err(e) if name == "libcuda.so.1" => {
                    return Err(format!(
                        "no CUDA driver found: cannot load {name} ({e}); this machine has no \
                         NVIDIA driver, or it is not on the library path"
                    ));
                }
                Err(e) => {
                    return Err(format!(
                        "the CUDA driver is here but a CUDA library is not: cannot load {name} \
                         ({e}); put CUDA {}'s libraries on LD_LIBRARY_PATH (docs/gpu.md)",
                        cuda_major()
                    ));
                }
            }
        }
        Ok(loaded)
    }
}
