//! `sluice bench kernels`: Sluice's own kernels against what they replace, on one device, each
//! checked and timed in the same run.
//!
//! - AdamW in place (`adamw.cu` on a GPU, the in-place CPU kernel on the CPU) against the
//!   composition of candle ops on the same device, and against the CPU kernel: every element
//!   rounds the same way, so the weights and moments must agree to the bit.
//! - On a GPU, AdamW for every parameter of a step in one launch against a launch per parameter
//!   (290 parameters of uneven sizes): the bits must agree.
//! - On a GPU, the engine's token choice on the device (`sample.cu`) against the CPU sampler on
//!   the same logits and uniform draws, the CPU's time including the copy of the logits to the
//!   host: tokens agreeing and the largest log-prob difference.
//! - On a GPU, the training forward's fused ops (RMSNorm, SwiGLU, RoPE, attention over packed
//!   segments: Sluice's CUDA kernels) against candle's composition on the same device, forward
//!   and backward, f32 and bf16 (`kernels/training.rs`).
//! - The engine's split of stacked products and its residual add fused with the norm against
//!   candle's composition, forward only: f32 (and bf16 on a GPU) (`kernels/engine.rs`).
//! - The engine's decode steps over fixed buffers, on a GPU captured and replayed as CUDA graphs
//!   (medium, bf16), on the CPU run eagerly (tiny), against the eager steps: the logits agreeing,
//!   no capture failing, and their times (`decode_graph_*`).
//! - On a CPU with AMX, the engine's bf16 tile products ([`sluice_model::amx`]) against the f32
//!   product of the same shapes (64 rows, as a decode step of 64 sequences), each weight
//!   streamed from memory: the largest difference relative to the row's largest sum.
//!
//! Ends with a `RESULT kernels` line (`checks_failed` counts the failed checks); exits 1 when a
//! check fails.

use std::process::ExitCode;
use std::time::Instant;

use sluice_model::candle::{DType, Device, Tensor, Var};
use sluice_trainer::adamw_kernel::{
    Operands, Update, accumulate, apply, apply_many, compose, snapshot, sum_of_squares,
};

mod engine;
mod training;

/// `sluice bench kernels`
#[derive(Debug, clap::Args)]
pub struct BenchKernelsArgs {
    /// Where the kernels run: `cpu` or `cuda:N` (a `cuda` build).
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    pub device: sluice_config::Device,
    /// Elements of the parameter the AdamW update is timed on.
    #[arg(long, default_value_t = 1 << 22)]
    pub adamw_elements: usize,
    /// The decode steps replayed as CUDA graphs against the eager ones: `with` the other
    /// checks, `skip`ped, or `only` them (a capture that brings the process down then takes
    /// no other check's line with it).
    #[arg(long, value_enum, default_value_t = DecodeGraphs::With)]
    pub decode_graphs: DecodeGraphs,
}

/// Whether `sluice bench kernels` checks the decode steps over fixed buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DecodeGraphs {
    /// With the other checks.
    With,
    /// Not at all.
    Skip,
    /// Alone.
    Only,
}

/// AdamW steps timed per path.
const ADAMW_STEPS: i32 = 5;

/// Runs the benchmark.
pub fn run(args: &BenchKernelsArgs) -> anyhow::Result<ExitCode> {
    let device = sluice_model::device(args.device)?;
    println!("kernels on {}", args.device);
    let mut result = Vec::new();
    let mut failed = 0;
    if args.decode_graphs != DecodeGraphs::Only {
        failed += u32::from(!adamw(&device, args.adamw_elements, &mut result)?);
        if device.is_cuda() {
            failed += u32::from(!adamw_many(&device, args.adamw_elements, &mut result)?);
            failed += u32::from(!accumulate_many(&device, args.adamw_elements, &mut result)?);
            failed += u32::from(!sampling(&device, &mut result)?);
            failed += u32::from(!training::compare(&device, &mut result)?);
            // Its own failure (a pool out of memory, say) is counted, and the rest goes on.
            let split = engine::key_split(&device, &mut result).unwrap_or_else(|e| {
                println!("decode steps with the keys split: FAILED: {e:#}");
                false
            });
            failed += u32::from(!split);
        } else if sluice_model::amx::available() {
            failed += u32::from(!amx_products(&mut result)?);
        }
        failed += u32::from(!engine::compare(&device, &mut result)?);
    }
    if args.decode_graphs != DecodeGraphs::Skip {
        failed += u32::from(!engine::decode_graphs(&device, &mut result)?);
    }
    result.push(format!("checks_failed={failed}"));
    let ok = failed == 0;
    println!("RESULT kernels {}", result.join(" "));
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn update(t: i32) -> Update {
    Update {
        clip_scale: 0.37,
        beta1: 0.9,
        beta2: 0.999,
        bc1: 1.0 - 0.9f64.powi(t),
        bc2: 1.0 - 0.999f64.powi(t),
        eps: 1e-8,
        lr: 1e-3,
        weight_decay: 0.01,
    }
}

/// Differing elements of two f32 tensors, bit for bit.
fn bit_mismatches(a: &Tensor, b: &Tensor) -> anyhow::Result<usize> {
    let a: Vec<f32> = a.flatten_all()?.to_vec1()?;
    let b: Vec<f32> = b.flatten_all()?.to_vec1()?;
    Ok(a.iter()
        .zip(&b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count())
}

fn adamw(device: &Device, n: usize, result: &mut Vec<String>) -> anyhow::Result<bool> {
    let p0 = Tensor::randn(0f32, 1.0, n, &Device::Cpu)?;
    let grads: Vec<Tensor> = (0..ADAMW_STEPS)
        .map(|_| Tensor::randn(0f32, 1.0, n, &Device::Cpu))
        .collect::<Result<_, _>>()?;
    // The in-place kernel on the device, the composition on the device, the CPU kernel.
    let run = |on: &Device, in_place: bool| -> anyhow::Result<(Tensor, Tensor, Tensor, f64)> {
        let master = Var::from_tensor(&p0.to_device(on)?)?;
        let mut m = Tensor::zeros(n, DType::F32, on)?;
        let mut v = Tensor::zeros(n, DType::F32, on)?;
        let grads: Vec<Tensor> = grads
            .iter()
            .map(|g| g.to_device(on))
            .collect::<Result<_, _>>()?;
        // One update of a small tensor first: the kernels' first use loads (and JIT-compiles)
        // their modules, which is not what is timed.
        let small = Var::from_tensor(&Tensor::ones(256, DType::F32, on)?)?;
        let (mut sm, mut sv, sg) = (small.zeros_like()?, small.zeros_like()?, small.ones_like()?);
        if in_place {
            apply(&small, &mut sm, &mut sv, &sg, update(1))?;
        } else {
            compose(small.as_tensor(), &sm, &sv, &sg, update(1))?;
        }
        on.synchronize()?;
        let start = Instant::now();
        for (t, g) in (1..).zip(&grads) {
            if in_place {
                apply(&master, &mut m, &mut v, g, update(t))?;
            } else {
                let (p, m2, v2) = compose(master.as_tensor(), &m, &v, g, update(t))?;
                master.set(&p)?;
                (m, v) = (m2, v2);
            }
        }
        on.synchronize()?;
        let ms = start.elapsed().as_secs_f64() * 1e3 / f64::from(ADAMW_STEPS);
        Ok((master.as_tensor().copy()?, m, v, ms))
    };
    let (p, m, v, kernel_ms) = run(device, true)?;
    let (cp, cm, cv, composed_ms) = run(device, false)?;
    let (rp, rm, rv, _) = run(&Device::Cpu, true)?;
    let vs_composition =
        bit_mismatches(&p, &cp)? + bit_mismatches(&m, &cm)? + bit_mismatches(&v, &cv)?;
    let vs_cpu = bit_mismatches(&p, &rp)? + bit_mismatches(&m, &rm)? + bit_mismatches(&v, &rv)?;
    println!(
        "adamw, {n} f32 elements, {ADAMW_STEPS} steps: in place {kernel_ms:.3} ms/step, composition {composed_ms:.3} ms/step ({:.2}x); elements differing from the composition {vs_composition}, from the CPU kernel {vs_cpu}",
        composed_ms / kernel_ms
    );
    result.extend([
        format!("adamw_ms={kernel_ms:.4}"),
        format!("adamw_composed_ms={composed_ms:.4}"),
        format!("adamw_speedup={:.2}", composed_ms / kernel_ms),
        format!("adamw_bit_mismatches={}", vs_composition + vs_cpu),
    ]);
    Ok(vs_composition == 0 && vs_cpu == 0)
}

/// Parameters the many-parameter AdamW is timed on: about Qwen2.5-0.5B's count.
const ADAMW_PARAMS: usize = 290;

/// On a GPU: one launch for every parameter of a step against a launch per parameter, on `n`
/// elements split over [`ADAMW_PARAMS`] parameters of uneven sizes; the bits must agree.
fn adamw_many(device: &Device, n: usize, result: &mut Vec<String>) -> anyhow::Result<bool> {
    // Sizes 1, 2, 3, … in proportion, as a model's norms and projections differ.
    let weights: usize = (1..=ADAMW_PARAMS).sum();
    let sizes: Vec<usize> = (1..=ADAMW_PARAMS)
        .map(|k| (n * k / weights).max(1))
        .collect();
    let run = |together: bool| -> anyhow::Result<(Vec<Tensor>, f64)> {
        let mut state = Vec::new();
        for (k, &len) in sizes.iter().enumerate() {
            let p = Tensor::randn(0f32, 1.0, len, device)?;
            let g = (Tensor::randn(0f32, 1.0, len, device)? * (k as f64 + 1.0).recip())?;
            let zeros = || Tensor::zeros(len, DType::F32, device);
            state.push((Var::from_tensor(&p)?, zeros()?, zeros()?, g));
        }
        let step = |state: &mut Vec<(Var, Tensor, Tensor, Tensor)>, t: i32| -> anyhow::Result<()> {
            if together {
                let ops = state
                    .iter_mut()
                    .enumerate()
                    .map(|(i, (p, m, v, g))| (i, Operands { master: p, m, v, g }))
                    .collect();
                apply_many(ops, update(t))?;
            } else {
                for (p, m, v, g) in state.iter_mut() {
                    apply(p, m, v, g, update(t))?;
                }
            }
            Ok(())
        };
        // The first step loads the kernels' modules: not timed.
        step(&mut state, 1)?;
        device.synchronize()?;
        let start = Instant::now();
        for t in 2..=ADAMW_STEPS + 1 {
            step(&mut state, t)?;
        }
        device.synchronize()?;
        let ms = start.elapsed().as_secs_f64() * 1e3 / f64::from(ADAMW_STEPS);
        let mut out = Vec::new();
        for (p, m, v, _) in state {
            out.extend([p.as_tensor().copy()?, m, v]);
        }
        Ok((out, ms))
    };
    // Both from the same random draws: the device's generator is reseeded first.
    device.set_seed(7)?;
    let (many, many_ms) = run(true)?;
    device.set_seed(7)?;
    let (each, each_ms) = run(false)?;
    let mut differ = 0;
    for (a, b) in many.iter().zip(&each) {
        differ += bit_mismatches(a, b)?;
    }
    // The global gradient norm's squares in one launch against a sum per tensor.
    let grads: Vec<Tensor> = sizes
        .iter()
        .map(|&len| Tensor::randn(0f32, 1.0, len, device))
        .collect::<Result<_, _>>()?;
    let refs: Vec<&Tensor> = grads.iter().collect();
    let together = sum_of_squares(&refs)?;
    let mut each_sum = 0.0;
    for g in &grads {
        each_sum += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
    }
    let norm_err = together.map_or(0.0, |s| (s - each_sum).abs() / each_sum);
    // The published snapshot, bf16 copies of every parameter in one launch, against a
    // conversion per tensor: the same bits.
    let (fresh, snapshot_ms) = training::timed(ADAMW_STEPS as usize, device, || {
        Ok(snapshot(&refs, DType::BF16)?)
    })?;
    let (each_copy, each_copy_ms) = training::timed(ADAMW_STEPS as usize, device, || {
        Ok(grads
            .iter()
            .map(|g| g.to_dtype(DType::BF16))
            .collect::<Result<Vec<_>, _>>()?)
    })?;
    let mut snapshot_differ = 0;
    if let Some(fresh) = &fresh {
        for (a, b) in fresh.iter().zip(&each_copy) {
            snapshot_differ += bit_mismatches(&a.to_dtype(DType::F32)?, &b.to_dtype(DType::F32)?)?;
        }
    }
    println!(
        "published snapshot of {ADAMW_PARAMS} parameters in bf16: one launch {snapshot_ms:.3} ms, a conversion per parameter {each_copy_ms:.3} ms ({:.2}x); elements differing {snapshot_differ}{}",
        each_copy_ms / snapshot_ms,
        if fresh.is_some() {
            ""
        } else {
            "; the one launch was not taken"
        }
    );
    println!(
        "adamw over {ADAMW_PARAMS} parameters, {n} f32 elements: one launch {many_ms:.3} ms/step, a launch per parameter {each_ms:.3} ms/step ({:.2}x); elements differing {differ}; the norm's squares in one launch {} (relative difference {norm_err:.1e})",
        each_ms / many_ms,
        if together.is_some() {
            "taken"
        } else {
            "not taken"
        }
    );
    result.extend([
        format!("adamw_many_ms={many_ms:.4}"),
        format!("adamw_each_ms={each_ms:.4}"),
        format!("adamw_many_speedup={:.2}", each_ms / many_ms),
        format!("adamw_many_bit_mismatches={differ}"),
        format!("grad_norm_sum_err={norm_err:.2e}"),
        format!("snapshot_many_speedup={:.2}", each_copy_ms / snapshot_ms),
        format!("snapshot_many_bit_mismatches={snapshot_differ}"),
    ]);
    Ok(differ == 0
        && together.is_some()
        && norm_err < 1e-5
        && fresh.is_some()
        && snapshot_differ == 0)
}

/// On a GPU: two micro-batches' gradients added to a step's f32 sums by one launch each against
/// a conversion and an add per gradient, on `n` elements over [`ADAMW_PARAMS`] parameters with
/// bf16 gradients (the first also has an f32 one, as a tied embedding's gathered rows); the
/// bits must agree.
fn accumulate_many(device: &Device, n: usize, result: &mut Vec<String>) -> anyhow::Result<bool> {
    let weights: usize = (1..=ADAMW_PARAMS).sum();
    let micro = |seed: u64| -> anyhow::Result<Vec<(usize, Vec<Tensor>)>> {
        device.set_seed(seed)?;
        let mut grads = Vec::with_capacity(ADAMW_PARAMS);
        for k in 1..=ADAMW_PARAMS {
            let len = (n * k / weights).max(1);
            let bf16 = Tensor::randn(0f32, 1.0, len, device)?.to_dtype(DType::BF16)?;
            let mut gs = vec![bf16];
            if k == 1 {
                gs.insert(0, Tensor::randn(0f32, 1.0, len, device)?);
            }
            grads.push((k - 1, gs));
        }
        Ok(grads)
    };
    let each = |sums: &mut [Option<Tensor>], grads: Vec<(usize, Vec<Tensor>)>| {
        for (i, gs) in grads {
            let mut sum: Option<Tensor> = None;
            for g in gs {
                let g = g.to_dtype(DType::F32)?;
                sum = Some(match sum {
                    None => g,
                    Some(s) => (s + g)?,
                });
            }
            sums[i] = match (sums[i].take(), sum) {
                (Some(a), Some(s)) => Some((a + s)?),
                (a, s) => a.or(s),
            };
        }
        anyhow::Ok(())
    };
    let (first, second) = (micro(11)?, micro(12)?);
    let mut together = vec![None; ADAMW_PARAMS];
    let mut left = accumulate(&mut together, first.clone())?.len();
    left += accumulate(&mut together, second.clone())?.len();
    let mut apart = vec![None; ADAMW_PARAMS];
    each(&mut apart, first)?;
    each(&mut apart, second.clone())?;
    let mut differ = 0;
    for (a, b) in together.iter().zip(&apart) {
        let (Some(a), Some(b)) = (a, b) else {
            anyhow::bail!("a parameter's gradient sum is missing");
        };
        differ += bit_mismatches(a, b)?;
    }
    // One more micro-batch onto the existing sums, each way.
    let (_, one_ms) = training::timed(ADAMW_STEPS as usize, device, || {
        Ok(accumulate(&mut together, second.clone())?)
    })?;
    let (_, each_ms) = training::timed(ADAMW_STEPS as usize, device, || {
        each(&mut apart, second.clone())
    })?;
    println!(
        "a micro-batch's bf16 gradients added to the f32 sums of {ADAMW_PARAMS} parameters: one launch {one_ms:.3} ms, a conversion and an add per gradient {each_ms:.3} ms ({:.2}x); elements differing {differ}; parameters the launch did not take {left}",
        each_ms / one_ms
    );
    result.extend([
        format!("accumulate_many_speedup={:.2}", each_ms / one_ms),
        format!("accumulate_many_bit_mismatches={differ}"),
    ]);
    Ok(differ == 0 && left == 0)
}

/// Rows of the products: a decode step of 64 sequences.
const AMX_ROWS: usize = 64;
/// Products timed per weight and path.
const AMX_REPEATS: usize = 8;

/// The AMX bf16 products against the f32 ones on SmolLM2-135M's projection shapes `(n, k)`,
/// each repeat on a fresh weight (so every product streams its weight from memory, as a model
/// far larger than the cache does).
fn amx_products(result: &mut Vec<String>) -> anyhow::Result<bool> {
    use sluice_model::amx::Bf16Weight;
    let shapes = [(576, 576), (1536, 576), (576, 1536), (49_152, 576)];
    let (mut f32_s, mut amx_s, mut pack_s, mut worst) = (0.0, 0.0, 0.0, 0.0f64);
    let mut params = 0usize;
    for (n, k) in shapes {
        let x = Tensor::randn(0f32, 1.0, (AMX_ROWS, k), &Device::Cpu)?;
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let weights: Vec<Tensor> = (0..AMX_REPEATS)
            .map(|_| Tensor::randn(0f32, 0.05, (n, k), &Device::Cpu))
            .collect::<Result<_, _>>()?;
        let values: Vec<Vec<f32>> = weights
            .iter()
            .map(|w| w.flatten_all()?.to_vec1())
            .collect::<Result<_, _>>()?;
        let mut packed: Vec<Bf16Weight> =
            values.iter().map(|w| Bf16Weight::pack(w, n, k)).collect();
        // Repacking in place is what an engine pays at every weight swap.
        let start = Instant::now();
        for (p, w) in packed.iter_mut().zip(&values) {
            p.repack(w);
        }
        pack_s += start.elapsed().as_secs_f64();
        params += AMX_REPEATS * n * k;
        drop(values);
        let start = Instant::now();
        let mut exact = Vec::new();
        for w in &weights {
            exact.push(sluice_model::fused::linear(&x, w, None)?);
        }
        f32_s += start.elapsed().as_secs_f64();
        let start = Instant::now();
        let mut tiles = Vec::new();
        for w in &packed {
            tiles.push(w.linear(&xs, AMX_ROWS));
        }
        amx_s += start.elapsed().as_secs_f64();
        for (e, t) in exact.iter().zip(&tiles) {
            let e: Vec<f32> = e.flatten_all()?.to_vec1()?;
            for (er, tr) in e.chunks(n).zip(t.chunks(n)) {
                let scale = er.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = er
                    .iter()
                    .zip(tr)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                worst = worst.max(f64::from(diff / scale));
            }
        }
    }
    let pack_ms_per_m = pack_s * 1e3 / (params as f64 / 1e6);
    // The tiles' rate through the weights (2 bytes each): what bounds a decode step.
    let gb_s = (2 * params) as f64 / amx_s / 1e9;
    println!(
        "amx products, {AMX_ROWS} rows against SmolLM2-135M's shapes {shapes:?}, {AMX_REPEATS} weights each: bf16 tiles {:.2} ms ({gb_s:.1} GB/s of weights), f32 {:.2} ms ({:.2}x); largest difference {worst:.2e} of the row's largest sum; repacking at a swap {pack_ms_per_m:.2} ms per million weights",
        amx_s * 1e3,
        f32_s * 1e3,
        f32_s / amx_s
    );
    result.extend([
        format!("amx_ms={:.3}", amx_s * 1e3),
        format!("amx_gb_s={gb_s:.2}"),
        format!("amx_f32_ms={:.3}", f32_s * 1e3),
        format!("amx_speedup={:.2}", f32_s / amx_s),
        format!("amx_rel_diff={worst:.3e}"),
        format!("amx_pack_ms_per_mparam={pack_ms_per_m:.3}"),
    ]);
    // bf16 operands carry 8 bits: sums of a few hundred products differ by about 2⁻⁹ of the
    // largest in relative terms; a wrong tile order or a missed block is off by far more.
    Ok(worst < 2e-2)
}

#[cfg(not(feature = "cuda"))]
fn sampling(_: &Device, _: &mut Vec<String>) -> anyhow::Result<bool> {
    anyhow::bail!("this sluice was built without CUDA")
}

/// The device's token choice against the CPU sampler's on 64 rows of a real vocabulary.
#[cfg(feature = "cuda")]
fn sampling(device: &Device, result: &mut Vec<String>) -> anyhow::Result<bool> {
    use sluice_engine::SamplingParams;
    use sluice_engine::native::sampler::{sample_rows, uniform};

    const ROWS: usize = 64;
    const VOCAB: usize = 151_936;
    let logits: Vec<f32> = (0..(ROWS * VOCAB) as u64)
        .map(|i| {
            let h = sluice_core::rng::splitmix(i);
            (h >> 40) as f32 / (1u64 << 24) as f32 * 20.0 - 10.0
        })
        .collect();
    let on_device = Tensor::from_vec(logits, (ROWS, VOCAB), device)?;
    // Every third row greedy, the others at temperatures 1 and 0.7.
    let temperature = |r: usize| [0.0, 1.0, 0.7][r % 3];
    let params: Vec<SamplingParams> = (0..ROWS)
        .map(|r| SamplingParams {
            temperature: temperature(r),
            top_p: 1.0,
            top_k: 0,
            max_tokens: 1,
            seed: None,
            stop_token_ids: Vec::new(),
        })
        .collect();
    let temps: Vec<f32> = (0..ROWS).map(|r| temperature(r) as f32).collect();
    let uniforms: Vec<f64> = (0..ROWS).map(|r| uniform(r as u64, 3)).collect();
    let mut gpu_ms = Vec::new();
    let mut drawn = Vec::new();
    for _ in 0..9 {
        let start = Instant::now();
        drawn = sluice_model::kernels::sample_rows(&on_device, &temps, &uniforms)?;
        gpu_ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let mut cpu_ms = Vec::new();
    let mut picks = Vec::new();
    for _ in 0..9 {
        let start = Instant::now();
        let rows: Vec<Vec<f32>> = on_device.to_vec2()?;
        let jobs: Vec<(&[f32], &SamplingParams, u64, u64)> = rows
            .iter()
            .zip(&params)
            .zip(0u64..)
            .map(|((row, p), r)| (row.as_slice(), p, r, 3))
            .collect();
        picks = sample_rows(&jobs);
        cpu_ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let (gpu_ms, cpu_ms) = (crate::median(gpu_ms), crate::median(cpu_ms));
    let agree = drawn
        .iter()
        .zip(&picks)
        .filter(|(d, p)| d.0 == p.token)
        .count();
    let lp_diff = drawn
        .iter()
        .zip(&picks)
        .filter(|(d, p)| d.0 == p.token)
        .map(|(d, p)| f64::from((d.1 - p.logprob).abs()))
        .fold(0.0, f64::max);
    println!(
        "token choice, {ROWS} rows of {VOCAB} logits: on the device {gpu_ms:.3} ms, logits to the host and the CPU sampler {cpu_ms:.3} ms ({:.1}x); tokens agreeing {agree}/{ROWS}, largest log-prob difference {lp_diff:.2e}",
        cpu_ms / gpu_ms
    );
    result.extend([
        format!("sample_ms={gpu_ms:.4}"),
        format!("sample_host_ms={cpu_ms:.4}"),
        format!("sample_agree={agree}"),
        format!("sample_rows={ROWS}"),
        format!("sample_lp_diff={lp_diff:.3e}"),
    ]);
    // A boundary draw may round differently (f32 exponentials on two machines); more than one
    // in 64 is a fault.
    Ok(agree + 1 >= ROWS && lp_diff < 1e-3)
}
