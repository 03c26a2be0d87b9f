//! `sluice run CONFIG [--set k=v]...`: runs a whole pipeline from a config, whatever its
//! `engine.backend`, through the run's lifecycle in `sluice_node::run` (this file parses and
//! renders). A real model (`native`, `remote`) is prepared first: created when absent,
//! warm-started on a fresh run, evaluated on its held-out split before RL. The node then trains
//! while the run monitor logs every step to `metrics.jsonl` (and `progress.png` at the end),
//! evaluates on schedule and stops at `run.max_steps` or the held-out target. Ctrl-C stops it
//! cleanly: in-flight rollouts are stored, a checkpoint is written, and the same command resumes.

use std::process::ExitCode;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sluice_config::{Config, NodeRole, WarmupProbeSet};
use sluice_node::NodeStatus;
use sluice_node::graceful_stop::StopReport;
use sluice_node::run::{Ending, Finished, PreparedRun, Progress, RunSummary, Scores, Watched};
use sluice_replay::Bucket;

use super::shutdown_signal;
use crate::cli::ConfigArgs;

/// Loads the config and runs the node until the run ends.
pub fn run(args: &ConfigArgs) -> anyhow::Result<ExitCode> {
    let config = sluice_config::load(&args.config, &args.overrides)?;
    for note in config.advisories() {
        tracing::warn!("{note}");
    }
    // An engine or env node serves and joins its head; it runs no pipeline.
    if let Some(node) = &config.node
        && node.role != NodeRole::Head
    {
        return super::node::run(&config, node);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_config(&config))
}

fn bar(len: u64, template: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// Readies the run, rendering the warm-up's steps and what the preparation did.
async fn prepare(config: &Config) -> anyhow::Result<PreparedRun> {
    let warm = bar(
        config.warmup.max_steps.get(),
        "warm-up {bar:30} {pos}/{len} {msg}",
    );
    let max_steps = config.warmup.max_steps.get();
    let prepared = sluice_node::run::prepare(config, |p| {
        let line = format!(
            "loss {:.3} | probe accuracy {}",
            p.loss,
            per_domain(p.accuracy, p.domains.iter().map(|(d, a)| (d.as_str(), *a)))
        );
        if warm.is_hidden() {
            println!("warm-up step {}/{max_steps} {line}", p.step);
        }
        warm.set_position(p.step);
        warm.set_message(line);
    })
    .await?;
    warm.finish_and_clear();
    if let Some(n) = &prepared.native {
        if n.created_model {
            println!(
                "created a {} model in {}",
                config.model.init_preset.map_or("", |p| p.name()),
                config.model.path.display()
            );
        }
        if let Some(w) = &n.warmup {
            let probed = match config.warmup.probe {
                WarmupProbeSet::Train => "accuracy on training problems",
                WarmupProbeSet::Heldout => "held-out accuracy",
            };
            println!(
                "warm-up: {} supervised steps, {probed} {}",
                w.steps,
                per_domain(
                    w.probe_accuracy,
                    w.domains.iter().map(|(d, a)| (d.as_str(), *a))
                )
            );
        }
        if let Some(a) = &prepared.baseline {
            println!(
                "before RL: held-out accuracy {} ({} problems of {}), training problems {}",
                heldout(a),
                n.evaluations.heldout_len(),
                n.evaluations.describe(),
                train(a)
            );
        }
    }
    Ok(prepared)
}

/// The run's lifecycle (`sluice_node::run`: prepare, start, watch, finish), rendered.
async fn run_config(config: &Config) -> anyhow::Result<ExitCode> {
    // A stop before RL (model creation, warm-up, the baseline) has nothing to checkpoint: it
    // ends there, and the same command starts again (a finished warm-up is kept).
    let prepared = tokio::select! {
        prepared = prepare(config) => prepared?,
        () = shutdown_signal() => {
            eprintln!("stopped before RL began; the same command starts again (a finished warm-up is kept)");
            return Ok(ExitCode::from(130));
        }
    };
    if let Some(why) = prepared.ended() {
        println!("{why}");
        return Ok(ExitCode::SUCCESS);
    }
    let mut run = prepared.start(config).await?;
    let node = run.node();
    if let Some(addr) = node.admin_addr() {
        tracing::info!(%addr, "admin API listening");
    }
    if let Some(addr) = node.metrics_addr() {
        println!("Prometheus metrics on http://{addr}/metrics");
    }
    let first_step = node.start_step();
    if run.resumed_scores()
        && let Some(a) = run.start_scores().cloned()
        && let Some(e) = run.evaluations()
    {
        println!(
            "resumed at step {first_step}: held-out accuracy {} ({} problems of {}), training problems {}",
            heldout(&a),
            e.heldout_len(),
            e.describe(),
            train(&a)
        );
    }
    let evaluating = run.evaluating();
    let progress = bar(
        config.run.max_steps.get(),
        "{bar:30} step {pos}/{len} {msg}",
    );
    progress.set_position(first_step);
    let watched = run
        .watch(|p| show(&progress, p, evaluating), shutdown_signal())
        .await;
    progress.finish_and_clear();
    if matches!(watched, Watched::StopAsked) {
        eprintln!(
            "stopping: storing in-flight rollouts and writing a checkpoint (signal again to exit now)"
        );
    }
    let finished = run.finish(watched, shutdown_signal()).await?;
    render_finished(finished, config)
}

/// The run's summary, where its log and plot are, and its exit code.
fn render_finished(f: Finished, config: &Config) -> anyhow::Result<ExitCode> {
    let Some(plot) = &f.plot_path else {
        eprintln!(
            "second signal: exiting before the stop's checkpoint (the last checkpoint written stands)"
        );
        return Ok(ExitCode::from(130));
    };
    match (f.evaluating, &f.status) {
        (true, _) => print_model_summary(&f.summary, f.start_scores.as_ref(), f.status.as_ref()),
        (false, Some(s)) => print_summary(s, &f.summary),
        (false, None) => {}
    }
    println!("metrics               {}", f.log_path.display());
    println!("plot                  {}", plot.display());
    if let Some((dir, step)) = &f.target_model {
        println!("model at target       {} (step {step})", dir.display());
    }
    match f.ending {
        Ending::MonitorFailed(e) => Err(e.into()),
        Ending::Ended(end) => match end.error() {
            Some(e) => Err(e.into()),
            None => Ok(ExitCode::SUCCESS),
        },
        Ending::FinalCheckpointFailed(end, e) => {
            let saved = match f.status.as_ref().and_then(|s| s.checkpoint.as_ref()) {
                Some(m) => format!("the last checkpoint on disk is step {}", m.steps),
                None => "no checkpoint is on disk".to_owned(),
            };
            match end.error() {
                Some(failed) => bail!("{failed}; and its final checkpoint failed: {e}"),
                None => bail!(
                    "the run ended, but its final checkpoint failed ({saved}; the steps after it are lost): {e}"
                ),
            }
        }
        Ending::Stopped(report) => report_stop(&report, config),
        Ending::Abandoned => Ok(ExitCode::from(130)),
    }
}

/// The progress bar's line; without a terminal (logs, CI) the bar is hidden and a real model's
/// run prints one line per evaluation instead.
fn show(bar: &ProgressBar, p: &Progress<'_>, evaluating: bool) {
    bar.set_position(p.step);
    if !evaluating {
        bar.set_message(progress_line(p.status));
        return;
    }
    let heldout = p.domains.iter().map(|d| (d.domain.as_str(), d.heldout));
    let line = format!(
        "| reward {:.2} | eval {} (train {:.1}%) | lag {:.2} | {:.0} tok/s",
        p.reward_smoothed.unwrap_or(0.0),
        per_domain(p.accuracy.0, heldout),
        100.0 * p.accuracy.1,
        p.version_lag_mean,
        p.tokens_per_s
    );
    if bar.is_hidden() && p.evaluated {
        println!("step {}/{} {:.0}s {line}", p.step, p.max_steps, p.wall_s);
    }
    bar.set_message(line);
}

/// Says where the stop left the run's state; an incomplete stop is an error.
fn report_stop(report: &StopReport, config: &Config) -> anyhow::Result<ExitCode> {
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
    if report.in_flight_left > 0 {
        eprintln!(
            "{} groups were still in flight (an env or engine call that did not come back in time): the replay store keeps them, and the resume takes them back as aborted",
            report.in_flight_left
        );
    }
    match &report.error {
        Some(e) => bail!("the graceful stop was incomplete: {e}"),
        None => Ok(ExitCode::SUCCESS),
    }
}

/// The progress line: the trainer's samples a second since this process started it (what its
/// status counts), the lag and the store's buckets.
fn progress_line(s: &NodeStatus) -> String {
    let b = &s.replay.buckets;
    format!(
        "| {:.0} samples/s | mean lag {:.2} | v{} | in flight {} | completed {} aborted {} expired {} filtered {}",
        s.trainer.trained_samples as f64 / s.trainer.uptime_seconds.max(1e-9),
        s.trainer.mean_lag(),
        s.trainer.version.0,
        s.controller.in_flight,
        b[&Bucket::Completed],
        b[&Bucket::Aborted],
        b[&Bucket::Expired],
        b[&Bucket::Filtered],
    )
}

/// The summary of a run without evaluations. Steps, the version, the wall time and discarded
/// tokens are the whole run's; what the trainer counted (samples, tokens, lags) is this start's,
/// and said so after a resume.
fn print_summary(s: &NodeStatus, r: &RunSummary) {
    let t = &s.trainer;
    let this_start = r.wall_s - r.start.wall_s;
    let (since, wall_since) = if r.start.resumed {
        (
            format!(" since the resume at step {}", r.start.step),
            format!(" ({this_start:.2} s since the resume)"),
        )
    } else {
        (String::new(), String::new())
    };
    println!("steps                 {}", t.steps);
    println!("policy version        {}", t.version.0);
    println!("wall time             {:.2} s{wall_since}", r.wall_s);
    println!(
        "trained samples       {}{since} ({:.1}/s)",
        t.trained_samples,
        t.trained_samples as f64 / this_start.max(1e-9)
    );
    println!("trained tokens        {}{since}", t.trained_tokens);
    println!(
        "version lag           mean {:.3}, max {} (violations {}){since}",
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

/// `42.0%`, or with several domains `42.0% (math 50.0%, tools 34.0%)`.
fn per_domain<'a>(mean: f64, domains: impl ExactSizeIterator<Item = (&'a str, f64)>) -> String {
    let mean = format!("{:.1}%", 100.0 * mean);
    if domains.len() < 2 {
        return mean;
    }
    let each: Vec<String> = domains
        .map(|(d, a)| format!("{d} {:.1}%", 100.0 * a))
        .collect();
    format!("{mean} ({})", each.join(", "))
}

fn heldout(s: &Scores) -> String {
    per_domain(
        s.heldout,
        s.domains.iter().map(|d| (d.domain.as_str(), d.heldout)),
    )
}

fn train(s: &Scores) -> String {
    per_domain(
        s.train,
        s.domains.iter().map(|d| (d.domain.as_str(), d.train)),
    )
}

/// The summary of a real model's run: accuracy from start to end, per domain when there are
/// several.
fn print_model_summary(r: &RunSummary, start: Option<&Scores>, status: Option<&NodeStatus>) {
    let from = if r.start.resumed {
        format!("(at step {}) ", r.start.step)
    } else {
        String::new()
    };
    println!("steps                 {}", r.steps);
    println!("wall time             {:.1} s", r.wall_s);
    println!(
        "held-out accuracy     {from}{:.1}% → {:.1}% (best {:.1}%)",
        100.0 * r.start.accuracy.0,
        100.0 * r.last_accuracy.0,
        100.0 * r.best_accuracy
    );
    println!(
        "training problems     {from}{:.1}% → {:.1}%",
        100.0 * r.start.accuracy.1,
        100.0 * r.last_accuracy.1
    );
    if r.last_domains.len() > 1 {
        for d in &r.last_domains {
            let before = start
                .and_then(|s| s.domains.iter().find(|b| b.domain == d.domain))
                .map_or_else(String::new, |b| format!("{:.1}% → ", 100.0 * b.heldout));
            println!(
                "  {:<20}{from}{before}{:.1}% held-out, {:.1}% training",
                d.domain,
                100.0 * d.heldout,
                100.0 * d.train
            );
        }
    }
    if let Some((step, at)) = r.reached_target_at {
        println!("target reached        at step {step}, {at:.1} s");
    }
    if let Some(s) = status {
        println!(
            "version lag           mean {:.3}, max {} (violations {})",
            s.trainer.mean_lag(),
            s.trainer.max_lag,
            s.trainer.lag_violations
        );
        println!("engine busy ratio     {:.3}", s.engine_busy_ratio());
    }
}
