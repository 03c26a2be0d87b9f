//! `sluice bench engine`: the native engine's continuous batching on the presets or on model
//! directories (`--model DIR`).
//!
//! For each model: decode tokens/s with 1, 8, 32 and 64 requests in flight against the same
//! requests run one at a time; p50/p99 inter-token latency per concurrency; and the weight-swap
//! pause of each update mode with a batch running (in_flight: the p50 of 24 swaps at times
//! unrelated to the engine's steps). Each row also splits the engine's compute time: the model's
//! forward (logits to the host included) against the scheduler's share (inputs, sampling,
//! per-token bookkeeping, finishing requests), the time per scheduler step, and the decode rate:
//! tokens per second of compute in steps with no prefill (what `sluice bench model`'s decode
//! bound is about; `tokens/s` includes the prompts' prefill). Greedy, `ignore_eos`, fixed
//! lengths, so every configuration generates the same number of tokens.
//!
//! Then prefix sharing: groups of `--group-size` requests with one prompt each, on a cold
//! cache, with prefix caching on and off: prompt tokens prefilled ÷ submitted, and the model's
//! time. Every engine gets `--kv-cache-mb` of KV cache (0: sized automatically); preemptions
//! are counted per row, and the process's peak resident memory is printed at the end. Last, the
//! engine's token choice at a real vocabulary (`sampling.rs`).

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use sluice_config::ModelPreset;
use sluice_core::WeightUpdateMode;
use sluice_engine::NativeEngineParams;
use sluice_engine::native::KvBudget;

use crate::subject::Subject;
use measure::{PREFIX_GROUPS, Shape, measure, prefix_sharing};

mod measure;

pub(crate) use measure::request;

/// `sluice bench engine`
#[derive(Debug, clap::Args)]
pub struct BenchEngineArgs {
    /// Presets to measure (repeatable; default: tiny and small unless `--model` is given).
    #[arg(long = "preset", value_parser = sluice_config::ModelPreset::parse_name)]
    pub presets: Vec<sluice_config::ModelPreset>,
    /// Model directories to measure with their own weights (repeatable); lengths default to
    /// those of the preset nearest in size.
    #[arg(long = "model", value_name = "DIR")]
    pub models: Vec<std::path::PathBuf>,
    /// Requests in flight.
    #[arg(long = "concurrency", default_values_t = [1usize, 8, 32, 64], value_parser = concurrency)]
    pub concurrency: Vec<usize>,
    /// KV cache pool of every engine the benchmark starts, MiB (0 = sized automatically, as
    /// `engine.kv_cache_mb = 0`).
    #[arg(long, default_value_t = 0)]
    pub kv_cache_mb: u32,
    /// Tokens generated per request (default: per preset).
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Prompt tokens per request (default: 16).
    #[arg(long)]
    pub prompt_tokens: Option<usize>,
    /// Rollouts per group of the prefix-sharing measurement (0 skips it).
    #[arg(long, default_value_t = 8)]
    pub group_size: usize,
    /// Lengths spread around the preset's (or the flags') instead of equal: prompts ½–1½×,
    /// completions ⅛–1⅞×, so requests finish at different steps and prompts are admitted
    /// while others decode (a rollout workload's mixed steps).
    #[arg(long)]
    pub ragged: bool,
    /// Only the concurrency rows: no one-by-one baseline, swap pauses or prefix sharing (a
    /// memory run: `--preset medium --concurrency 64 --kv-cache-mb 2048 --only-concurrency`).
    #[arg(long)]
    pub only_concurrency: bool,
    /// Before each timed row, the same number of requests of the same lengths once, untimed,
    /// on the same engine (its KV pool grown, its buffers' pages touched), as
    /// `scripts/pytorch-bench` times `generate` after one warm-up call.
    #[arg(long)]
    pub warm_up: bool,
    /// Where the engines run: `cpu` or `cuda:N` (a `cuda` build).
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    pub device: sluice_config::Device,
    /// Weights and KV cache dtype: `f32`, `bf16` or `f16`.
    #[arg(long, default_value = "f32", value_parser = crate::parse_dtype)]
    pub dtype: sluice_config::DType,
    /// The engines' matrix products, as `engine.compute_dtype`: `f32` or `bf16` (on the CPU,
    /// Intel AMX tiles) [default: the weights' dtype].
    #[arg(long, value_name = "DTYPE")]
    pub compute_dtype: Option<String>,
    /// One product for q/k/v and one for gate/up per layer, as `engine.stacked_products`:
    /// `true` or `false` [default: on a GPU, off on the CPU].
    #[arg(long, value_name = "BOOL")]
    pub stacked_products: Option<bool>,
    /// Decode-only steps captured and replayed as CUDA graphs, as `engine.cuda_graphs` (a
    /// `cuda:N` device only).
    #[arg(long)]
    pub cuda_graphs: bool,
    /// Let the GPU's memory pool give freed memory back to the driver at every
    /// synchronisation (CUDA's default, and Sluice's until 2026-11-30), where a run keeps it
    /// mapped for the next step: the yardstick of keeping it; no effect on the CPU.
    #[arg(long)]
    pub release_freed_memory: bool,
}

/// Completion length and prompt length per preset, sized for a few minutes on 2 cores.
fn lengths(preset: ModelPreset) -> (u32, usize) {
    match preset {
        ModelPreset::Tiny => (64, 16),
        ModelPreset::Small => (16, 16),
        ModelPreset::Medium => (8, 16),
    }
}

/// What one configuration measured.
struct Measured {
    tokens_per_s: f64,
    itl_p50_ms: f64,
    itl_p99_ms: f64,
    /// Share of the engine's compute time inside the model, %.
    model_pct: f64,
    /// Share of the model's time spent issuing the forward, %: all of it on the CPU; on a GPU,
    /// near 100 when the step is bound by launches rather than by the device.
    issue_pct: f64,
    /// Milliseconds of compute per scheduler step.
    step_ms: f64,
    /// Tokens per second of compute in decode-only steps (no prefill in them).
    decode_tok_s: f64,
    /// Sequences preempted for lack of KV blocks.
    preempted: u64,
    /// Share of the model calls that replayed a CUDA graph (`--cuda-graphs`), %.
    graphed_pct: f64,
}

/// Prompt length of the prefix-sharing groups: six full blocks of 16 and a partial one, which
/// every rollout computes itself (it samples from the last token's logits).
const GROUP_PROMPT_TOKENS: usize = 100;

const MIB: u64 = 1024 * 1024;
/// Requests per row are this many times its concurrency (one-by-one: times 8), so a row
/// measures continuous batching refilling its slots, not one batch's start and drain.
const ROUNDS: usize = 3;

/// Engine parameters every measurement shares.
#[derive(Clone, Copy)]
pub(crate) struct Sizing {
    pub(crate) kv_cache_bytes: u64,
    pub(crate) device: sluice_config::Device,
    pub(crate) compute_dtype: Option<sluice_config::DType>,
    pub(crate) stacked_products: Option<bool>,
    pub(crate) cuda_graphs: bool,
}

impl Sizing {
    fn params(&self, concurrency: usize) -> NativeEngineParams {
        NativeEngineParams {
            max_running_sequences: concurrency,
            kv_cache_bytes: self.kv_cache_bytes,
            // The engine alone on the machine: every core.
            threads: sluice_model::threads::role_threads(0, 1),
            device: self.device,
            compute_dtype: self.compute_dtype,
            stacked_products: self.stacked_products,
            cuda_graphs: self.cuda_graphs,
            ..NativeEngineParams::default()
        }
    }
}

/// Runs the benchmark and prints a table and the `RESULT engine` line.
pub fn run(args: &BenchEngineArgs) -> anyhow::Result<ExitCode> {
    let subjects = Subject::list(&args.presets, &args.models);
    let mut speedup_tiny = None;
    let compute_dtype =
        sluice_engine::config::compute_dtype_flag(args.compute_dtype.as_deref(), args.device)
            .map_err(anyhow::Error::msg)?;
    // `sluice bench model`'s decode bound is for f32 products on the CPU.
    let cpu_f32 = args.device == sluice_config::Device::Cpu
        && args.dtype == sluice_config::DType::F32
        && compute_dtype.is_none_or(|d| d == sluice_config::DType::F32);
    // Per preset measured at 64 in flight: its config, the batching speed-up, the decode rate.
    let mut at_64 = Vec::new();
    let mut pause_tiny = None;
    let mut prefix_ratio = None;
    let sizing = Sizing {
        kv_cache_bytes: u64::from(args.kv_cache_mb) * MIB,
        device: args.device,
        compute_dtype,
        stacked_products: args.stacked_products,
        cuda_graphs: args.cuda_graphs,
    };
    let device = sluice_model::device(args.device).context("--device")?;
    sluice_model::device::release_freed_memory(&device, args.release_freed_memory)?;
    let dtype = sluice_model::config::candle_dtype(args.dtype);
    for subject in subjects {
        let name = subject.name();
        let config = subject.config()?;
        let w0 = subject.weights(0, dtype, &device)?;
        let (default_tokens, default_prompt) = lengths(subject.size_class()?);
        let max_tokens = args.max_tokens.unwrap_or(default_tokens);
        let prompt_len = args.prompt_tokens.unwrap_or(default_prompt);
        let max_c = *args.concurrency.iter().max().unwrap_or(&64);
        let budget = KvBudget::new(&sizing.params(max_c), &config, dtype)?;
        println!(
            "{name}: {max_tokens} tokens per request, prompts of {prompt_len}{}; KV cache {:.1} MiB per engine ({} blocks of {} tokens{})",
            if args.ragged {
                " (ragged: on average)"
            } else {
                ""
            },
            budget.bytes as f64 / MIB as f64,
            budget.blocks,
            budget.block_tokens,
            if budget.automatic {
                ", automatic at the largest concurrency"
            } else {
                ""
            },
        );
        println!(
            "{:>12} {:>12} {:>12} {:>12} {:>9} {:>8} {:>8} {:>9} {:>8} {:>12} {:>9}",
            "concurrency",
            "tokens/s",
            "itl_p50_ms",
            "itl_p99_ms",
            "speedup",
            "model%",
            "issue%",
            "step_ms",
            "preempt",
            "decode_tok_s",
            "graphed%"
        );
        let shape = Shape {
            max_tokens,
            prompt_len,
            ragged: args.ragged,
        };
        let serial = if args.only_concurrency {
            None
        } else {
            let serial = measure(&w0, sizing, (ROUNDS * max_c.min(8), 1), shape, args.warm_up)?;
            println!(
                "{:>12} {:>12.1} {:>12.2} {:>12.2} {:>9} {:>8.1} {:>8.1} {:>9.2} {:>8} {:>12.1} {:>9.1}",
                "one-by-one",
                serial.tokens_per_s,
                serial.itl_p50_ms,
                serial.itl_p99_ms,
                "1.0",
                serial.model_pct,
                serial.issue_pct,
                serial.step_ms,
                serial.preempted,
                serial.decode_tok_s,
                serial.graphed_pct
            );
            Some(serial)
        };
        for &c in &args.concurrency {
            // The 64 row's decode rate is compared with the matmul bound measured just before
            // and just after it, the higher of the two (the machine's load moves within a run).
            let flops_before = (c == 64 && cpu_f32)
                .then(crate::model::matmul_flops_per_s)
                .transpose()?;
            let m = measure(&w0, sizing, (ROUNDS * c, c), shape, args.warm_up)?;
            let speedup = serial.as_ref().map(|s| m.tokens_per_s / s.tokens_per_s);
            println!(
                "{c:>12} {:>12.1} {:>12.2} {:>12.2} {:>9} {:>8.1} {:>8.1} {:>9.2} {:>8} {:>12.1} {:>9.1}",
                m.tokens_per_s,
                m.itl_p50_ms,
                m.itl_p99_ms,
                speedup.map_or("n/a".into(), |x| format!("{x:.1}")),
                m.model_pct,
                m.issue_pct,
                m.step_ms,
                m.preempted,
                m.decode_tok_s,
                m.graphed_pct
            );
            if subject.is(ModelPreset::Tiny) && c == 64 {
                speedup_tiny = speedup;
            }
            if c == 64 {
                let flops = match flops_before {
                    Some(before) => Some(before.max(crate::model::matmul_flops_per_s()?)),
                    None => None,
                };
                at_64.push((
                    name.clone(),
                    Arc::clone(&config),
                    speedup,
                    (m.tokens_per_s, m.decode_tok_s, m.issue_pct),
                    flops,
                ));
            }
        }
        if args.only_concurrency {
            println!();
            continue;
        }
        if args.group_size > 0 {
            let g = args.group_size;
            let on = prefix_sharing(&w0, sizing, g, true)?;
            let off = prefix_sharing(&w0, sizing, g, false)?;
            println!(
                "prefix sharing, {} groups of {g}, prompts of {GROUP_PROMPT_TOKENS}: prefilled / submitted = {:.3} (target <= 1/G + 0.05 = {:.3}); model {:.2} s vs {:.2} s without prefix caching ({:.0}% saved)",
                PREFIX_GROUPS,
                on.0,
                1.0 / g as f64 + 0.05,
                on.1,
                off.1,
                100.0 * (1.0 - on.1 / off.1.max(1e-12))
            );
            if subject.is(ModelPreset::Tiny) || prefix_ratio.is_none() {
                prefix_ratio = Some((g, on.0));
            }
        }
        // The second weight set (only the swaps need it) is built here, so a memory run
        // (`--only-concurrency`) holds one.
        let w1 = subject.weights(1, dtype, &device)?;
        for mode in WeightUpdateMode::ALL {
            if mode == WeightUpdateMode::InFlight {
                let pauses = crate::swaps::in_flight_pauses(&w0, &w1, prompt_len, sizing)?;
                let ms = |q: f64| {
                    pauses[((pauses.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3
                };
                println!(
                    "swap pause {:<13} {:>9.3} ms p50, {:.3} ms p90, {:.3} ms max ({} swaps)",
                    mode.as_str(),
                    ms(0.5),
                    ms(0.9),
                    ms(1.0),
                    pauses.len()
                );
                if subject.is(ModelPreset::Tiny) {
                    pause_tiny = Some(ms(0.5));
                }
                continue;
            }
            let pause = crate::swaps::swap_pause(&w0, &w1, mode, prompt_len, sizing)?;
            println!(
                "swap pause {:<13} {:>9.3} ms",
                mode.as_str(),
                pause.as_secs_f64() * 1e3
            );
        }
        println!();
    }
    let sampling = if args.only_concurrency {
        None
    } else {
        Some(crate::sampling::sampling_ms()?)
    };
    let rss = crate::rss::peak_mib();
    if let Some(mb) = rss {
        println!("peak resident memory: {mb:.0} MiB");
    }
    // Measured after the peak is read (the bandwidth copy holds 512 MiB). One request decodes
    // at best at the rate its weights stream from memory, a batch at best at the matmul rate:
    // whatever the preset, batching gains at most flops · bytes per weight / (2 · bandwidth)
    // over one request at a time on this machine (less below that many requests). A GPU's
    // rates are not the host's: its runs print no ceiling.
    let rates = if args.device == sluice_config::Device::Cpu {
        let bandwidth = crate::model::memory_bandwidth_bytes_per_s();
        let flops = crate::model::matmul_flops_per_s()?;
        let ceiling = (flops * dtype.size_in_bytes() as f64 / (2.0 * bandwidth)).min(64.0);
        println!(
            "batching speed-up ceiling at 64: {ceiling:.1}x (memory bandwidth {:.1} GB/s, matmul {:.1} GFLOP/s: one request streams every weight per token, a batch shares them)",
            bandwidth / 1e9,
            flops / 1e9,
        );
        Some((bandwidth, ceiling))
    } else {
        None
    };
    // Per preset: the batching speed-up, and the decode rate at 64 against `sluice bench
    // model`'s bound (f32 on the CPU).
    let mut per_preset = String::new();
    for (name, config, speedup, (tokens, decode, issue), flops) in &at_64 {
        // Prefill included: the rate `scripts/bench-vs-pytorch` holds against `generate`'s.
        per_preset.push_str(&format!(" {name}_tok_s_64={tokens:.1}"));
        per_preset.push_str(&format!(" {name}_issue_pct_64={issue:.1}"));
        if let Some(x) = speedup {
            per_preset.push_str(&format!(" {name}_batching_speedup_64={x:.1}"));
        }
        let (Some(flops), Some((bandwidth, ceiling))) = (flops, rates) else {
            if let Some(x) = speedup {
                println!("{name} at 64 in flight: batching speed-up {x:.1}x");
            }
            continue;
        };
        let bound = crate::model::decode_bound(config, 64, bandwidth, *flops);
        println!(
            "{name} at 64 in flight: decode {decode:.1} tok/s = {:.1}% of the decode bound {bound:.0} tok/s (`sluice bench model`'s, at {:.1} GFLOP/s measured around the row){}",
            100.0 * decode / bound,
            flops / 1e9,
            speedup.map_or(String::new(), |x| format!(
                "; batching speed-up {x:.1}x of a ceiling {ceiling:.1}x"
            )),
        );
        per_preset.push_str(&format!(
            " {name}_decode_bound_pct_64={:.1}",
            100.0 * decode / bound
        ));
    }
    println!(
        "RESULT engine batching_speedup_64={} batching_ceiling_64={}{per_preset} swap_pause_ms_in_flight={} prefix_prefill_ratio{}={} sample_ms_64_vocab152k={} peak_rss_mb={}",
        speedup_tiny.map_or("n/a".into(), |x| format!("{x:.1}")),
        rates.map_or("n/a".into(), |(_, c)| format!("{c:.1}")),
        pause_tiny.map_or("n/a".into(), |x| format!("{x:.3}")),
        prefix_ratio.map_or(String::new(), |(g, _)| format!("_g{g}")),
        prefix_ratio.map_or("n/a".into(), |(_, r)| format!("{r:.3}")),
        sampling.map_or("n/a".into(), |x| format!("{x:.2}")),
        rss.map_or("n/a".into(), |x| format!("{x:.0}")),
    );
    Ok(ExitCode::SUCCESS)
}

/// `--concurrency`: requests in flight, 1 to 65,536 (0 measured nothing and was refused in the
/// words of a KV cache of 0 bytes).
fn concurrency(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if (1..=65_536).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected requests in flight, 1 to 65536, got `{text}`"
        )),
    }
}
