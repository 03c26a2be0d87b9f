//! `sluice run CONFIG [--set k=v]...`: runs a whole pipeline from a config, whatever its
//! `engine.backend`. A real model (`native`, `remote`) is prepared first: created when absent,
//! warm-started on a fresh run, evaluated on its held-out split before RL. The node then trains
//! while the run monitor logs every step to `metrics.jsonl` (and `progress.png` at the end),
//! evaluates on schedule and stops at `run.max_steps` or the held-out target. Ctrl-C stops it
//! cleanly: in-flight rollouts are stored, a checkpoint is written, and the same command resumes.

use std::process::ExitCode;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sluice_actors::trainer::STEP_FEED_CAPACITY;
use sluice_config::{Config, EngineBackend, NodeRole};
use sluice_node::cluster::Head;
use sluice_node::run::{NativeRun, Progress, RunMonitor, RunSummary, Scores, Start};
use sluice_node::supervise_node::StopReport;
use sluice_node::{Node, NodeOptions, NodeStatus};
use sluice_replay::Bucket;
use sluice_report::{METRICS_FILE, MetricsLog, PLOT_FILE, plot_run, read_log};

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

/// Prepares a real model's run: the model, the data and the warm-start, with their lines.
async fn prepare(config: &Config) -> anyhow::Result<NativeRun> {
    let warm = bar(
        config.warmup.max_steps.get(),
        "warm-up {bar:30} {pos}/{len} {msg}",
    );
    let max_steps = config.warmup.max_steps.get();
    let prepared = NativeRun::prepare(config, |p| {
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
    if prepared.created_model {
        println!(
            "created a {} model in {}",
            config.model.init_preset.map_or("", |p| p.name()),
            config.model.path.display()
        );
    }
    if let Some(w) = &prepared.warmup {
        println!(
            "warm-up: {} supervised steps, accuracy on training problems {}",
            w.steps,
            per_domain(
                w.probe_accuracy,
                w.domains.iter().map(|(d, a)| (d.as_str(), *a))
            )
        );
    }
    Ok(prepared)
}

async fn run_config(config: &Config) -> anyhow::Result<ExitCode> {
    // The run's wall time includes creating the model, the warm-up and the first evaluation.
    let started = std::time::Instant::now();
    let out = &config.run.output_dir;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut native = match config.engine.backend {
        EngineBackend::Simulated => None,
        EngineBackend::Native | EngineBackend::Remote => Some(prepare(config).await?),
    };
    // A fresh real-model run's baseline is measured before RL starts; a resumed run's, on the
    // restored weights once the node has loaded them.
    let fresh_start = match &mut native {
        Some(n) if n.resumed.is_none() => {
            let a = n
                .evaluations
                .run(std::sync::Arc::clone(&n.setup.weights))
                .await?;
            println!(
                "before RL: held-out accuracy {} ({} problems of {}), training problems {}",
                heldout(&a),
                n.evaluations.heldout_len(),
                n.evaluations.describe(),
                train(&a)
            );
            Some(a)
        }
        _ => None,
    };
    let (feed, steps) = tokio::sync::mpsc::channel(STEP_FEED_CAPACITY);
    let (setup, source, evaluations) = match native {
        Some(n) => (Some(n.setup), Some(n.source), Some(n.evaluations)),
        None => (None, None, None),
    };
    // A head runs its engine replicas on the engine nodes that join it.
    // Its domains with `env_nodes` run their training episodes on the env nodes that join it.
    let (head, head_factory, head_env) = match (&setup, config.node.as_ref().map(|n| n.role)) {
        (Some(setup), Some(NodeRole::Head)) => {
            let (head, factory) = Head::start(config, setup)?;
            let env = head
                .rollout_env(config, setup)?
                .map(|e| std::sync::Arc::new(e) as _);
            (Some(head), Some(factory), env)
        }
        _ => (None, None, None),
    };
    let options = NodeOptions {
        replay_dir: Some(config.replay.path.clone()),
        serve_admin: true,
        serve_metrics: config.metrics.enabled,
        backend: head_factory,
        cluster: head.as_ref().map(Head::state),
        env: head_env,
        native: setup,
        source: source.map(|s| Box::new(s) as _),
        step_feed: Some(feed),
        ..NodeOptions::default()
    };
    let node = Node::start(config, options).await?;
    if let Some(addr) = node.admin_addr() {
        tracing::info!(%addr, "admin API listening");
    }
    if let Some(addr) = node.metrics_addr() {
        println!("Prometheus metrics on http://{addr}/metrics");
    }
    let first_step = node.start_step();
    let log_path = out.join(METRICS_FILE);
    // The steps after the checkpoint are trained again: their old records go.
    let log = MetricsLog::resume(&log_path, first_step)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let start = Start {
        step: first_step,
        wall_s: log.last().map_or(0.0, |r| r.wall_s),
        accuracy: fresh_start.as_ref().map(Scores::pair).unwrap_or_default(),
        resumed: first_step > 0,
    };
    let evaluating = evaluations.is_some();
    let mut monitor = RunMonitor::new(config, started, start, steps, Some(log), evaluations);
    if let Some(a) = &fresh_start {
        monitor.start_scores(a);
    }
    let mut start_scores = fresh_start;
    if evaluating && start_scores.is_none() {
        let a = monitor
            .evaluate_start(node.start_weights())
            .await?
            .context("the restored trainer has no weights to evaluate")?;
        let e = monitor.evaluations().context("evaluations")?;
        println!(
            "resumed at step {first_step}: held-out accuracy {} ({} problems of {}), training problems {}",
            heldout(&a),
            e.heldout_len(),
            e.describe(),
            train(&a)
        );
        start_scores = Some(a);
    }
    let progress = bar(
        config.run.max_steps.get(),
        "{bar:30} step {pos}/{len} {msg}",
    );
    progress.set_position(first_step);
    let outcome = tokio::select! {
        r = monitor.watch(&node, |p| show(&progress, p, evaluating)) => Some(r),
        _ = shutdown_signal() => None,
    };
    progress.finish_and_clear();
    let mut status = node.status().await.ok();
    let stop = match &outcome {
        Some(Ok(end)) => {
            node.finish(end).await;
            node.shutdown().await;
            None
        }
        Some(Err(_)) => {
            // The monitor failed (an evaluation, the log): the run's state is kept all the same.
            if let Err(e) = node.handles.checkpoint().await {
                eprintln!("final checkpoint failed: {e}");
            }
            node.shutdown().await;
            None
        }
        None => match graceful_stop(node, config).await? {
            Some(report) => {
                if let (Some(s), Some(replay)) = (&mut status, report.final_replay.clone()) {
                    s.replay = replay;
                }
                Some(report)
            }
            None => return Ok(ExitCode::from(130)),
        },
    };
    // Steps trained while stopping are in the checkpoint: log them too.
    monitor.record_remaining()?;
    let plot = out.join(PLOT_FILE);
    let records = read_log(&log_path)?;
    plot_run(&records, &plot).with_context(|| format!("writing {}", plot.display()))?;
    let summary = monitor.summary();
    match (evaluating, &status) {
        (true, _) => print_model_summary(&summary, start_scores.as_ref(), status.as_ref()),
        (false, Some(s)) => print_summary(s, summary.wall_s),
        (false, None) => {}
    }
    println!("metrics               {}", log_path.display());
    println!("plot                  {}", plot.display());
    match (outcome, stop) {
        (Some(Err(e)), _) => Err(e.into()),
        (Some(Ok(end)), _) => match end.error() {
            Some(e) => Err(e.into()),
            None => Ok(ExitCode::SUCCESS),
        },
        (None, Some(report)) => report_stop(&report, config),
        (None, None) => Ok(ExitCode::SUCCESS),
    }
}

/// The progress bar's line; without a terminal (logs, CI) the bar is hidden and a real model's
/// run prints one line per evaluation instead.
fn show(bar: &ProgressBar, p: &Progress<'_>, evaluating: bool) {
    bar.set_position(p.step);
    if !evaluating {
        bar.set_message(progress_line(p.status, p.wall_s));
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

/// The graceful stop after a first SIGINT/SIGTERM: stop admitting, store in-flight partials as
/// aborted, checkpoint, bounded by `supervision.shutdown_timeout_s`. A second signal exits at
/// once (`None`; the replay store keeps every acknowledged group either way).
async fn graceful_stop(node: Node, config: &Config) -> anyhow::Result<Option<StopReport>> {
    eprintln!(
        "stopping: storing in-flight rollouts and writing a checkpoint (signal again to exit now)"
    );
    let bound = config.supervision.shutdown_timeout + std::time::Duration::from_secs(5);
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
        b[&Bucket::Completed],
        b[&Bucket::Aborted],
        b[&Bucket::Expired],
        b[&Bucket::Filtered],
    )
}

/// The summary of a run without evaluations.
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
