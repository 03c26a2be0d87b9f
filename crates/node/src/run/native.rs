//! Preparing a native run (a real model): the model directory, the data, the evaluated task and
//! its held-out and training probes, and the supervised warm-start of a fresh run. What it
//! builds is handed to [`crate::Node::start`] (the setup and the sample source) and to the
//! [`super::RunMonitor`] (the evaluations).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::future::BoxFuture;
use sluice_config::{Config, LrSchedule, WarmupProbeSet};
use sluice_data::{DatasetRows, MixSampler, SamplerConfig};
use sluice_env::datasets::{GeneratedRows, load_datasets};
use sluice_model::{SaveOptions, copy_aux_files, save_checkpoint};

use crate::native::{
    DemoStream, NativeSetup, WarmupProbe, WarmupProgress, WarmupSettings, demonstrations,
    ensure_model_dir, warm_start,
};
use sluice_actors::ActorError;
use sluice_actors::checkpoint::{CHECKPOINT_DIR, CheckpointDir, Manifest};

use super::evaluations::{
    Evaluations, Served, evaluator, heldout_samples, served_domains, training_samples,
};

/// Where a run keeps its warm-started model, under `run.output_dir`.
pub const WARMUP_DIR: &str = "warmup";

fn setup_err(what: impl std::fmt::Display) -> ActorError {
    ActorError::Setup(what.to_string())
}

/// What the warm-start did.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupOutcome {
    /// Supervised steps taken.
    pub steps: u64,
    /// Greedy accuracy on the probes at the end (mean over the domains): on training problems
    /// or on the held-out sets, as `warmup.probe` says.
    pub probe_accuracy: f64,
    /// Each warmed-up domain's probe accuracy at the end.
    pub domains: Vec<(String, f64)>,
}

/// A native run, ready to start its node.
pub struct NativeRun {
    /// The model (the warm-started copy when there is one).
    pub setup: Arc<NativeSetup>,
    /// The training samples, already loaded (an unreadable dataset fails the preparation).
    pub source: MixSampler<DatasetRows>,
    /// Each evaluated domain's held-out set and training probe.
    pub evaluations: Evaluations,
    /// The checkpoint the run resumes from (its directory and manifest), if its output dir
    /// holds one.
    pub resumed: Option<(PathBuf, Manifest)>,
    /// `model.path` was created from `model.init_preset`.
    pub created_model: bool,
    /// The warm-start this preparation ran (none on a resumed run or when one exists).
    pub warmup: Option<WarmupOutcome>,
}

impl NativeRun {
    /// Prepares the run of `config`: creates the model when absent, loads the data, finds the
    /// task serving each domain and, on a fresh run with `warmup.enabled`, warm-starts the model
    /// on their reference replies (`on_warmup` sees every probe). A run whose output dir holds a
    /// checkpoint resumes from it: no warm-up.
    pub async fn prepare(
        config: &Config,
        mut on_warmup: impl FnMut(&WarmupProgress) + Send,
    ) -> Result<Self, ActorError> {
        Self::prepare_boxed(config, &mut on_warmup).await
    }

    /// [`NativeRun::prepare`]'s body, boxed and not generic, so it is compiled once, here (see
    /// [`crate::node`]); only the call above is compiled where `on_warmup` is defined.
    fn prepare_boxed<'a>(
        config: &'a Config,
        on_warmup: &'a mut (dyn FnMut(&WarmupProgress) + Send),
    ) -> BoxFuture<'a, Result<Self, ActorError>> {
        Box::pin(async move {
            let out = &config.run.output_dir;
            std::fs::create_dir_all(out)
                .map_err(|e| setup_err(format!("creating {}: {e}", out.display())))?;
            let resumed = CheckpointDir::new(out.join(CHECKPOINT_DIR))
                .load()
                .map_err(|e| setup_err(format!("reading the run's checkpoint: {e}")))?;
            let created_model = ensure_model_dir(config)?;
            let base = NativeSetup::load(config, None)?;
            // The data first: an unreadable dataset is reported before minutes of warm-up, and
            // before the evaluated task is looked up (a dataset naming no task is a data error, not
            // `eval.task`).
            let source = sample_source(config, &base)?;
            let served = served_domains(config, &base)?;
            let warm_dir = warmup_dir(config);
            let mut warmup_outcome = None;
            if resumed.is_none() && config.warmup.enabled && !warm_dir.join("config.json").exists()
            {
                warmup_outcome = Some(warmup(config, &base, &served, &warm_dir, on_warmup).await?);
            }
            let setup = if warm_dir.join("config.json").exists() {
                NativeSetup::load(config, Some(&warm_dir))?
            } else {
                base
            };
            let evaluations = Evaluations::new(config, &setup)?;
            Ok(Self {
                setup: Arc::new(setup),
                source,
                evaluations,
                resumed,
                created_model,
                warmup: warmup_outcome,
            })
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

/// Supervised warm-start on the served tasks' reference replies, every domain's demonstrations
/// interleaved and each domain probed on its own training problems or, with `warmup.probe =
/// "heldout"`, on its held-out set (the one its evaluations score); the result goes to `dir`.
async fn warmup(
    config: &Config,
    setup: &NativeSetup,
    served: &[Served],
    dir: &Path,
    on_progress: impl FnMut(&WarmupProgress),
) -> Result<WarmupOutcome, ActorError> {
    let w = &config.warmup;
    let limits = setup.limits(config);
    let mut per_domain = Vec::new();
    let mut probes = Vec::new();
    for s in served {
        if s.task.reference_reply_declared() {
            let samples = training_samples(config, s, 4096)?;
            let demos = demonstrations(&s.task, &samples, &setup.renderer, &limits)
                .await
                .map_err(|e| setup_err(format!("warm-up of domain `{}`: {e}", s.domain)))?;
            per_domain.push(demos);
            let probed = match w.probe {
                WarmupProbeSet::Train => {
                    let probe_n = (w.probe_samples.get() as usize).min(samples.len());
                    samples[..probe_n].to_vec()
                }
                WarmupProbeSet::Heldout => heldout_samples(config, setup, s)?,
            };
            let target = config
                .data
                .domain_options
                .get(&s.domain)
                .and_then(|d| d.warmup_target_accuracy)
                .unwrap_or(w.target_accuracy);
            // Probes run between the warm-up's steps, while nothing else computes.
            let mut probe = evaluator(config, setup, s, probed, 0.0, Some(config.run.seed));
            probe.set_alone(true);
            probes.push(WarmupProbe {
                domain: s.domain.clone(),
                evaluator: probe,
                target,
            });
        }
    }
    if per_domain.is_empty() {
        let tasks: Vec<&str> = served.iter().map(|s| s.task.name()).collect();
        return Err(setup_err(format!(
            "warm-up: no task of the run declares reference replies ({}): set warmup.enabled = false",
            tasks.join(", ")
        )));
    }
    let demos = DemoStream::new(per_domain);
    let mut sft = config.clone();
    sft.trainer.learning_rate = w.learning_rate;
    sft.trainer.lr_schedule = LrSchedule::Constant;
    sft.trainer.warmup_steps = 0;
    sft.trainer.kl_coef = 0.0;
    // Supervised steps take no reward: no reference model to keep for the penalty in one.
    sft.trainer.kl_in_reward = 0.0;
    sft.trainer.kl_in_reward_target = None;
    // Nothing else computes during the warm-up (its probes run between its steps): with
    // automatic sizing its trainer takes every core, not the half an engine leaves it.
    if sft.trainer.threads == 0 {
        sft.trainer.threads = sluice_model::threads::available_cores() as u32;
    }
    let trainer = setup.trainer(&sft, None)?;
    let settings = WarmupSettings {
        max_steps: w.max_steps.get(),
        batch_size: w.batch_size.get() as usize,
        check_every: w.check_every.get(),
    };
    let (_, report) = warm_start(
        trainer,
        Arc::new(demos),
        &mut probes,
        &settings,
        on_progress,
    )
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
        domains: report.domains,
    })
}
