//! `sluice run` on a real model (`engine.backend = "native"` or `"remote"`): create the model
//! when absent, warm-start it with a short supervised phase on a fresh run, then train with
//! async RL through the actors, evaluating on the held-out split as it goes. Writes
//! `metrics.jsonl` (one line per step) and `progress.png` into the run's output dir.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sluice_actors::checkpoint::{CHECKPOINT_DIR, CheckpointDir};
use sluice_actors::native::tap::{TappedTrainer, lock_tap};
use sluice_actors::native::{
    Evaluator, NativeSetup, WarmupSettings, demonstrations, ensure_model_dir, warm_start,
};
use sluice_actors::{Node, NodeOptions};
use sluice_core::DataSample;
use sluice_core::config::{Config, DatasetSpec, LrSchedule};
use sluice_data::{DatasetRows, MixSampler, SamplerConfig};
use sluice_engine::{NativeEngineParams, SamplingParams};
use sluice_env::Task;
use sluice_env::datasets::{GeneratedRows, load_datasets};
use sluice_model::{SaveOptions, copy_aux_files, save_checkpoint};
use sluice_report::{METRICS_FILE, MetricsLog, PLOT_FILE, plot_run, read_log};

use super::native_monitor::{Monitor, Start};
use super::shutdown_signal;

/// Runs the native pipeline of `config` to the end (steps, target accuracy or a signal). A run
/// whose output dir holds a checkpoint resumes from it: no warm-up, the first evaluation scores
/// the checkpoint's weights, and steps, wall time and the log continue where it stopped.
pub async fn run(config: &Config) -> anyhow::Result<ExitCode> {
    let out = config.run.output_dir.clone();
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let resumed = CheckpointDir::new(out.join(CHECKPOINT_DIR))
        .load()
        .context("reading the run's checkpoint")?
        .map(|(_, manifest)| manifest);
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
    // The data first: an unreadable dataset is reported before minutes of warm-up, and before
    // the evaluated task is looked up (a dataset naming no task is a data error, not `eval.task`).
    let source = sample_source(config, &base)?;
    let task = eval_task(config, &base)?;
    let warm_dir = out.join("warmup");
    if resumed.is_none() && config.warmup.enabled && !warm_dir.join("config.json").exists() {
        warmup(config, &base, &task, &warm_dir).await?;
    }
    let setup = if warm_dir.join("config.json").exists() {
        NativeSetup::load(config, Some(&warm_dir))?
    } else {
        base
    };
    let mut evaluations = Evaluations::new(config, &setup, &task)?;
    // A fresh run's baseline is measured before RL starts; a resumed run's, on the restored
    // weights once the node has loaded them.
    let fresh_start = match &resumed {
        Some(_) => None,
        None => {
            let (heldout, train) = evaluations.run(Arc::clone(&setup.weights)).await?;
            println!(
                "before RL: held-out accuracy {:.1}% ({} problems of `{}`), training problems {:.1}%",
                100.0 * heldout,
                evaluations.heldout.len(),
                task.name(),
                100.0 * train
            );
            Some((heldout, train))
        }
    };
    let (trainer, tap) = TappedTrainer::new(setup.trainer_backend(config, None)?);
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
    let first_step = resumed.as_ref().map_or(0, |m| m.steps);
    // The steps after the checkpoint are trained again: their old records go.
    let mut log = MetricsLog::resume(&log_path, first_step)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let accuracy = match fresh_start {
        Some(a) => a,
        None => {
            let weights = lock_tap(&tap)
                .latest()
                .and_then(|w| sluice_model::WeightSnapshot::from_envelope(&w))
                .context("the restored trainer has no weights to evaluate")?;
            let (heldout, train) = evaluations.run(weights).await?;
            println!(
                "resumed at step {first_step}: held-out accuracy {:.1}% ({} problems of `{}`), training problems {:.1}%",
                100.0 * heldout,
                evaluations.heldout.len(),
                task.name(),
                100.0 * train
            );
            (heldout, train)
        }
    };
    let start = Start {
        step: first_step,
        wall_s: log.last().map_or(0.0, |r| r.wall_s),
        accuracy,
        resumed: resumed.is_some(),
    };
    let mut monitor = Monitor::new(config, started, start);
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
    // Steps trained while stopping are in the checkpoint: log them too.
    monitor.record_remaining(&tap, &mut log).await?;
    let plot = out.join(PLOT_FILE);
    let records = read_log(&log_path)?;
    plot_run(&records, &plot).with_context(|| format!("writing {}", plot.display()))?;
    monitor.print_summary(status.as_ref(), &log_path, &plot);
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

/// An evaluator's engine: sized like one replica of `[engine]` (`max_running_sequences`,
/// `kv_cache_mb`, `threads`), so evaluating never takes more memory than a replica does.
fn engine_params(config: &Config, setup: &NativeSetup) -> NativeEngineParams {
    let eos = setup.tokenizer.eos_token_ids().to_vec();
    let mut params = NativeEngineParams::from_config(&config.engine, 0, config.run.seed, eos);
    // Evaluation prompts arrive all at once: prefill them in few steps.
    params.max_step_tokens = params.max_step_tokens.max(4096);
    params
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
pub(super) struct Evaluations {
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
    pub(super) async fn run(
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
