//! `sluice run CONFIG [--set k=v]...`: run a whole pipeline from a config, with a progress bar
//! (step, samples/s, mean lag, buckets) and a summary at the end. Ctrl-C stops it cleanly: the
//! replay store commits what it holds and the next run on the same output dir resumes.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sluice_actors::supervise_node::StopReport;
use sluice_actors::{Node, NodeOptions, NodeStatus};
use sluice_core::config::{Config, EngineBackend};

use super::shutdown_signal;
use crate::cli::ConfigArgs;

/// Loads the config and runs the node until `run.max_steps` training steps are done.
pub fn run(args: &ConfigArgs) -> anyhow::Result<ExitCode> {
    let config = sluice_core::config::load(&args.config, &args.overrides)?;
    let simulated = config.engine.backend == EngineBackend::Simulated;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    if simulated {
        runtime.block_on(run_node(&config))
    } else {
        runtime.block_on(super::run_native::run(&config))
    }
}

async fn run_node(config: &Config) -> anyhow::Result<ExitCode> {
    let options = NodeOptions {
        replay_dir: Some(config.replay.path.clone()),
        serve_admin: true,
        serve_metrics: config.metrics.enabled,
        ..NodeOptions::default()
    };
    let node = Node::start(config, options).await?;
    if let Some(addr) = node.admin_addr() {
        tracing::info!(%addr, "admin API listening");
    }
    let started = Instant::now();
    let bar = ProgressBar::new(config.run.max_steps.get());
    bar.set_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let wait = node.wait_done(Duration::from_secs(365 * 24 * 3600), |s| {
        bar.set_position(s.trainer.steps);
        bar.set_message(progress_line(s, started.elapsed().as_secs_f64()));
    });
    let outcome = tokio::select! {
        r = wait => Some(r),
        _ = shutdown_signal() => None,
    };
    bar.finish_and_clear();
    let Some(outcome) = outcome else {
        return interrupted(node, config, started).await;
    };
    node.shutdown().await;
    match outcome {
        Ok(s) => {
            print_summary(&s, started.elapsed().as_secs_f64());
            match &s.trainer.error {
                Some(e) => bail!("training failed: {e}"),
                None => Ok(ExitCode::SUCCESS),
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// SIGINT/SIGTERM on a simulated run: the graceful stop, then the summary.
async fn interrupted(node: Node, config: &Config, started: Instant) -> anyhow::Result<ExitCode> {
    let status = node.status().await.ok();
    let Some(report) = graceful_stop(node, config).await? else {
        return Ok(ExitCode::from(130));
    };
    if let Some(mut s) = status {
        if let Some(replay) = report.final_replay.clone() {
            s.replay = replay;
        }
        print_summary(&s, started.elapsed().as_secs_f64());
    }
    report_stop(&report, config)
}

/// The graceful stop after a first SIGINT/SIGTERM: stop admitting, store in-flight partials as
/// aborted, checkpoint, bounded by `supervision.shutdown_timeout_s`. A second signal exits at
/// once (`None`; the replay store keeps every acknowledged group either way).
pub(super) async fn graceful_stop(
    node: Node,
    config: &Config,
) -> anyhow::Result<Option<StopReport>> {
    eprintln!(
        "stopping: storing in-flight rollouts and writing a checkpoint (signal again to exit now)"
    );
    let bound = config.supervision.shutdown_timeout + Duration::from_secs(5);
    tokio::select! {
        r = tokio::time::timeout(bound, node.stop_gracefully()) => match r {
            Ok(report) => Ok(Some(report)),
            Err(_) => bail!("the graceful stop did not finish within {bound:?}"),
        },
        _ = shutdown_signal() => {
            eprintln!("second signal: exiting without a checkpoint");
            Ok(None)
        }
    }
}

/// Says where the stop left the run's state; an incomplete stop is an error.
pub(super) fn report_stop(report: &StopReport, config: &Config) -> anyhow::Result<ExitCode> {
    match (&report.checkpoint, &report.checkpoint_dir) {
        (Some(m), Some(dir)) => eprintln!(
            "stopped in {:.2} s: checkpoint v{} at step {} under {}; restart with the same config to resume",
            report.seconds,
            m.version,
            m.steps,
            dir.display()
        ),
        _ => eprintln!(
            "stopped in {:.2} s; replay store under {}",
            report.seconds,
            config.replay.path.display()
        ),
    }
    match &report.error {
        Some(e) => bail!("the graceful stop was incomplete: {e}"),
        None => Ok(ExitCode::SUCCESS),
    }
}

fn progress_line(s: &NodeStatus, wall: f64) -> String {
    let b = &s.replay.buckets;
    format!(
        "| {:.0} samples/s | mean lag {:.2} | v{} | in flight {} | completed {} aborted {} expired {} filtered {}",
        s.trainer.trained_samples as f64 / wall.max(1e-9),
        s.trainer.mean_lag(),
        s.trainer.version.0,
        s.controller.in_flight,
        b["completed"],
        b["aborted"],
        b["expired"],
        b["filtered"],
    )
}

fn print_summary(s: &NodeStatus, wall: f64) {
    let t = &s.trainer;
    println!("steps                 {}", t.steps);
    println!("policy version        {}", t.version.0);
    println!("wall time             {wall:.2} s");
    println!(
        "trained samples       {} ({:.1}/s)",
        t.trained_samples,
        t.trained_samples as f64 / wall.max(1e-9)
    );
    println!("trained tokens        {}", t.trained_tokens);
    println!(
        "version lag           mean {:.3}, max {} (violations {})",
        t.mean_lag(),
        t.max_lag,
        t.lag_violations
    );
    println!("engine busy ratio     {:.3}", s.engine_busy_ratio());
    println!("trainer idle ratio    {:.3}", t.idle_ratio());
    println!(
        "discarded tokens      {}",
        s.replay.counters.discarded_tokens
    );
    let buckets: Vec<String> = s
        .replay
        .buckets
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    println!("buckets               {}", buckets.join(" "));
}
