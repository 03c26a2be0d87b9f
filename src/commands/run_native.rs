//! `sluice run` on a real model (`engine.backend = "native"` or `"remote"`): create the model
//! when absent, warm-start it with a short supervised phase on a fresh run, then train with
//! async RL through the actors, evaluating on the held-out split as it goes. Writes
//! `metrics.jsonl` (one line per step) and `progress.png` into the run's output dir.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sluice_actors::native::tap::{TapHandle, TappedTrainer, lock_tap};
use sluice_actors::native::{
    Evaluator, NativeSetup, WarmupSettings, demonstrations, ensure_model_dir, warm_start,
};
use sluice_actors::{Node, NodeOptions, NodeStatus};
use sluice_core::config::{Config, DatasetSpec, LrSchedule};
use sluice_core::metrics::TRAINER_LOSS_VALUE;
use sluice_core::{DataSample, PolicyVersion, WeightSnapshot};
use sluice_data::{DatasetRows, MixSampler, SamplerConfig};
use sluice_engine::{NativeEngineParams, SamplingParams};
use sluice_env::Task;
use sluice_env::datasets::{GeneratedRows, load_datasets};
use sluice_model::{SaveOptions, copy_aux_files, save_checkpoint};
use sluice_report::{METRICS_FILE, MetricsLog, PLOT_FILE, StepRecord, plot_run, read_log};

use super::shutdown_signal;

/// Runs the native pipeline of `config` to the end (steps, target accuracy or a signal).
pub async fn run(config: &Config) -> anyhow::Result<ExitCode> {
    let out = config.run.output_dir.clone();
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    if ensure_model_dir(config)? {
        println!(
            "created a {} model in {}",
            config
                .model
                .init_preset
                .map(|p| format!("{p:?}").to_lowercase())
                .unwrap_or_default(),
            config.model.path.display()
        );
    }
    let started = Instant::now();
    let base = NativeSetup::load(config, None)?;
    let task = eval_task(config, &base)?;
    let warm_dir = out.join("warmup");
    if config.warmup.enabled && !warm_dir.join("config.json").exists() {
        warmup(config, &base, &task, &warm_dir).await?;
    }
    let setup = if warm_dir.join("config.json").exists() {
        NativeSetup::load(config, Some(&warm_dir))?
    } else {
        base
    };
    let mut evaluations = Evaluations::new(config, &setup, &task)?;
    let (start_accuracy, start_train_accuracy) =
        evaluations.run(Arc::clone(&setup.weights)).await?;
    println!(
        "before RL: held-out accuracy {:.1}% ({} problems of `{}`), training problems {:.1}%",
        100.0 * start_accuracy,
        evaluations.heldout.len(),
        task.name(),
        100.0 * start_train_accuracy
    );
    let (trainer, tap) = TappedTrainer::new(setup.trainer_backend(config, None)?);
    let source = sample_source(config, &setup)?;
    let options = NodeOptions {
        replay_dir: Some(config.replay.path.clone()),
        serve_admin: true,
        serve_metrics: config.metrics.enabled,
        backend: Some(setup.backend_factory(config, None)?),
        trainer: Some(Box::new(trainer)),
        source: Some(Box::new(source)),
        env: Some(Arc::new(setup.env(config))),
        ..NodeOptions::default()
    };
    let node = Node::start(config, options).await?;
    if let Some(addr) = node.admin_addr() {
        tracing::info!(%addr, "admin API listening");
    }
    if let Some(addr) = node.metrics_addr() {
        println!("Prometheus metrics on http://{addr}/metrics");
    }
    let log_path = out.join(METRICS_FILE);
    let mut log =
        MetricsLog::open(&log_path).with_context(|| format!("opening {}", log_path.display()))?;
    let mut monitor = Monitor::new(config, started, (start_accuracy, start_train_accuracy));
    let outcome = tokio::select! {
        r = monitor.watch(&node, &tap, &mut evaluations, &mut log) => Some(r),
        _ = shutdown_signal() => None,
    };
    monitor.bar.finish_and_clear();
    let status = node.status().await.ok();
    let stop = match outcome {
        Some(_) => {
            // The end of a run is a checkpoint too: the same config resumes from it.
            if let Err(e) = node.handles.checkpoint().await {
                eprintln!("final checkpoint failed: {e}");
            }
            node.shutdown().await;
            None
        }
        None => match super::run::graceful_stop(node, config).await? {
            Some(report) => Some(report),
            None => return Ok(ExitCode::from(130)),
        },
    };
    let plot = out.join(PLOT_FILE);
    let records = read_log(&log_path)?;
    plot_run(&records, &plot).with_context(|| format!("writing {}", plot.display()))?;
    print_summary(&monitor, status.as_ref(), &log_path, &plot);
    match (outcome, stop) {
        (Some(Err(e)), _) => Err(e),
        (_, Some(report)) => super::run::report_stop(&report, config),
        _ => Ok(ExitCode::SUCCESS),
    }
}

/// The task evaluated: `eval.task`, else the task serving the first dataset.
fn eval_task(config: &Config, setup: &NativeSetup) -> anyhow::Result<Arc<Task>> {
    let name = match (&config.eval.task, config.data.datasets.first()) {
        (Some(t), _) => t.clone(),
        (None, Some(spec)) => serving_task(config, spec).to_owned(),
        (None, None) => bail!("data.datasets is empty: a native run needs at least one dataset"),
    };
    setup
        .registry
        .get(&name)
        .with_context(|| format!("eval.task: no task named `{name}`"))
}

/// The task that runs `spec`'s rows: its domain's `task`, else the dataset's name.
fn serving_task<'c>(config: &'c Config, spec: &'c DatasetSpec) -> &'c str {
    config
        .data
        .domain_options
        .get(&spec.domain)
        .and_then(|d| d.task.as_deref())
        .unwrap_or(&spec.name)
}

/// The domain of the first dataset `task` serves (its rows get that domain's system prompt).
fn task_domain<'c>(config: &'c Config, task: &Task) -> &'c str {
    config
        .data
        .datasets
        .iter()
        .find(|d| serving_task(config, d) == task.name())
        .map_or("eval", |d| d.domain.as_str())
}

/// Puts warm-up and evaluation rows in `domain`, with its system prompt where they have none,
/// as the sampler does for training rows.
fn in_domain(config: &Config, domain: &str, mut samples: Vec<DataSample>) -> Vec<DataSample> {
    let prompt = config
        .data
        .domain_options
        .get(domain)
        .and_then(|d| d.system_prompt.clone());
    for s in &mut samples {
        s.domain = domain.to_owned();
        if s.system_prompt.is_none() {
            s.system_prompt.clone_from(&prompt);
        }
    }
    samples
}

fn engine_params(config: &Config, setup: &NativeSetup) -> NativeEngineParams {
    NativeEngineParams {
        max_running_sequences: 256,
        max_step_tokens: config.engine.max_step_tokens.get().max(4096) as usize,
        seed: config.run.seed,
        eos_token_ids: setup.tokenizer.eos_token_ids().to_vec(),
        ..NativeEngineParams::default()
    }
}

/// An evaluator of `task` on `samples` with the run's engine sizing and turn length.
fn evaluator(
    config: &Config,
    setup: &NativeSetup,
    task: &Arc<Task>,
    samples: Vec<DataSample>,
    temperature: f64,
) -> Evaluator {
    Evaluator::new(
        Arc::clone(task),
        samples,
        setup.renderer.clone(),
        setup.limits(config),
        engine_params(config, setup),
        Arc::clone(&setup.tokenizer),
        SamplingParams {
            temperature,
            top_p: 1.0,
            top_k: 0,
            max_tokens: config.rollout.max_new_tokens.get(),
            seed: Some(config.run.seed),
            stop_token_ids: Vec::new(),
        },
    )
}

/// The held-out split of `task`, in the run's domain for it.
fn heldout_samples(config: &Config, task: &Task) -> anyhow::Result<Vec<DataSample>> {
    let samples = task
        .eval_samples(config.run.seed, config.eval.samples.get() as usize)
        .with_context(|| format!("held-out samples of `{}`", task.name()))?;
    Ok(in_domain(config, task_domain(config, task), samples))
}

/// `count` problems of `task`'s training split (a fixed draw: the warm-up's demonstrations and
/// the training-accuracy probe).
fn training_samples(config: &Config, task: &Task, count: usize) -> anyhow::Result<Vec<DataSample>> {
    let domain = task_domain(config, task);
    let spec: DatasetSpec = format!("{domain}::{}@train", task.name())
        .parse()
        .map_err(anyhow::Error::msg)?;
    let train = task
        .generate_dataset(&spec, config.run.seed ^ 0x5f7, count)
        .with_context(|| format!("training problems of `{}`", task.name()))?;
    Ok(in_domain(config, domain, train.samples().to_vec()))
}

/// Greedy accuracy on the held-out split and on a fixed probe of training problems.
struct Evaluations {
    heldout: Evaluator,
    train: Evaluator,
}

impl Evaluations {
    fn new(config: &Config, setup: &NativeSetup, task: &Arc<Task>) -> anyhow::Result<Self> {
        let mut probe = training_samples(config, task, 4096)?;
        probe.truncate(config.warmup.probe_samples.get() as usize);
        Ok(Self {
            heldout: evaluator(
                config,
                setup,
                task,
                heldout_samples(config, task)?,
                config.eval.temperature,
            ),
            train: evaluator(config, setup, task, probe, config.eval.temperature),
        })
    }

    /// (held-out accuracy, training-probe accuracy) of `weights`.
    async fn run(
        &mut self,
        weights: Arc<sluice_model::WeightSnapshot>,
    ) -> anyhow::Result<(f64, f64)> {
        let heldout = self
            .heldout
            .evaluate(Arc::clone(&weights))
            .await
            .context("held-out evaluation")?;
        let train = self
            .train
            .evaluate(weights)
            .await
            .context("training-probe evaluation")?;
        Ok((
            heldout.report.accuracy.unwrap_or(0.0),
            train.report.accuracy.unwrap_or(0.0),
        ))
    }
}

fn sample_source(config: &Config, setup: &NativeSetup) -> anyhow::Result<MixSampler<DatasetRows>> {
    let seed = config.run.seed;
    let datasets = load_datasets(&config.data, &setup.registry, GeneratedRows::new(seed))
        .context("loading data.datasets")?;
    let rows = DatasetRows::new(datasets, seed);
    MixSampler::with_rows(SamplerConfig::from_data_config(&config.data, seed), rows)
        .context("data sampler")
}

/// Supervised warm-start on the task's reference replies; the result goes to `dir`.
async fn warmup(
    config: &Config,
    setup: &NativeSetup,
    task: &Arc<Task>,
    dir: &Path,
) -> anyhow::Result<()> {
    let w = &config.warmup;
    let samples = training_samples(config, task, 4096)?;
    let limits = setup.limits(config);
    let demos = demonstrations(task, &samples, &setup.renderer, &limits).await?;
    let probe_n = (w.probe_samples.get() as usize).min(samples.len());
    let mut probe = evaluator(config, setup, task, samples[..probe_n].to_vec(), 0.0);
    let mut sft = config.clone();
    sft.trainer.learning_rate = w.learning_rate;
    sft.trainer.lr_schedule = LrSchedule::Constant;
    sft.trainer.warmup_steps = 0;
    sft.trainer.kl_coef = 0.0;
    let trainer = NativeSetup::trainer(setup, &sft, None)?;
    let settings = WarmupSettings {
        max_steps: w.max_steps.get(),
        batch_size: w.batch_size.get() as usize,
        target_accuracy: w.target_accuracy,
        check_every: w.check_every.get(),
    };
    let bar = ProgressBar::new(settings.max_steps);
    bar.set_style(
        ProgressStyle::with_template("warm-up {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let (_, report) = warm_start(trainer, Arc::new(demos), &mut probe, &settings, |p| {
        let line = format!(
            "loss {:.3} | probe accuracy {:.1}%",
            p.loss,
            100.0 * p.accuracy
        );
        if bar.is_hidden() {
            println!("warm-up step {}/{} {line}", p.step, settings.max_steps);
        }
        bar.set_position(p.step);
        bar.set_message(line);
    })
    .await
    .map_err(anyhow::Error::msg)?;
    bar.finish_and_clear();
    println!(
        "warm-up: {} supervised steps, accuracy on training problems {:.1}%",
        report.steps,
        100.0 * report.probe_accuracy
    );
    let tmp = dir.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    save_checkpoint(&report.weights, &tmp, &SaveOptions::default())
        .with_context(|| format!("saving the warm-started model to {}", tmp.display()))?;
    copy_aux_files(&setup.model_dir, &tmp)?;
    std::fs::rename(&tmp, dir).with_context(|| format!("moving {} into place", tmp.display()))?;
    Ok(())
}

/// Watches the running node: logs steps, evaluates, draws the progress bar.
struct Monitor {
    bar: ProgressBar,
    started: Instant,
    every: u64,
    stop_at: Option<f64>,
    max_steps: u64,
    /// (held-out, training-probe) accuracy before RL, at the last evaluation, and the best.
    start_accuracy: (f64, f64),
    last_accuracy: (f64, f64),
    best_accuracy: f64,
    steps: u64,
    reached_target_at: Option<(u64, f64)>,
    /// (finished rollouts, their reward sum) at the last poll and at the last record.
    finished: (u64, f64),
    reward: (u64, f64),
    tokens: (u64, Instant),
    tokens_per_s: f64,
    /// Mean reward of the rollouts finished since the previous record.
    reward_mean: f64,
    /// Its moving average over steps, for the progress bar.
    reward_smoothed: Option<f64>,
}

/// Weight of the newest step in the progress bar's reward average.
const REWARD_SMOOTHING: f64 = 0.1;

impl Monitor {
    fn new(config: &Config, started: Instant, start_accuracy: (f64, f64)) -> Self {
        let bar = ProgressBar::new(config.run.max_steps.get());
        bar.set_style(
            ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Self {
            bar,
            started,
            every: config.eval.every_steps,
            stop_at: config.eval.stop_at_accuracy,
            max_steps: config.run.max_steps.get(),
            start_accuracy,
            last_accuracy: start_accuracy,
            best_accuracy: start_accuracy.0,
            steps: 0,
            reached_target_at: None,
            finished: (0, 0.0),
            reward: (0, 0.0),
            tokens: (0, Instant::now()),
            tokens_per_s: 0.0,
            reward_mean: 0.0,
            reward_smoothed: None,
        }
    }

    /// Until the step budget is spent, the target accuracy is reached, or training fails.
    async fn watch(
        &mut self,
        node: &Node,
        tap: &TapHandle,
        evaluations: &mut Evaluations,
        log: &mut MetricsLog,
    ) -> anyhow::Result<()> {
        loop {
            let status = node.status().await?;
            self.rates(&status);
            let steps = lock_tap(tap).drain_steps();
            for s in steps {
                self.steps += 1;
                // Rollouts finished since the previous record (a step with none keeps the mean).
                let ((n, sum), (n0, sum0)) = (self.finished, self.reward);
                if n > n0 {
                    self.reward_mean = (sum - sum0) / (n - n0) as f64;
                    self.reward = self.finished;
                }
                let due = self.every > 0 && self.steps.is_multiple_of(self.every);
                let last = self.steps >= self.max_steps;
                let latest = lock_tap(tap).latest();
                let accuracy = match latest {
                    Some(w) if due || last => self.evaluate(evaluations, &w).await?,
                    _ => None,
                };
                let smoothed = self.reward_smoothed.map_or(s.reward_mean, |r| {
                    r + REWARD_SMOOTHING * (s.reward_mean - r)
                });
                self.reward_smoothed = Some(smoothed);
                let mut extra = BTreeMap::from([("trained_reward_mean".to_owned(), s.reward_mean)]);
                if let Some((_, train)) = accuracy {
                    extra.insert("train_accuracy".to_owned(), train);
                }
                log.append(&StepRecord {
                    step: self.steps,
                    wall_s: self.started.elapsed().as_secs_f64(),
                    phase: Some("rl".into()),
                    reward_mean: self.reward_mean,
                    eval_accuracy: accuracy.map(|a| a.0),
                    version_lag_mean: s.version_lag_mean,
                    tokens_per_s: Some(self.tokens_per_s),
                    loss: s.metrics.get(TRAINER_LOSS_VALUE).copied(),
                    policy_version: Some(PolicyVersion(s.version.0 + 1)),
                    extra,
                })?;
                let line = format!(
                    "| reward {smoothed:.2} | eval {:.1}% (train {:.1}%) | lag {:.2} | {:.0} tok/s",
                    100.0 * self.last_accuracy.0,
                    100.0 * self.last_accuracy.1,
                    s.version_lag_mean,
                    self.tokens_per_s
                );
                // Without a terminal (logs, CI) the bar is hidden: one line per evaluation.
                if self.bar.is_hidden() && accuracy.is_some() {
                    println!(
                        "step {}/{} {:.0}s {line}",
                        self.steps,
                        self.max_steps,
                        self.started.elapsed().as_secs_f64()
                    );
                }
                self.bar.set_position(self.steps);
                self.bar.set_message(line);
                if let (Some(target), Some((heldout, _))) = (self.stop_at, accuracy)
                    && heldout >= target
                {
                    let at = self.started.elapsed().as_secs_f64();
                    self.reached_target_at.get_or_insert((self.steps, at));
                    return Ok(());
                }
            }
            if let Some(e) = &status.trainer.error {
                bail!("training failed: {e}");
            }
            if status.trainer.done {
                return Ok(());
            }
            if let Some(actor) = node.failure() {
                bail!("actor `{actor}` stopped unexpectedly");
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    fn rates(&mut self, status: &NodeStatus) {
        self.finished = (
            status.controller.finished_rollouts,
            status.controller.reward_sum,
        );
        let tokens: u64 = status.engines.iter().map(|e| e.generated_tokens).sum();
        let (t0, at) = self.tokens;
        let dt = at.elapsed().as_secs_f64();
        if dt >= 1.0 {
            self.tokens_per_s = tokens.saturating_sub(t0) as f64 / dt;
            self.tokens = (tokens, Instant::now());
        }
    }

    async fn evaluate(
        &mut self,
        evaluations: &mut Evaluations,
        weights: &WeightSnapshot,
    ) -> anyhow::Result<Option<(f64, f64)>> {
        let Some(w) = sluice_model::WeightSnapshot::from_envelope(weights) else {
            return Ok(None);
        };
        let accuracy = evaluations.run(w).await?;
        self.last_accuracy = accuracy;
        self.best_accuracy = self.best_accuracy.max(accuracy.0);
        Ok(Some(accuracy))
    }
}

fn print_summary(m: &Monitor, status: Option<&NodeStatus>, log: &Path, plot: &Path) {
    let wall = m.started.elapsed().as_secs_f64();
    println!("steps                 {}", m.steps);
    println!("wall time             {wall:.1} s");
    println!(
        "held-out accuracy     {:.1}% → {:.1}% (best {:.1}%)",
        100.0 * m.start_accuracy.0,
        100.0 * m.last_accuracy.0,
        100.0 * m.best_accuracy
    );
    println!(
        "training problems     {:.1}% → {:.1}%",
        100.0 * m.start_accuracy.1,
        100.0 * m.last_accuracy.1
    );
    if let Some((step, at)) = m.reached_target_at {
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
    println!("metrics               {}", log.display());
    println!("plot                  {}", plot.display());
}
