//! `sluice bench pipeline` and `sluice bench overhead`.
//!
//! **pipeline** runs one long-tail workload (the one of `configs/sim_longtail.toml`: lognormal
//! lengths, median 64, σ = 1.2 so p99 ≈ 16× the median; 32 concurrent sequences against 64
//! rollouts per step; step time `0.5 + 0.0001 · tokens` simulated seconds) in one process under:
//! sync (`max_version_lag = 0`, `staleness_threshold = 0`, `drain`), the five XTuner presets of
//! `configs/xtuner_*.toml`, and `in_flight` (η = 4, s = 4). It prints a table and a `RESULT` line.
//! The ideal is the time the engine would need for the trained tokens at its peak rate
//! (`max_running / (a + b · max_running)` tokens per simulated second).
//!
//! **overhead** pushes samples through the actors with an instant engine (one-token completions,
//! no simulated time) and an instant trainer, replay store in memory, and reports samples/s.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use sluice_config::Config;
use sluice_core::{Knobs, WeightUpdateMode};
use sluice_node::{Node, NodeOptions, NodeStatus};

/// `sluice bench pipeline` / `sluice bench overhead`
#[derive(Debug, clap::Args)]
pub struct BenchPipelineArgs {
    /// Training steps per mode (overhead: ×10), 1 to 1,000,000.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub steps: u64,
    /// Real seconds per simulated second, in (0, 1000] (`engine.simulated.time_scale`'s bound).
    #[arg(long, default_value_t = 0.1, value_parser = time_scale)]
    pub time_scale: f64,
}

/// `--time-scale`: a finite number in (0, 1000]. A huge one slept for ages; NaN gave ratios of
/// nothing.
fn time_scale(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1000.0 => Ok(v),
        _ => Err(format!(
            "expected real seconds per simulated second in (0, 1000], got `{text}`"
        )),
    }
}

const WORKLOAD: &str = include_str!("../../../configs/sim_longtail.toml");
const PRESETS: [(&str, &str); 5] = [
    (
        "xtuner_sync",
        include_str!("../../../configs/xtuner_sync.toml"),
    ),
    (
        "xtuner_async1",
        include_str!("../../../configs/xtuner_async1.toml"),
    ),
    (
        "xtuner_async2",
        include_str!("../../../configs/xtuner_async2.toml"),
    ),
    (
        "xtuner_async3",
        include_str!("../../../configs/xtuner_async3.toml"),
    ),
    (
        "xtuner_async4",
        include_str!("../../../configs/xtuner_async4.toml"),
    ),
];

fn parse(text: &str, name: &str) -> anyhow::Result<Config> {
    Ok(sluice_config::parse(text, name, &[], &|_| None)?)
}

fn workload(steps: u64, time_scale: f64, knobs: Knobs) -> anyhow::Result<Config> {
    let mut c = parse(WORKLOAD, "configs/sim_longtail.toml")?;
    c.run.max_steps = std::num::NonZeroU64::new(steps).context("--steps must be ≥ 1")?;
    c.engine.simulated.time_scale = time_scale;
    c.rollout.knobs = knobs;
    c.metrics.enabled = false;
    Ok(c)
}

struct Row {
    name: String,
    wall: f64,
    status: NodeStatus,
}

async fn measure(name: &str, config: &Config) -> anyhow::Result<Row> {
    let node = Node::start(
        config,
        NodeOptions {
            track_ids: false,
            ..NodeOptions::default()
        },
    )
    .await?;
    let start = Instant::now();
    let status = node.wait_done(Duration::from_secs(3600), |_| {}).await?;
    let wall = start.elapsed().as_secs_f64();
    node.shutdown().await;
    anyhow::ensure!(
        status.trainer.lag_violations == 0,
        "{name}: trained tokens past η"
    );
    Ok(Row {
        name: name.to_owned(),
        wall,
        status,
    })
}

/// Runs the pipeline benchmark.
pub fn pipeline(args: &BenchPipelineArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let base = parse(WORKLOAD, "configs/sim_longtail.toml")?;
        let sync = Knobs {
            max_version_lag: 0,
            staleness_threshold: 0.0,
            weight_update_mode: WeightUpdateMode::Drain,
            enable_partial_rollout: false,
            tail_batch_candidate_steps: 0,
            ..base.rollout.knobs.clone()
        };
        let mut modes: Vec<(String, Knobs)> = vec![("sync".into(), sync)];
        for (name, text) in PRESETS {
            modes.push((name.into(), parse(text, name)?.rollout.knobs));
        }
        let in_flight = Knobs { weight_update_mode: WeightUpdateMode::InFlight, ..base.rollout.knobs.clone() };
        modes.push(("in_flight".into(), in_flight));
        let sim = &base.engine.simulated;
        let cap = f64::from(base.engine.max_running_sequences.get()) * f64::from(base.engine.replicas.get());
        let peak = cap / (sim.decode_step_base_seconds + sim.decode_step_per_sequence_seconds * cap);
        let mut rows = Vec::new();
        for (name, knobs) in modes {
            let config = workload(args.steps, args.time_scale, knobs)?;
            eprintln!("running {name} ...");
            rows.push(measure(&name, &config).await?);
        }
        let sync_wall = rows[0].wall;
        println!(
            "{:<14} {:>8} {:>10} {:>8} {:>8} {:>8} {:>8} {:>7} {:>10} {:>7}",
            "mode", "wall_s", "samples/s", "speedup", "eng_busy", "trn_idle", "mean_lag", "max_lag", "discarded", "ideal"
        );
        let (mut best_speedup, mut best_busy, mut best_ideal) = (0.0f64, 0.0f64, 0.0f64);
        for r in &rows {
            let t = &r.status.trainer;
            let speedup = sync_wall / r.wall;
            let busy = r.status.engine_busy_ratio();
            let ideal = (t.trained_tokens as f64 / peak) * args.time_scale / r.wall;
            if r.name != "sync" && speedup > best_speedup {
                (best_speedup, best_busy, best_ideal) = (speedup, busy, ideal);
            }
            println!(
                "{:<14} {:>8.2} {:>10.1} {:>8.2} {:>8.3} {:>8.3} {:>8.3} {:>7} {:>10} {:>7.3}",
                r.name,
                r.wall,
                t.trained_samples as f64 / r.wall,
                speedup,
                busy,
                t.idle_ratio(),
                t.mean_lag(),
                t.max_lag,
                r.status.replay.counters.discarded_tokens,
                ideal
            );
        }
        println!("RESULT pipeline speedup_best={best_speedup:.2} engine_busy_best={best_busy:.3} ideal_ratio_best={best_ideal:.3}");
        Ok(ExitCode::SUCCESS)
    })
}

/// Runs the overhead benchmark.
pub fn overhead(args: &BenchPipelineArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let text = r#"
[run]
name = "overhead"
max_steps = 200
[engine]
backend = "simulated"
replicas = 2
max_running_sequences = 4096
[engine.simulated]
time_scale = 0.0
prompt_tokens = 1
env_reply_tokens = 0
[engine.simulated.lengths.default]
distribution = "fixed"
tokens = 1
[trainer.simulated]
step_base_seconds = 0.0
step_seconds_per_token = 0.0
[rollout]
group_size = 8
groups_per_step = 64
max_new_tokens = 4
max_version_lag = 2
staleness_threshold = 1.0
weight_update_mode = "in_flight"
[replay]
filter_zero_advantage = false
[metrics]
enabled = false
"#;
        let mut config = parse(text, "overhead")?;
        config.run.max_steps = std::num::NonZeroU64::new(args.steps.max(1) * 10).context("steps")?;
        let row = measure("overhead", &config).await?;
        let samples = row.status.trainer.trained_samples;
        println!("samples {samples} in {:.2} s through sampler → controller → engine → env → replay → trainer", row.wall);
        println!("RESULT overhead samples_per_s={:.0}", samples as f64 / row.wall);
        Ok(ExitCode::SUCCESS)
    })
}
