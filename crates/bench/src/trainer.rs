//! `sluice bench trainer`: whole RL training steps (advantages, packing, forward + backward,
//! AdamW, snapshot publish) in tokens/s for the presets or model directories (`--model DIR`) at
//! several `[B, L]`, and the packing
//! efficiency of the batcher on a realistic mix of prompt and completion lengths.
//!
//! Step throughput counts every non-padding token through forward and backward; each step here is
//! one micro-batch filled exactly (one text per row), so the optimizer and the publish copy are
//! paid once per `B · L` tokens, as in a run whose global batch is one micro-batch. Each shape
//! also prints where its steps went (the trainer's own [`StepParts`] clock; on a GPU from as many
//! more steps, each part waiting for the device at its end, since the device runs work after
//! the host issued it) and the process's peak resident memory while it ran (Linux: `VmHWM`,
//! reset per shape).
//!
//! With the tiny preset it also times the quickstart's own step (32 GRPO groups of 8 rollouts
//! of one 23-token prompt each, two updates) with the group's prompt packed once and with every
//! rollout packed alone (`trainer.share_prompts`), the two in turn, and prints their ratio.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use sluice_config::{AdvantageKind, LossAggregation, LossKind, ModelPreset, OversizedText};
use sluice_core::{
    DataSample, GroupId, NodeId, PolicyVersion, RolloutGroup, RolloutStatus, RolloutTurn, RunId,
};
use sluice_model::ForwardOptions;
use sluice_model::candle::{DType, Device};
use sluice_trainer::advantage::AdvantageConfig;
use sluice_trainer::batcher::{BatcherConfig, TrainingText, pack};
use sluice_trainer::loss::{Aggregation, LossConfig};
use sluice_trainer::optim::OptimConfig;
use sluice_trainer::{NativeTrainer, NativeTrainerConfig, StepParts};

use crate::subject::Subject;

/// `sluice bench trainer`
#[derive(Debug, clap::Args)]
pub struct BenchTrainerArgs {
    /// Presets to measure (repeatable; default: tiny and small unless `--model` is given).
    #[arg(long = "preset", value_parser = sluice_config::ModelPreset::parse_name)]
    pub presets: Vec<sluice_config::ModelPreset>,
    /// Model directories to measure with their own weights (repeatable); shapes default to
    /// those of the preset nearest in size.
    #[arg(long = "model", value_name = "DIR")]
    pub models: Vec<std::path::PathBuf>,
    /// Micro-batch shapes `BxL` (repeatable; default: a few per preset).
    #[arg(long = "shape", value_parser = parse_shape)]
    pub shapes: Vec<(usize, usize)>,
    /// Train on GRPO groups instead of rows of one text: per shape `B` groups of 8 replies of
    /// `A` tokens to one `P`-token prompt each (`PxA`, e.g. 90x40 for the SmolLM2 recipe's
    /// rows), packed as a run packs them, each prompt once for its group
    /// (`trainer.share_prompts`).
    #[arg(long, value_name = "PxA", value_parser = parse_group)]
    pub group: Option<(usize, usize)>,
    /// Recompute activations in the backward (`trainer.activation_checkpointing`).
    #[arg(long)]
    pub activation_checkpointing: bool,
    /// Where the trainer runs: `cpu` or `cuda:N` (a `cuda` build).
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    pub device: sluice_config::Device,
    /// The forward's products and activations (`trainer.compute_dtype`): `f32` or `bf16`;
    /// default as in a run, `bf16` on a GPU and `f32` on the CPU. Master weights stay f32.
    #[arg(long, value_parser = crate::parse_dtype)]
    pub compute_dtype: Option<sluice_config::DType>,
    /// Turn the CUDA profiler API's collection on for the timed steps only, so a profiler
    /// started with it off (`ncu --profile-from-start off`, as `scripts/gpu-check`'s profile
    /// part runs it) times their kernels and nothing else; no effect on the CPU.
    #[arg(long)]
    pub cuda_profile: bool,
    /// Take each layer's backward by candle's autograd over the forward's whole graph, as
    /// before it was written by hand: the yardstick of the hand-written backward.
    #[arg(long)]
    pub graph_backward: bool,
    /// Rows of the `(rows, vocab)` logits the log-prob/entropy head forms at a time, forward
    /// and backward (default: the trainer's).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub logits_chunk_rows: Option<u64>,
    /// MiB of the head's logits the forward keeps for the backward, which forms the rest
    /// again (`trainer.kept_logits_mib`; default as in a run on the device; 0 recomputes
    /// them all).
    #[arg(long, value_name = "MIB")]
    pub kept_logits_mib: Option<u64>,
    /// Timed steps per shape (default: a few per preset, sized for a few minutes on 2 cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: Option<u64>,
    /// Let the GPU's memory pool give freed memory back to the driver at every
    /// synchronisation (CUDA's default, and Sluice's until 2026-11-30), where a run keeps it
    /// mapped for the next step: the yardstick of keeping it; no effect on the CPU.
    #[arg(long)]
    pub release_freed_memory: bool,
    /// Train LoRA adapters of this rank on every projection (`trainer.lora_rank`, alpha twice
    /// the rank) in place of every weight.
    #[arg(long, value_name = "R", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub lora_rank: Option<u32>,
}

const PROMPT_TOKENS: usize = 16;

/// Default shapes and timed steps per preset, sized for a few minutes on 2 cores.
fn default_plan(preset: ModelPreset) -> (Vec<(usize, usize)>, usize) {
    match preset {
        ModelPreset::Tiny => (vec![(4, 64), (8, 128), (8, 512)], 3),
        ModelPreset::Small => (vec![(1, 128), (2, 256)], 1),
        ModelPreset::Medium => (vec![(4, 512)], 1),
    }
}

/// Runs the benchmark and prints a table and the `RESULT trainer` line.
pub fn run(args: &BenchTrainerArgs) -> anyhow::Result<ExitCode> {
    let subjects = Subject::list(&args.presets, &args.models);
    let mut result = Vec::new();
    for subject in &subjects {
        let name = subject.name();
        let (default_shapes, default_steps) = default_plan(subject.size_class()?);
        let steps = args.steps.map_or(default_steps, |n| n as usize);
        let shapes = if args.shapes.is_empty() {
            default_shapes
        } else {
            args.shapes.clone()
        };
        let config = subject.config()?;
        let compute = args.compute_dtype.unwrap_or(match args.device {
            sluice_config::Device::Cpu => sluice_config::DType::F32,
            sluice_config::Device::Cuda(_) => sluice_config::DType::Bf16,
        });
        println!(
            "{name}: {} parameters, f32 master weights on {}, {} compute, ppo, {steps} timed step(s) per shape{}{}{}{}{}",
            config.num_parameters(),
            args.device,
            compute,
            args.lora_rank.map_or(String::new(), |r| format!(
                ", LoRA adapters of rank {r} on every projection"
            )),
            args.group.map_or(String::new(), |(p, a)| format!(
                ", B groups of 8 {a}-token replies to a {p}-token prompt"
            )),
            if args.activation_checkpointing {
                ", activations recomputed"
            } else {
                ""
            },
            if args.graph_backward {
                ", the layers' backward by candle's autograd"
            } else {
                ""
            },
            if args.release_freed_memory {
                ", freed memory given back at each synchronisation"
            } else {
                ""
            }
        );
        let snapshot = subject.weights(0, DType::F32, &Device::Cpu)?;
        let device = sluice_model::device::device(args.device)?;
        sluice_model::device::release_freed_memory(&device, args.release_freed_memory)?;
        for (rows, len) in shapes {
            crate::rss::reset_peak();
            sluice_model::device::reset_peak_memory(&device);
            let mut settings = trainer_config(rows, len);
            settings.activation_checkpointing = args.activation_checkpointing;
            settings.device = args.device;
            settings.compute_dtype = sluice_model::config::candle_dtype(compute);
            if let Some(rows) = args.logits_chunk_rows {
                settings.logits_chunk_rows = rows as usize;
            }
            let kept = args.kept_logits_mib.unwrap_or_else(|| {
                let checkpointing = args.activation_checkpointing;
                sluice_trainer::config::default_kept_logits_mib(args.device, checkpointing)
            });
            settings.kept_logits_bytes = usize::try_from(kept)?.saturating_mul(1 << 20);
            settings.lora = args.lora_rank.map(|r| sluice_trainer::LoraConfig {
                rank: r as usize,
                alpha: 2.0 * f64::from(r),
                targets: sluice_trainer::lora::TARGETS.map(str::to_owned).to_vec(),
            });
            let mut trainer = NativeTrainer::new(Arc::clone(&snapshot), settings, None)?;
            trainer.set_graph_backward(args.graph_backward);
            let vocab = snapshot.config().vocab_size as u32;
            let batch = match args.group {
                Some((prompt, reply)) => (0..rows)
                    .map(|g| prompt_group(g, prompt, reply, vocab))
                    .collect::<anyhow::Result<Vec<_>>>()?,
                None => vec![filled_group(rows, len, vocab)?],
            };
            trainer.rl_step(&batch)?;
            let mut timed_steps = || -> anyhow::Result<(usize, f64, StepParts)> {
                let (mut tokens, mut seconds) = (0usize, 0.0f64);
                let mut parts = StepParts::default();
                for _ in 0..steps {
                    let start = Instant::now();
                    let (stats, _) = trainer.rl_step(&batch)?;
                    seconds += start.elapsed().as_secs_f64();
                    tokens += stats.processed_tokens;
                    parts.add(&stats.parts);
                }
                Ok((tokens, seconds, parts))
            };
            let (tokens, seconds, mut parts) = if args.cuda_profile {
                sluice_model::device::profiled(&device, timed_steps)??
            } else {
                timed_steps()?
            };
            let tok_s = tokens as f64 / seconds;
            let peak = crate::rss::peak_mib().map_or("n/a".to_owned(), |m| format!("{m:.0} MiB"));
            // On a GPU also the device memory's peak: the weights, AdamW's moments, the step's
            // activations and gradients, what the allocator held at once.
            let device_peak = sluice_model::device::peak_memory(&device)
                .map_or(String::new(), |b| {
                    format!("   device peak {:.0} MiB", b as f64 / (1u64 << 20) as f64)
                });
            println!(
                "  step [{rows}x{len}]  {tok_s:>10.0} tok/s   {:>8.3} s/step   peak RSS {peak}{device_peak}",
                seconds / steps as f64
            );
            // A GPU runs the work after the host issued it: the timed steps' parts are host
            // time, the device's landing on whichever part next read a result. The split comes
            // from as many more steps that wait for the device at each part's end.
            let mut split_seconds = seconds;
            let gpu = matches!(args.device, sluice_config::Device::Cuda(_));
            if gpu {
                trainer.set_sync_parts(true);
                (parts, split_seconds) = (StepParts::default(), 0.0);
                for _ in 0..steps {
                    let (stats, _) = trainer.rl_step(&batch)?;
                    split_seconds += stats.seconds;
                    parts.add(&stats.parts);
                }
            }
            let shares: Vec<String> = parts
                .named()
                .iter()
                .map(|(name, s)| format!("{name} {:.1}%", 100.0 * s / split_seconds))
                .collect();
            let how = if gpu {
                "   (device waited for per part)"
            } else {
                ""
            };
            println!("      {}{how}", shares.join("  "));
            result.push(format!("{name}_b{rows}_l{len}_tok_s={tok_s:.0}"));
        }
    }
    if subjects.contains(&Subject::Preset(ModelPreset::Tiny))
        && args.device == sluice_config::Device::Cpu
    {
        let (shared, alone) = quickstart_step(args.graph_backward)?;
        println!(
            "\nquickstart step (tiny, 32 groups of 8 rollouts, 23-token prompts, 6-token answers, 2 updates):\n  prompts shared {:.3} s/step   each rollout alone {:.3} s/step   speed-up {:.2}x",
            shared,
            alone,
            alone / shared
        );
        result.push(format!(
            "quickstart_step_shared_s={shared:.4} quickstart_step_alone_s={alone:.4} share_speedup={:.2}",
            alone / shared
        ));
    }
    println!(
        "\npacking, 512 texts: prompts uniform 64..512, completions lognormal (median 400, sigma 1) capped at 8192"
    );
    for (rows, len) in [(4usize, 2048usize), (4, 4096), (4, 8192)] {
        let (packed, naive, split) = packing_mix(rows, len);
        println!(
            "  [{rows}x{len}]  packed {:>5.1}%   one text per row {:>5.1}%   split texts {split}",
            100.0 * packed,
            100.0 * naive
        );
        result.push(format!("packing_l{len}={packed:.3}"));
    }
    println!("RESULT trainer {}", result.join(" "));
    Ok(ExitCode::SUCCESS)
}

fn trainer_config(rows: usize, len: usize) -> NativeTrainerConfig {
    NativeTrainerConfig {
        advantage: AdvantageConfig {
            kind: AdvantageKind::Group,
            ..AdvantageConfig::default()
        },
        loss: LossConfig::default(),
        aggregation: Aggregation::new(LossAggregation::TokenMean, 1),
        batcher: BatcherConfig {
            rows,
            row_len: len,
            oversized: OversizedText::Split,
            pad_id: 0,
            share_prompts: true,
        },
        optim: OptimConfig {
            learning_rate: 1e-5,
            ..OptimConfig::default()
        },
        minibatches: 1,
        publish_dtype: DType::F32,
        device: sluice_config::Device::Cpu,
        logits_chunk_rows: 1024,
        kept_logits_bytes: ForwardOptions::DEFAULT_KEPT_LOGITS_BYTES,
        temperature: 1.0,
        seed: 0,
        lora: None,
        kl_reward: None,
        critic: None,
        // The trainer alone on the machine: every core.
        threads: sluice_model::threads::role_threads(0, 1),
        activation_checkpointing: false,
        sync_parts: false,
        compute_dtype: DType::F32,
    }
}

/// One group whose first `rows` rollouts are single turns of exactly `len` slots, rewards
/// alternating. A 1-row shape gets a second rollout without completion tokens: it enters the
/// baseline (so the advantage is not zero) but makes no training text.
fn filled_group(rows: usize, len: usize, vocab: u32) -> anyhow::Result<RolloutGroup> {
    let mut group = bench_group(0, rows.max(2) as u32);
    let completion_len = (len + 1).saturating_sub(PROMPT_TOKENS).max(1);
    for (r, rollout) in group.rollouts.iter_mut().enumerate() {
        let tok = |i: usize| ((i * 7 + r * 13) as u32) % vocab;
        let mut turn = RolloutTurn::new((0..PROMPT_TOKENS).map(tok).collect());
        if r < rows {
            let completion: Vec<u32> = (PROMPT_TOKENS..PROMPT_TOKENS + completion_len)
                .map(tok)
                .collect();
            let n = completion.len();
            turn.append_tokens(
                &completion,
                &vec![-4.0; n],
                &vec![PolicyVersion::INITIAL; n],
            )?;
        }
        rollout.turns.push(turn);
        rollout.status = RolloutStatus::Completed;
        rollout.reward = (r % 2) as f64;
    }
    Ok(group)
}

/// An empty group of `size` rollouts on a synthetic sample, numbered `counter`.
fn bench_group(counter: u64, size: u32) -> RolloutGroup {
    let id = GroupId {
        run: RunId::from_name("bench"),
        node: NodeId(0),
        counter,
    };
    let sample = DataSample {
        id: counter.to_string(),
        domain: "bench".into(),
        dataset: "synthetic".into(),
        input: serde_json::Value::Null,
        system_prompt: None,
    };
    RolloutGroup::new(id, sample, size, PolicyVersion::INITIAL)
}

/// Seconds per RL step of the quickstart's shape with shared prompts and with every rollout
/// packed alone (`trainer.share_prompts`), the two trainers stepping in turn so the machine's
/// load falls on both alike. The settings of `configs/quickstart.toml`'s trainer, on one thread
/// (the layers' backward by candle's autograd with `graph_backward`).
fn quickstart_step(graph_backward: bool) -> anyhow::Result<(f64, f64)> {
    const STEPS: usize = 6;
    let snapshot = Subject::Preset(ModelPreset::Tiny).weights(0, DType::F32, &Device::Cpu)?;
    let vocab = snapshot.config().vocab_size as u32;
    let groups: Vec<RolloutGroup> = (0..32)
        .map(|g| prompt_group(g, 23, 6, vocab))
        .collect::<anyhow::Result<_>>()?;
    let mut trainers = Vec::new();
    for share in [true, false] {
        let mut settings = trainer_config(16, 128);
        settings.batcher.share_prompts = share;
        settings.minibatches = 2;
        settings.loss.kind = LossKind::DecoupledPpo;
        // One thread: the compute a step costs (in a run the engine has the other core).
        settings.threads = 1;
        let mut trainer = NativeTrainer::new(Arc::clone(&snapshot), settings, None)?;
        trainer.set_graph_backward(graph_backward);
        trainers.push(trainer);
    }
    let mut seconds = [0.0f64; 2];
    for step in 0..=STEPS {
        for (k, trainer) in trainers.iter_mut().enumerate() {
            let start = Instant::now();
            trainer.rl_step(&groups)?;
            // The first step of each warms up (allocator, pools): not timed.
            if step > 0 {
                seconds[k] += start.elapsed().as_secs_f64();
            }
        }
    }
    Ok((seconds[0] / STEPS as f64, seconds[1] / STEPS as f64))
}

/// A GRPO group: `G = 8` rollouts of one `prompt`-token prompt with `answer`-token completions
/// of their own, rewards alternating.
fn prompt_group(
    g: usize,
    prompt: usize,
    answer: usize,
    vocab: u32,
) -> anyhow::Result<RolloutGroup> {
    let mut group = bench_group(g as u64, 8);
    let tok = |i: usize| ((i as u32).wrapping_mul(2_654_435_761) >> 7) % vocab;
    let prompt_ids: Vec<u32> = (0..prompt).map(|i| tok(g * 1000 + i)).collect();
    for (r, rollout) in group.rollouts.iter_mut().enumerate() {
        let mut turn = RolloutTurn::new(prompt_ids.clone());
        let completion: Vec<u32> = (0..answer)
            .map(|i| tok(g * 1000 + r * 100 + 50 + i))
            .collect();
        turn.append_tokens(
            &completion,
            &vec![-2.0; answer],
            &vec![PolicyVersion::INITIAL; answer],
        )?;
        rollout.turns.push(turn);
        rollout.status = RolloutStatus::Completed;
        rollout.reward = (r % 2) as f64;
    }
    Ok(group)
}

/// Packing efficiency of the batcher and of one text per row on a synthetic length mix.
fn packing_mix(rows: usize, len: usize) -> (f64, f64, usize) {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut uniform = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut lens = Vec::new();
    for _ in 0..512 {
        let prompt = 64 + (uniform() * 448.0) as usize;
        // Box–Muller normal → lognormal.
        let z = (-2.0 * uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * uniform()).cos();
        let completion = ((400.0 * z.exp()) as usize).clamp(1, 8192);
        lens.push((prompt, completion));
    }
    // (prompt ids, completion ids, behaviour logprobs, versions) per text; the batcher borrows them.
    type TextBuffers = (Vec<u32>, Vec<u32>, Vec<f32>, Vec<u64>);
    let tokens: Vec<TextBuffers> = lens
        .iter()
        .map(|&(p, c)| (vec![1; p], vec![2; c], vec![0.0; c], vec![0; c]))
        .collect();
    let texts: Vec<TrainingText<'_>> = tokens
        .iter()
        .map(|(p, c, b, v)| TrainingText {
            prompt: p,
            completion: c,
            behaviour: b,
            versions: v,
            advantage: 1.0,
            weight: 1.0,
        })
        .collect();
    let config = BatcherConfig {
        rows,
        row_len: len,
        oversized: OversizedText::Split,
        pad_id: 0,
        // The length mix measures the packer alone.
        share_prompts: false,
    };
    let packing = pack(&texts, &config);
    let naive_rows: usize = lens.iter().map(|&(p, c)| (p + c - 1).div_ceil(len)).sum();
    let slots: usize = lens.iter().map(|&(p, c)| p + c - 1).sum();
    let naive = slots as f64 / (naive_rows.div_ceil(rows) * rows * len) as f64;
    (packing.stats.efficiency(), naive, packing.stats.split_texts)
}

fn parse_shape(s: &str) -> Result<(usize, usize), String> {
    parse_pair(s, "a shape BxL such as 8x512")
}

fn parse_group(s: &str) -> Result<(usize, usize), String> {
    parse_pair(s, "prompt and reply tokens PxA such as 90x40")
}

/// Two positive numbers joined by `x`.
fn parse_pair(s: &str, expected: &str) -> Result<(usize, usize), String> {
    let bad = || format!("expected {expected}, got `{s}`");
    let (b, l) = s.split_once('x').ok_or_else(bad)?;
    match (b.parse::<usize>(), l.parse::<usize>()) {
        (Ok(b), Ok(l)) if b > 0 && l > 0 => Ok((b, l)),
        _ => Err(bad()),
    }
}
