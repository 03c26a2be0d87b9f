//! `sluice bench model`: training forward+backward and decode tokens/s for the presets or model
//! directories (`--model DIR`), next to what this machine allows (measured memory bandwidth and matmul FLOP/s).
//!
//! Bounds: a training token costs at least `6 · P` FLOPs (forward + backward over the `P`
//! parameters used as matmul weights), a decode step reads every weight once, so decode is
//! bounded by `min(B · bandwidth / weight_bytes, flops / (2 · P))` tokens/s. Attention is
//! left out of both (short sequences here), so real numbers sit below the bounds.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_config::ModelPreset;
use sluice_model::candle::{DType, Device, Tensor};
use sluice_model::{
    Activations, ContiguousKvCache, ForwardOptions, InferenceModel, KvCache, LogitsWanted,
    ModelWeights, PackedBatch, StepInput, TrainableModel, argmax_rows,
};

use crate::subject::Subject;

/// `sluice bench model`
#[derive(Debug, clap::Args)]
pub struct BenchModelArgs {
    /// Presets to measure (repeatable; default: tiny and small unless `--model` is given).
    #[arg(long = "preset", value_parser = sluice_config::ModelPreset::parse_name)]
    pub presets: Vec<sluice_config::ModelPreset>,
    /// Model directories to measure with their own weights (repeatable); sizes default to
    /// those of the preset nearest in size.
    #[arg(long = "model", value_name = "DIR")]
    pub models: Vec<std::path::PathBuf>,
    /// Decode batch sizes.
    #[arg(long = "batch", default_values_t = [1usize, 8, 64])]
    pub batches: Vec<usize>,
}

/// Sizes per preset, chosen so the whole run takes a few minutes on 2 cores.
struct Plan {
    train_rows: usize,
    train_len: usize,
    train_iters: usize,
    prompt_len: usize,
    decode_steps: usize,
}

fn plan(preset: ModelPreset) -> Plan {
    match preset {
        ModelPreset::Tiny => Plan {
            train_rows: 8,
            train_len: 128,
            train_iters: 3,
            prompt_len: 16,
            decode_steps: 32,
        },
        ModelPreset::Small => Plan {
            train_rows: 1,
            train_len: 128,
            train_iters: 1,
            prompt_len: 16,
            decode_steps: 6,
        },
        ModelPreset::Medium => Plan {
            train_rows: 1,
            train_len: 64,
            train_iters: 1,
            prompt_len: 16,
            decode_steps: 4,
        },
    }
}

/// Runs the benchmark and prints a table and the `RESULT model` line.
pub fn run(args: &BenchModelArgs) -> anyhow::Result<ExitCode> {
    let subjects = Subject::list(&args.presets, &args.models);
    let bandwidth = memory_bandwidth_bytes_per_s();
    let flops = matmul_flops_per_s()?;
    println!(
        "machine: {} threads, memory bandwidth {:.1} GB/s (parallel copy), f32 matmul {:.1} GFLOP/s (1024³)",
        threads(),
        bandwidth / 1e9,
        flops / 1e9
    );
    let mut result = vec![
        format!("mem_bw_gbs={:.1}", bandwidth / 1e9),
        format!("matmul_gflops={:.1}", flops / 1e9),
    ];
    for subject in subjects {
        let name = subject.name();
        let config = subject.config()?;
        let snapshot = subject.weights(0, DType::F32, &Device::Cpu)?;
        let matmul_params = matmul_params(&config);
        let p = plan(subject.size_class()?);
        println!(
            "\n{name}: {} parameters ({} in matmuls), f32 on CPU",
            config.num_parameters(),
            matmul_params
        );
        let train = train_tokens_per_s(&snapshot, &p)?;
        let train_bound = flops / (6.0 * matmul_params as f64);
        println!(
            "  train fwd+bwd [{}x{}]  {:>10.0} tok/s   bound {:>10.0} tok/s  ({:.0}%)",
            p.train_rows,
            p.train_len,
            train,
            train_bound,
            100.0 * train / train_bound
        );
        result.push(format!("{name}_train_tok_s={train:.0}"));
        for &batch in &args.batches {
            let decode = decode_tokens_per_s(&snapshot, batch, &p)?;
            let bound = decode_bound(&config, batch, bandwidth, flops);
            println!(
                "  decode batch {batch:>3}        {decode:>10.0} tok/s   bound {bound:>10.0} tok/s  ({:.0}%)",
                100.0 * decode / bound
            );
            result.push(format!("{name}_decode_b{batch}_tok_s={decode:.0}"));
        }
    }
    println!("RESULT model {}", result.join(" "));
    Ok(ExitCode::SUCCESS)
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The f32 decode bound of `batch` sequences, tokens/s: every weight read once per step, every
/// matmul weight used in `2 · batch` FLOPs (see the module docs).
pub(crate) fn decode_bound(
    config: &sluice_model::ModelConfig,
    batch: usize,
    bandwidth: f64,
    flops: f64,
) -> f64 {
    let weight_bytes = (config.num_parameters() * 4) as f64;
    (batch as f64 * bandwidth / weight_bytes).min(flops / (2.0 * matmul_params(config) as f64))
}

/// Parameters used as matmul weights per token (the embedding lookup is free; a tied head is a
/// matmul with the embedding).
fn matmul_params(config: &sluice_model::ModelConfig) -> usize {
    let embed = config.vocab_size * config.hidden_size;
    if config.tie_word_embeddings {
        config.num_parameters()
    } else {
        config.num_parameters() - embed
    }
}

/// Copy bandwidth with one thread per core over 256 MiB, counting read + write bytes.
pub(crate) fn memory_bandwidth_bytes_per_s() -> f64 {
    const BYTES: usize = 256 << 20;
    let n = threads();
    let per = BYTES / 8 / n;
    let mut src: Vec<Vec<u64>> = (0..n).map(|i| vec![i as u64; per]).collect();
    let mut dst: Vec<Vec<u64>> = (0..n).map(|_| vec![0u64; per]).collect();
    let mut best = 0.0f64;
    for round in 0..4 {
        for s in &mut src {
            s[0] = round;
        }
        let start = Instant::now();
        std::thread::scope(|scope| {
            for (s, d) in src.iter().zip(dst.iter_mut()) {
                scope.spawn(move || d.copy_from_slice(s));
            }
        });
        let secs = start.elapsed().as_secs_f64();
        best = best.max((2 * per * 8 * n) as f64 / secs);
    }
    std::hint::black_box(&dst);
    best
}

/// candle f32 matmul throughput on 1024×1024 operands (all cores).
pub(crate) fn matmul_flops_per_s() -> anyhow::Result<f64> {
    const N: usize = 1024;
    let a = Tensor::randn(0f32, 1.0, (N, N), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (N, N), &Device::Cpu)?;
    a.matmul(&b)?;
    let reps = 5;
    let start = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(a.matmul(&b)?);
    }
    Ok((2 * N * N * N * reps) as f64 / start.elapsed().as_secs_f64())
}

fn train_tokens_per_s(snapshot: &ModelWeights, p: &Plan) -> anyhow::Result<f64> {
    let model = TrainableModel::from_snapshot(snapshot, DType::F32)?;
    let vocab = snapshot.config().vocab_size as u32;
    let seqs: Vec<Vec<u32>> = (0..p.train_rows)
        .map(|r| {
            (0..p.train_len as u32)
                .map(|i| (i * 7 + r as u32 * 13) % vocab)
                .collect()
        })
        .collect();
    let rows: Vec<Vec<&[u32]>> = seqs.iter().map(|s| vec![s.as_slice()]).collect();
    let batch = PackedBatch::from_rows(&rows, p.train_len, 0)?;
    let mask: Vec<f32> = batch
        .target_mask
        .iter()
        .map(|&m| f32::from(u8::from(m)))
        .collect();
    let mask = Tensor::from_vec(mask, (p.train_rows, p.train_len), &Device::Cpu)?;
    let step = || -> anyhow::Result<()> {
        let options = ForwardOptions::default();
        let (scores, saved) =
            model.token_scores_for_backward(&batch, options, Activations::Kept)?;
        let loss = (scores.logprobs * &mask)?.sum_all()?;
        std::hint::black_box(model.backward_saved(&loss, saved)?);
        Ok(())
    };
    step()?;
    let start = Instant::now();
    for _ in 0..p.train_iters {
        step()?;
    }
    let tokens = p.train_iters * p.train_rows * p.train_len;
    Ok(tokens as f64 / start.elapsed().as_secs_f64())
}

fn decode_tokens_per_s(
    snapshot: &Arc<ModelWeights>,
    batch: usize,
    p: &Plan,
) -> anyhow::Result<f64> {
    let model = InferenceModel::new(Arc::clone(snapshot))?;
    let mut cache = ContiguousKvCache::new(model.config(), snapshot.dtype(), snapshot.device());
    let prompts = prompts(batch, p.prompt_len, snapshot.config().vocab_size);
    let took = greedy_decode(&model, &mut cache, &prompts, p.decode_steps)?;
    Ok((batch * p.decode_steps) as f64 / took.as_secs_f64())
}

/// `batch` deterministic prompts of `len` tokens below `vocab`, one per sequence.
pub fn prompts(batch: usize, len: usize, vocab: usize) -> Vec<Vec<u32>> {
    let vocab = vocab as u32;
    (0..batch as u32)
        .map(|s| (0..len as u32).map(|i| (i * 5 + s * 3) % vocab).collect())
        .collect()
}

/// Prefills `prompts` (sequence `i` for row `i`) into `cache`, then decodes `steps` greedy
/// tokens for every sequence at once, the steady state of continuous batching; returns the
/// decode's wall time (the prefill's excluded).
pub fn greedy_decode(
    model: &InferenceModel,
    cache: &mut dyn KvCache,
    prompts: &[Vec<u32>],
    steps: usize,
) -> anyhow::Result<Duration> {
    let logits = model.step(cache, &StepInput::numbered(prompts), LogitsWanted::Last)?;
    let mut next = argmax_rows(&logits)?;
    let start = Instant::now();
    for _ in 0..steps {
        let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let logits = model.step(cache, &StepInput::numbered(&tokens), LogitsWanted::Last)?;
        next = argmax_rows(&logits)?;
    }
    Ok(start.elapsed())
}
