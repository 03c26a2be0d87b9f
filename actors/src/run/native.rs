//! Preparing a native run (a real model): the model directory, the data, the evaluated task and
//! its held-out and training probes, and the supervised warm-start of a fresh run. What it
//! builds is handed to [`crate::Node::start`] (the setup and the sample source) and to the
//! [`super::RunMonitor`] (the evaluations).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_core::DataSample;
use sluice_core::config::{Config, DatasetSpec, LrSchedule};
use sluice_data::{DatasetRows, MixSampler, SamplerConfig};
use sluice_engine::{NativeEngineParams, SamplingParams};
use sluice_env::datasets::{GeneratedRows, load_datasets};
use sluice_env::{Task, TaskRegistry};
use sluice_model::{ModelWeights, SaveOptions, copy_aux_files, save_checkpoint};

use crate::ActorError;
use crate::checkpoint::{CHECKPOINT_DIR, CheckpointDir, Manifest};
use crate::native::{
    Evaluator, NativeSetup, WarmupProgress, WarmupSettings, demonstrations, ensure_model_dir,
    warm_start,
};

/// Where a run keeps its warm-started model, under `run.output_dir`.
pub const WARMUP_DIR: &str = "warmup";

fn setup_err(what: impl std::fmt::Display) -> ActorError {
    ActorError::Setup(what.to_string())
}

/// What the warm-start did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupOutcome {
    /// Supervised steps taken.
    pub steps: u64,
    /// Greedy accuracy on the training probe at the end.
    pub probe_accuracy: f64,
}

/// A native run, ready to start its node.
pub struct NativeRun {
    /// The model (the warm-started copy when there is one).
    pub setup: Arc<NativeSetup>,
    /// The training samples, already loaded (an unreadable dataset fails the preparation).
    pub source: MixSampler<DatasetRows>,
    /// The evaluated task's held-out and training probes.
    pub evaluations: Evaluations,
    /// The checkpoint the run resumes from, if its output dir holds one.
    pub resumed: Option<Manifest>,
    /// `model.path` was created from `model.init_preset`.
    pub created_model: bool,
    /// The warm-start this preparation ran (none on a resumed run or when one exists).
    pub warmup: Option<WarmupOutcome>,
}

impl NativeRun {
    /// Prepares the run of `config`: creates the model when absent, loads the data, finds the
    /// evaluated task and, on a fresh run with `warmup.enabled`, warm-starts the model on the
    /// task's reference replies (`on_warmup` sees every supervised step). A run whose output
    /// dir holds a checkpoint resumes from it: no warm-up.
    pub async fn prepare(
        config: &Config,
        on_warmup: impl FnMut(&WarmupProgress),
    ) -> Result<Self, ActorError> {
        let out = &config.run.output_dir;
        std::fs::create_dir_all(out)
            .map_err(|e| setup_err(format!("creating {}: {e}", out.display())))?;
        let resumed = CheckpointDir::new(out.join(CHECKPOINT_DIR))
            .load()
            .map_err(|e| setup_err(format!("reading the run's checkpoint: {e}")))?
            .map(|(_, manifest)| manifest);
        let created_model = ensure_model_dir(config)?;
        let base = NativeSetup::load(config, None)?;
        // The data first: an unreadable dataset is reported before minutes of warm-up, and
        // before the evaluated task is looked up (a dataset naming no task is a data error, not
        // `eval.task`).
        let source = sample_source(config, &base)?;
        let task = eval_task(config, &base)?;
        let warm_dir = warmup_dir(config);
        let mut warmup_outcome = None;
        if resumed.is_none() && config.warmup.enabled && !warm_dir.join("config.json").exists() {
            warmup_outcome = Some(warmup(config, &base, &task, &warm_dir, on_warmup).await?);
        }
        let setup = if warm_dir.join("config.json").exists() {
            NativeSetup::load(config, Some(&warm_dir))?
        } else {
            base
        };
        let evaluations = Evaluations::new(config, &setup, &task)?;
        Ok(Self {
            setup: Arc::new(setup),
            source,
            evaluations,
            resumed,
            created_model,
            warmup: warmup_outcome,
        })
    }
}

/// The warm-started model of `config`'s run.
pub fn warmup_dir(config: &Config) -> PathBuf {
    config.run.output_dir.join(WARMUP_DIR)
}

/// The model a run of `config` trains from: the warm-started copy when the run has one, else
/// `model.path`.
pub fn load_run_setup(config: &Config) -> Result<NativeSetup, ActorError> {
    let warm_dir = warmup_dir(config);
    let warm = warm_dir.join("config.json").exists();
    NativeSetup::load(config, warm.then_some(warm_dir.as_path()))
}

/// The task evaluated: `eval.task`, else the task serving the first dataset.
fn eval_task(config: &Config, setup: &NativeSetup) -> Result<Arc<Task>, ActorError> {
    let name = match (&config.eval.task, config.data.datasets.first()) {
        (Some(t), _) => t.clone(),
        (None, Some(spec)) => serving_task(config, &setup.registry, spec).to_owned(),
        (None, None) => {
            return Err(setup_err(
                "data.datasets is empty: a native run needs at least one dataset",
            ));
        }
    };
    setup
        .registry
        .get(&name)
        .map_err(|e| setup_err(format!("eval.task: {e}")))
}

/// The task that runs `spec`'s rows: its domain's configured copy (its own rubric or env
/// server), else the domain's `task`, else the dataset's name.
fn serving_task<'c>(
    config: &'c Config,
    registry: &'c TaskRegistry,
    spec: &'c DatasetSpec,
) -> &'c str {
    registry
        .domain_tasks()
        .get(&spec.domain)
        .map(String::as_str)
        .or_else(|| {
            config
                .data
                .domain_options
                .get(&spec.domain)
                .and_then(|d| d.task.as_deref())
        })
        .unwrap_or(&spec.name)
}

/// The domain of the first dataset `task` serves (its rows get that domain's system prompt).
fn task_domain<'c>(config: &'c Config, registry: &TaskRegistry, task: &Task) -> &'c str {
    config
        .data
        .datasets
        .iter()
        .find(|d| serving_task(config, registry, d) == task.name())
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

/// `count` problems of `task`'s training split (a fixed draw: the warm-up's demonstrations and
/// the training-accuracy probe).
fn training_samples(
    config: &Config,
    registry: &TaskRegistry,
    task: &Task,
    count: usize,
) -> Result<Vec<DataSample>, ActorError> {
    let domain = task_domain(config, registry, task);
    // Only the split matters to a generator; a configured copy's name (`domain/task`) is no
    // dataset name.
    let spec = DatasetSpec {
        domain: domain.to_owned(),
        name: task.name().replace('/', "."),
        split: Some("train".to_owned()),
    };
    let train = task
        .generate_dataset(&spec, config.run.seed ^ 0x5f7, count)
        .map_err(|e| setup_err(format!("training problems of `{}`: {e}", task.name())))?;
    Ok(in_domain(config, domain, train.samples().to_vec()))
}

/// Greedy accuracy on the held-out split and on a fixed probe of training problems.
pub struct Evaluations {
    task: String,
    heldout: Evaluator,
    train: Evaluator,
}

impl Evaluations {
    fn new(config: &Config, setup: &NativeSetup, task: &Arc<Task>) -> Result<Self, ActorError> {
        let mut probe = training_samples(config, &setup.registry, task, 4096)?;
        probe.truncate(config.warmup.probe_samples.get() as usize);
        let heldout = task
            .eval_samples(config.run.seed, config.eval.samples.get() as usize)
            .map_err(|e| setup_err(format!("held-out samples of `{}`: {e}", task.name())))?;
        let heldout = in_domain(config, task_domain(config, &setup.registry, task), heldout);
        let temperature = config.eval.temperature;
        Ok(Self {
            task: task.name().to_owned(),
            heldout: evaluator(config, setup, task, heldout, temperature),
            train: evaluator(config, setup, task, probe, temperature),
        })
    }

    /// The evaluated task.
    pub fn task(&self) -> &str {
        &self.task
    }

    /// Problems in the held-out split.
    pub fn heldout_len(&self) -> usize {
        self.heldout.len()
    }

    /// (held-out accuracy, training-probe accuracy) of `weights`.
    pub async fn run(&mut self, weights: Arc<ModelWeights>) -> Result<(f64, f64), ActorError> {
        let failed = |what: &str, e: sluice_env::EnvError| {
            ActorError::Evaluation(format!("{what} evaluation: {e}"))
        };
        let heldout = self
            .heldout
            .evaluate(Arc::clone(&weights))
            .await
            .map_err(|e| failed("held-out", e))?;
        let train = self
            .train
            .evaluate(weights)
            .await
            .map_err(|e| failed("training-probe", e))?;
        Ok((
            heldout.report.accuracy.unwrap_or(0.0),
            train.report.accuracy.unwrap_or(0.0),
        ))
    }
}

/// The sample source of a native run of `config`: `data.datasets` over the setup's tasks.
pub fn sample_source(
    config: &Config,
    setup: &NativeSetup,
) -> Result<MixSampler<DatasetRows>, ActorError> {
    let seed = config.run.seed;
    let datasets = load_datasets(&config.data, &setup.registry, GeneratedRows::new(seed))
        .map_err(|e| setup_err(format!("loading data.datasets: {e}")))?;
    let rows = DatasetRows::new(datasets, seed);
    MixSampler::with_rows(SamplerConfig::from_data_config(&config.data, seed), rows)
        .map_err(|e| setup_err(format!("data sampler: {e}")))
}

/// Supervised warm-start on the task's reference replies; the result goes to `dir`.
async fn warmup(
    config: &Config,
    setup: &NativeSetup,
    task: &Arc<Task>,
    dir: &Path,
    on_progress: impl FnMut(&WarmupProgress),
) -> Result<WarmupOutcome, ActorError> {
    let w = &config.warmup;
    let samples = training_samples(config, &setup.registry, task, 4096)?;
    let limits = setup.limits(config);
    let demos = demonstrations(task, &samples, &setup.renderer, &limits)
        .await
        .map_err(|e| setup_err(format!("warm-up: {e}")))?;
    let probe_n = (w.probe_samples.get() as usize).min(samples.len());
    let mut probe = evaluator(config, setup, task, samples[..probe_n].to_vec(), 0.0);
    let mut sft = config.clone();
    sft.trainer.learning_rate = w.learning_rate;
    sft.trainer.lr_schedule = LrSchedule::Constant;
    sft.trainer.warmup_steps = 0;
    sft.trainer.kl_coef = 0.0;
    let trainer = setup.trainer(&sft, None)?;
    let settings = WarmupSettings {
        max_steps: w.max_steps.get(),
        batch_size: w.batch_size.get() as usize,
        target_accuracy: w.target_accuracy,
        check_every: w.check_every.get(),
    };
    let (_, report) = warm_start(trainer, Arc::new(demos), &mut probe, &settings, on_progress)
        .await
        .map_err(|e| setup_err(format!("warm-up: {e}")))?;
    let tmp = dir.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    save_checkpoint(&report.weights, &tmp, &SaveOptions::default()).map_err(|e| {
        setup_err(format!(
            "saving the warm-started model to {}: {e}",
            tmp.display()
        ))
    })?;
    copy_aux_files(&setup.model_dir, &tmp)
        .map_err(|e| setup_err(format!("copying the tokenizer to {}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, dir)
        .map_err(|e| setup_err(format!("moving {} into place: {e}", tmp.display())))?;
    Ok(WarmupOutcome {
        steps: report.steps,
        probe_accuracy: report.probe_accuracy,
    })
}
