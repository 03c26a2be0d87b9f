//! `sluice bench reward-model`: a reward model scoring conversations one forward each (as the
//! rubric's `reward_model` function scores them) against all of them packed into one forward
//! (what a batching scorer would do), the same conversations and model in one run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use sluice_core::Message;
use sluice_model::RewardModel;
use sluice_model::presets::{Preset, preset_config, write_reward_preset};

use crate::median;

/// `sluice bench reward-model`
#[derive(Debug, clap::Args)]
pub struct BenchRewardModelArgs {
    /// The reward model's directory (a one-label sequence classifier); default: the tiny preset
    /// as a reward model, written to a temporary directory.
    #[arg(long = "model", value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Conversations scored each round (1–4096).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub conversations: u16,
    /// Rounds timed each way; the median is reported (1–100).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub rounds: u8,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    pub device: sluice_config::Device,
}

/// Question-and-answer conversations of varied lengths, as a math rubric sees them.
fn conversations(n: usize) -> Vec<Vec<Message>> {
    (0..n)
        .map(|i| {
            let (a, b) = (17 + 31 * i, 5 + 7 * i);
            let reply = format!(
                "{a} plus {b}: add the ones, then the tens{}. #### {}",
                ", carrying one".repeat(i % 4),
                a + b
            );
            vec![
                Message::system("Answer the question; end with #### and the number."),
                Message::user(format!("What is {a} + {b}?")),
                Message::assistant(reply),
            ]
        })
        .collect()
}

/// Runs the benchmark and prints a table and the `RESULT reward-model` line.
pub fn run(args: &BenchRewardModelArgs) -> anyhow::Result<ExitCode> {
    let scratch = tempfile::tempdir()?;
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let dir = scratch.path().join("reward-model");
            let hidden = preset_config(Preset::Tiny).hidden_size;
            let head: Vec<f32> = (0..hidden).map(|i| (i % 7) as f32 * 0.01 - 0.03).collect();
            write_reward_preset(Preset::Tiny, &dir, 0, &head)?;
            dir
        }
    };
    let device = sluice_model::device(args.device)?;
    let model = RewardModel::load(&dir, &device)?;
    let tokens: Vec<Vec<u32>> = conversations(usize::from(args.conversations))
        .iter()
        .map(|c| model.tokens(c))
        .collect::<Result<_, _>>()?;
    let n = tokens.len();
    let total: usize = tokens.iter().map(Vec::len).sum();
    // Warm: the allocator, the thread pool and any lazily built tables.
    let alone: Vec<f32> = tokens
        .iter()
        .map(|t| model.score_tokens(std::slice::from_ref(t)).map(|s| s[0]))
        .collect::<Result<_, _>>()?;
    let packed = model.score_tokens(&tokens)?;
    let disagreement = alone
        .iter()
        .zip(&packed)
        .map(|(a, p)| (a - p).abs())
        .fold(0.0f32, f32::max);
    let mut one_each = Vec::new();
    let mut together = Vec::new();
    for _ in 0..args.rounds {
        let start = Instant::now();
        for t in &tokens {
            model.score_tokens(std::slice::from_ref(t))?;
        }
        one_each.push(start.elapsed().as_secs_f64());
        let start = Instant::now();
        model.score_tokens(&tokens)?;
        together.push(start.elapsed().as_secs_f64());
    }
    let (one_each, together) = (median(one_each), median(together));
    let per = |s: f64| s * 1e3 / n as f64;
    println!(
        "reward model {} ({} layers, hidden {}): {n} conversations, {:.1} tokens each on average, {} rounds on {}",
        dir.display(),
        model.config().num_layers,
        model.config().hidden_size,
        total as f64 / n as f64,
        args.rounds,
        args.device,
    );
    println!(
        "{:<28} {:>14} {:>12}",
        "scoring", "ms/conversation", "tokens/s"
    );
    println!(
        "{:<28} {:>14.2} {:>12.0}",
        "one forward each",
        per(one_each),
        total as f64 / one_each
    );
    println!(
        "{:<28} {:>14.2} {:>12.0}",
        format!("{n} packed in one forward"),
        per(together),
        total as f64 / together
    );
    println!(
        "RESULT reward-model conversations={n} tokens_mean={:.1} one_ms={:.3} packed_ms={:.3} packed_speedup={:.3} max_abs_diff={disagreement:.2e}",
        total as f64 / n as f64,
        per(one_each),
        per(together),
        one_each / together,
    );
    Ok(ExitCode::SUCCESS)
}
