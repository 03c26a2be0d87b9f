//! Sluice's own CUDA kernels: the CUDA C under `crates/model/kernels`, compiled to PTX by this
//! crate's build script in a `cuda` build, loaded on a candle CUDA device the first time a
//! function of a module is asked for (candle keeps the module per device).

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Error, Result, Storage, Tensor, bail};

/// One PTX module.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    /// The name candle caches the loaded module under.
    name: &'static str,
    ptx: &'static str,
}

impl Module {
    /// `function` of this module on `device`, loading the module there on first use.
    pub fn function(&self, device: &CudaDevice, function: &str) -> Result<CudaFunction> {
        Ok(device
            .get_or_load_custom_func(function, self.name, self.ptx)?
            .into_cuda_function())
    }
}

/// AdamW in place over f32 buffers (`adamw_moment_f32`, `adamw_step_f32`), rounding as the
/// trainer's composition of candle ops does.
pub const ADAMW: Module = Module {
    name: "sluice-adamw",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx")),
};

/// The training forward's fused ops: RMSNorm, SwiGLU, RoPE (`crate::fused`, on a GPU).
pub const FUSED: Module = Module {
    name: "sluice-fused",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/fused.ptx")),
};

/// Attention over packed segments, forward and backward (`crate::fused::attention` on a GPU).
pub const ATTENTION: Module = Module {
    name: "sluice-attention",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/attention.ptx")),
};

/// Attention over packed segments on tensor cores (WMMA), bf16 heads of 64 and 128
/// (`crate::fused::attention` on a GPU).
pub const ATTENTION_TC: Module = Module {
    name: "sluice-attention-tc",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/attention_tc.ptx")),
};

/// The token scores' rows: log p(target) and entropy, and their logits' gradient
/// (`crate::scores` on a GPU).
pub const SCORES: Module = Module {
    name: "sluice-scores",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/scores.ptx")),
};

/// The engine's attention over the paged KV pools (`crate::paged` on a GPU).
pub const PAGED: Module = Module {
    name: "sluice-paged",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/paged.ptx")),
};

/// Token choice over rows of logits (`sample_rows_f32`), for [`sample_rows`].
pub const SAMPLE: Module = Module {
    name: "sluice-sample",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/sample.ptx")),
};

/// Chooses one token per row of `logits` `(rows, vocab)` on their GPU and returns `(token,
/// log-probability)` per row: only these leave the device. Row `i` is greedy when
/// `temperatures[i]` is 0 (reporting the log-probability at temperature 1), else drawn from
/// `softmax(logits / T)` by the inverse CDF at `uniforms[i]` ∈ [0, 1): the engine's CPU sampler
/// without top-k/top-p, on the same uniform draws.
pub fn sample_rows(
    logits: &Tensor,
    temperatures: &[f32],
    uniforms: &[f64],
) -> Result<Vec<(u32, f32)>> {
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if temperatures.len() != rows || uniforms.len() != rows {
        bail!(
            "sample_rows: {rows} rows of logits, {} temperatures, {} uniforms",
            temperatures.len(),
            uniforms.len()
        );
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    let (storage, layout) = logits.storage_and_layout();
    let Storage::Cuda(storage) = &*storage else {
        bail!("sample_rows: the logits are not on a GPU")
    };
    let Some((a, b)) = layout.contiguous_offsets() else {
        bail!("sample_rows: non-contiguous logits")
    };
    let device = &storage.device;
    let stream = device.cuda_stream();
    let z = storage.as_cuda_slice::<f32>()?.slice(a..b);
    let temperatures = stream.clone_htod(temperatures).w()?;
    let uniforms = stream.clone_htod(uniforms).w()?;
    let mut tokens = stream.alloc_zeros::<u32>(rows).w()?;
    let mut logprobs = stream.alloc_zeros::<f32>(rows).w()?;
    let func = SAMPLE.function(device, "sample_rows_f32")?;
    let vocab = u32::try_from(vocab).map_err(|_| Error::Msg("sample_rows: vocab > u32".into()))?;
    let mut launch = stream.launch_builder(&func);
    launch
        .arg(&z)
        .arg(&vocab)
        .arg(&temperatures)
        .arg(&uniforms)
        .arg(&mut tokens)
        .arg(&mut logprobs);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        // THREADS in sample.cu.
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments are the kernel's, in order: `rows · vocab` f32 logits, the vocab,
    // `rows` temperatures and uniforms, and `rows` outputs of each kind.
    #[allow(unsafe_code)]
    unsafe { launch.launch(cfg) }.w()?;
    let tokens = stream.clone_dtoh(&tokens).w()?;
    let logprobs = stream.clone_dtoh(&logprobs).w()?;
    Ok(tokens.into_iter().zip(logprobs).collect())
}
