//! What a native run evaluates: for each evaluated domain, greedy accuracy on a held-out set (the
//! task's generated held-out split, or the domain's `eval_dataset` file) and on a fixed probe of
//! training problems. With `eval.task` set, that one task is evaluated (in the domain whose rows
//! it serves); otherwise every domain of `data.datasets`, each through the task that serves it,
//! with its own system prompt and turn budget. The run's accuracy is the mean over the domains,
//! so one domain's collapse shows even when another climbs. With `eval.samples_per_problem = k`
//! above 1, each held-out problem is also answered k times at `eval.sample_temperature`, for
//! pass@k and mean@k.

use std::sync::Arc;

use futures::future::BoxFuture;
use sluice_config::{Config, DatasetSpec};
use sluice_core::DataSample;
use sluice_engine::{NativeEngineParams, SamplingParams};
use sluice_env::datasets::{GeneratedRows, load_dataset};
use sluice_env::{SampledScores, Task, TaskRegistry};
use sluice_model::ModelWeights;

use crate::native::{Evaluator, NativeSetup};
use sluice_actors::ActorError;

fn setup_err(what: impl std::fmt::Display) -> ActorError {
    ActorError::Setup(what.to_string())
}

/// Accuracy of one domain.
#[derive(Debug, Clone, PartialEq)]
pub struct DomainAccuracy {
    /// The domain.
    pub domain: String,
    /// Greedy accuracy on its held-out set.
    pub heldout: f64,
    /// Greedy accuracy on its training probe.
    pub train: f64,
    /// pass@k and mean@k on its held-out set, with `eval.samples_per_problem` above 1.
    pub sampled: Option<SampledScores>,
}

/// What one evaluation found: the means over the domains and each domain's own.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scores {
    /// Mean held-out accuracy over the evaluated domains.
    pub heldout: f64,
    /// Mean training-probe accuracy over the evaluated domains.
    pub train: f64,
    /// Each domain's, in evaluation order.
    pub domains: Vec<DomainAccuracy>,
    /// pass@k and mean@k, the means over the domains (with `eval.samples_per_problem` above 1).
    pub sampled: Option<SampledScores>,
}

impl Scores {
    /// (held-out, training-probe) means.
    pub fn pair(&self) -> (f64, f64) {
        (self.heldout, self.train)
    }

    fn from_domains(domains: Vec<DomainAccuracy>) -> Self {
        let n = domains.len().max(1) as f64;
        let sampled: Vec<SampledScores> = domains.iter().filter_map(|d| d.sampled).collect();
        let sampled = (!sampled.is_empty()).then(|| {
            let m = sampled.len() as f64;
            SampledScores {
                k: sampled[0].k,
                pass_at_k: sampled.iter().map(|s| s.pass_at_k).sum::<f64>() / m,
                mean_at_k: sampled.iter().map(|s| s.mean_at_k).sum::<f64>() / m,
            }
        });
        Self {
            heldout: domains.iter().map(|d| d.heldout).sum::<f64>() / n,
            train: domains.iter().map(|d| d.train).sum::<f64>() / n,
            domains,
            sampled,
        }
    }
}

/// One evaluated domain.
struct DomainEval {
    domain: String,
    task: Arc<Task>,
    heldout: Evaluator,
    train: Evaluator,
    /// k sampled replies of each held-out problem, and k.
    sampled: Option<(Evaluator, u32)>,
}

/// Greedy accuracy of every evaluated domain, on its held-out set and on a fixed probe of its
/// training problems.
pub struct Evaluations {
    domains: Vec<DomainEval>,
}

/// A domain and the task that serves it.
pub(super) struct Served {
    pub domain: String,
    pub task: Arc<Task>,
}

/// The domains evaluated and warm-started: `eval.task` alone (in the domain whose rows it serves),
/// else every domain of `data.datasets` through its serving task.
pub(super) fn served_domains(
    config: &Config,
    setup: &NativeSetup,
) -> Result<Vec<Served>, ActorError> {
    let registry = &setup.registry;
    if let Some(name) = &config.eval.task {
        let task = registry
            .get(name)
            .map_err(|e| setup_err(format!("eval.task: {e}")))?;
        let domain = task_domain(config, registry, &task).to_owned();
        return Ok(vec![Served { domain, task }]);
    }
    if config.data.datasets.is_empty() {
        return Err(setup_err(
            "data.datasets is empty: a native run needs at least one dataset",
        ));
    }
    config
        .data
        .domains()
        .into_iter()
        .map(|domain| {
            let spec = config
                .data
                .datasets
                .iter()
                .find(|d| d.domain == domain)
                .expect("a listed domain has a dataset");
            let name = serving_task(config, registry, spec);
            let task = registry
                .get(name)
                .map_err(|e| setup_err(format!("the task of domain `{domain}`: {e}")))?;
            Ok(Served { domain, task })
        })
        .collect()
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

/// The domain of the first dataset `task` serves.
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
    params.device = config.eval.device;
    // `engine.cuda_graphs` is for a GPU: an evaluator on the CPU runs without.
    params.cuda_graphs &= params.device != sluice_core::config::Device::Cpu;
    // Evaluation prompts arrive all at once: prefill them in few steps.
    params.max_step_tokens = params.max_step_tokens.max(4096);
    params
}

/// An evaluator of `task` on `samples` of `domain` with the run's engine sizing and the
/// domain's turn budget.
pub(super) fn evaluator(
    config: &Config,
    setup: &NativeSetup,
    served: &Served,
    samples: Vec<DataSample>,
    temperature: f64,
    seed: Option<u64>,
) -> Evaluator {
    let max_tokens = config
        .data
        .turn_tokens(&served.domain, config.rollout.max_new_tokens);
    Evaluator::new(
        Arc::clone(&served.task),
        samples,
        setup.renderer.clone(),
        setup.limits(config),
        engine_params(config, setup),
        Arc::clone(&setup.tokenizer),
        SamplingParams {
            temperature,
            top_p: 1.0,
            top_k: 0,
            max_tokens: max_tokens.get(),
            seed,
            stop_token_ids: Vec::new(),
        },
    )
}

/// `count` problems of the served task's training split, in its domain (a fixed draw: the
/// warm-up's demonstrations and the training-accuracy probe); for a task without a generator
/// (`qa`), the first rows of the domain's dataset files.
pub(super) fn training_samples(
    config: &Config,
    served: &Served,
    count: usize,
) -> Result<Vec<DataSample>, ActorError> {
    let task = &served.task;
    if !task.generates_data() {
        return file_training_samples(config, served, count);
    }
    // Only the split matters to a generator; a configured copy's name (`domain/task`) is no
    // dataset name.
    let spec = DatasetSpec {
        domain: served.domain.clone(),
        name: task.name().replace('/', "."),
        split: Some("train".to_owned()),
    };
    let train = task
        .generate_dataset(&spec, config.run.seed ^ 0x5f7, count)
        .map_err(|e| setup_err(format!("training problems of `{}`: {e}", task.name())))?;
    Ok(in_domain(config, &served.domain, train.samples().to_vec()))
}

/// The first `count` rows of the domain's datasets, in config and file order: the training
/// problems of a task that reads its rows from files (`qa`).
fn file_training_samples(
    config: &Config,
    served: &Served,
    count: usize,
) -> Result<Vec<DataSample>, ActorError> {
    let mut rows = Vec::new();
    for spec in config
        .data
        .datasets
        .iter()
        .filter(|d| d.domain == served.domain)
    {
        // The sampler loaded (and reported) these files already.
        let data = sluice_data::Dataset::load_again(
            &config.data.data_dir,
            spec,
            config.data.on_bad_line,
            &config.data.read_limits,
        )
        .map_err(|e| {
            setup_err(format!(
                "training problems of `{}`: {e}",
                served.task.name()
            ))
        })?;
        rows.extend(data.samples().iter().take(count - rows.len()).cloned());
        if rows.len() == count {
            break;
        }
    }
    if rows.is_empty() {
        return Err(setup_err(format!(
            "training problems of `{}`: the datasets of domain `{}` have no rows",
            served.task.name(),
            served.domain
        )));
    }
    Ok(in_domain(config, &served.domain, rows))
}

/// The held-out set of a served domain: its `eval_dataset` (a JSONL file under `data_dir`, or
/// generated by the task of that name), else its task's held-out split. The warm-up's held-out
/// probe plays the same set.
pub(super) fn heldout_samples(
    config: &Config,
    setup: &NativeSetup,
    served: &Served,
) -> Result<Vec<DataSample>, ActorError> {
    let options = config.data.domain_options.get(&served.domain);
    let samples = match options.and_then(|d| d.eval_dataset_spec(&served.domain)) {
        Some(spec) => {
            let key = format!("data.domains.{}.eval_dataset", served.domain);
            let rows = GeneratedRows {
                eval: config.eval.samples.get() as usize,
                ..GeneratedRows::new(config.run.seed)
            };
            load_dataset(&config.data, &setup.registry, &spec, rows)
                .map_err(|e| setup_err(format!("{key}: {e}")))?
                .samples()
                .to_vec()
        }
        None => served
            .task
            .eval_samples(config.run.seed, config.eval.samples.get() as usize)
            .map_err(|e| {
                setup_err(format!(
                    "held-out samples of `{}` (domain `{}`): {e}",
                    served.task.name(),
                    served.domain
                ))
            })?,
    };
    if samples.is_empty() {
        return Err(setup_err(format!(
            "domain `{}` has an empty held-out set",
            served.domain
        )));
    }
    Ok(in_domain(config, &served.domain, samples))
}

impl Evaluations {
    pub(super) fn new(config: &Config, setup: &NativeSetup) -> Result<Self, ActorError> {
        let temperature = config.eval.temperature;
        let seed = Some(config.run.seed);
        let k = config.eval.samples_per_problem.get();
        let domains = served_domains(config, setup)?
            .into_iter()
            .map(|served| {
                let mut probe = training_samples(config, &served, 4096)?;
                probe.truncate(config.warmup.probe_samples.get() as usize);
                let heldout = heldout_samples(config, setup, &served)?;
                // Each problem k times in a row; no fixed seed, so the engine draws each reply
                // from its own rollout id and the k replies differ.
                let sampled = (k > 1).then(|| {
                    let repeated = heldout
                        .iter()
                        .flat_map(|s| std::iter::repeat_n(s.clone(), k as usize))
                        .collect();
                    let t = config.eval.sample_temperature;
                    (evaluator(config, setup, &served, repeated, t, None), k)
                });
                Ok(DomainEval {
                    heldout: evaluator(config, setup, &served, heldout, temperature, seed),
                    train: evaluator(config, setup, &served, probe, temperature, seed),
                    sampled,
                    domain: served.domain,
                    task: served.task,
                })
            })
            .collect::<Result<Vec<_>, ActorError>>()?;
        Ok(Self { domains })
    }

    /// What is evaluated, for people: `arithmetic`, or `math (arithmetic), tools (…)`.
    pub fn describe(&self) -> String {
        match self.domains.as_slice() {
            [one] => format!("`{}`", one.task.name()),
            many => many
                .iter()
                .map(|d| format!("{} (`{}`)", d.domain, d.task.name()))
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// The evaluated domains, in order.
    pub fn domains(&self) -> Vec<&str> {
        self.domains.iter().map(|d| d.domain.as_str()).collect()
    }

    /// Problems in the held-out sets, all domains together.
    pub fn heldout_len(&self) -> usize {
        self.domains.iter().map(|d| d.heldout.len()).sum()
    }

    /// Accuracy of `weights` on every domain's held-out set and training probe, beside a running
    /// pipeline. Boxed (see [`crate::node`]).
    pub fn run(&mut self, weights: Arc<ModelWeights>) -> BoxFuture<'_, Result<Scores, ActorError>> {
        self.run_with(weights, false)
    }

    /// [`Self::run`] while nothing else computes (the baseline before the node starts): the
    /// evaluation engines take every core unless `engine.threads` names a count.
    pub fn run_alone(
        &mut self,
        weights: Arc<ModelWeights>,
    ) -> BoxFuture<'_, Result<Scores, ActorError>> {
        self.run_with(weights, true)
    }

    fn run_with(
        &mut self,
        weights: Arc<ModelWeights>,
        alone: bool,
    ) -> BoxFuture<'_, Result<Scores, ActorError>> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(self.domains.len());
            for d in &mut self.domains {
                d.heldout.set_alone(alone);
                d.train.set_alone(alone);
                if let Some((sampled, _)) = &mut d.sampled {
                    sampled.set_alone(alone);
                }
                let failed = |what: &str, e: sluice_env::EnvError| {
                    ActorError::Evaluation(format!("{what} evaluation of `{}`: {e}", d.domain))
                };
                let heldout = d
                    .heldout
                    .evaluate(Arc::clone(&weights))
                    .await
                    .map_err(|e| failed("held-out", e))?;
                let train = d
                    .train
                    .evaluate(Arc::clone(&weights))
                    .await
                    .map_err(|e| failed("training-probe", e))?;
                let sampled = match &mut d.sampled {
                    Some((evaluator, k)) => {
                        let replies = evaluator
                            .evaluate(Arc::clone(&weights))
                            .await
                            .map_err(|e| failed("sampled held-out", e))?;
                        SampledScores::from_rollouts(d.task.rubric(), &replies.rollouts, *k)
                    }
                    None => None,
                };
                out.push(DomainAccuracy {
                    domain: d.domain.clone(),
                    heldout: heldout.report.accuracy,
                    train: train.report.accuracy,
                    sampled,
                });
            }
            Ok(Scores::from_domains(out))
        })
    }
}
