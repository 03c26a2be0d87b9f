//! A task = datasets + env + rubric + system prompt (seed 003), registered by name so that a
//! sample's domain or dataset can be dispatched to it.

use std::collections::BTreeMap;
use std::sync::Arc;

use sluice_core::{DataSample, RolloutGroup};
use sluice_data::Dataset;
use sluice_data::config::DatasetSpec;

use crate::discount::{EpisodeDiscount, apply_discount};
use crate::error::EnvError;
use crate::protocol::MessageEnv;
use crate::renderer::Renderer;
use crate::rubric::Rubric;
use crate::token_env::{TokenEnv, TokenEnvLimits};

/// Makes a fresh environment for one rollout of a sample.
pub trait EnvFactory: Send + Sync {
    /// A new env for `sample`; `BadInput` when the sample lacks what the env needs.
    fn make_env(&self, sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError>;
}

impl<F> EnvFactory for F
where
    F: Fn(&DataSample) -> Result<Box<dyn MessageEnv>, EnvError> + Send + Sync,
{
    fn make_env(&self, sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
        self(sample)
    }
}

/// Generates a task's own data (built-in tasks need no downloads).
pub trait DataGenerator: Send + Sync {
    /// `count` samples of `split` (`train` or `eval`; the two never share a problem),
    /// deterministic in `seed`. `domain` and `dataset` are filled in by the caller.
    fn generate(&self, split: &str, seed: u64, count: usize) -> Result<Vec<DataSample>, EnvError>;

    /// Every problem of the held-out split, each once, in a fixed order, when the split is small
    /// enough to enumerate (evaluations then measure the whole split, not a draw from it).
    fn heldout(&self) -> Option<Vec<DataSample>> {
        None
    }
}

/// The reply a competent model gives at turn `turn` (0-based) of a sample's episode, when the env
/// answered every earlier turn's reference reply: what supervised warm-starts imitate. `None`
/// when the sample has no reference reply at that turn (a single-turn task has one at turn 0
/// only). The env's answers follow from the sample, so the turn number is all the policy needs.
pub type ReferenceReply = Arc<dyn Fn(&DataSample, u32) -> Option<String> + Send + Sync>;

/// One registered task.
#[derive(Clone)]
pub struct Task {
    name: String,
    system_prompt: Option<String>,
    env: Arc<dyn EnvFactory>,
    rubric: Arc<Rubric>,
    datasets: Vec<DatasetSpec>,
    generator: Option<Arc<dyn DataGenerator>>,
    discount: Option<EpisodeDiscount>,
    reference: Option<ReferenceReply>,
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Task")
            .field("name", &self.name)
            .field("system_prompt", &self.system_prompt)
            .field("rubric", &self.rubric.weights())
            .field("datasets", &self.datasets)
            .field("generates_data", &self.generator.is_some())
            .field("discount", &self.discount)
            .finish_non_exhaustive()
    }
}

impl Task {
    /// A task named `name` whose rollouts run `env` and are scored by `rubric`.
    pub fn new(name: impl Into<String>, env: impl EnvFactory + 'static, rubric: Rubric) -> Self {
        Self {
            name: name.into(),
            system_prompt: None,
            env: Arc::new(env),
            rubric: Arc::new(rubric),
            datasets: Vec::new(),
            generator: None,
            discount: None,
            reference: None,
        }
    }

    /// Declares how to write a sample's reference replies, turn by turn.
    pub fn with_reference(
        mut self,
        reference: impl Fn(&DataSample, u32) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.reference = Some(Arc::new(reference));
        self
    }

    /// Whether the task declares reference replies (it can be warm-started).
    pub fn reference_reply_declared(&self) -> bool {
        self.reference.is_some()
    }

    /// The reference reply at turn `turn` of `sample`'s episode, when the task declares one.
    pub fn reference_reply(&self, sample: &DataSample, turn: u32) -> Option<String> {
        self.reference.as_ref().and_then(|f| f(sample, turn))
    }

    /// Whether the task generates its own data (else its rows come from dataset files).
    pub fn generates_data(&self) -> bool {
        self.generator.is_some()
    }

    /// The held-out evaluation set: the whole `eval` split when the task can enumerate it,
    /// else `count` samples drawn from it with `seed`.
    pub fn eval_samples(&self, seed: u64, count: usize) -> Result<Vec<DataSample>, EnvError> {
        let generator = self.generator.as_ref().ok_or_else(|| {
            EnvError::Config(format!(
                "task `{}` does not generate data: name the domain's held-out rows with `data.domains.<domain>.eval_dataset`",
                self.name
            ))
        })?;
        match generator.heldout() {
            Some(all) => Ok(all),
            None => generator.generate("eval", seed, count),
        }
    }

    /// Sets the system prompt (a sample's own system prompt wins over it).
    pub fn with_system_prompt(mut self, prompt: impl Into<String>) -> Self {
        self.system_prompt = Some(prompt.into());
        self
    }

    /// Declares the task's datasets (documentation and defaults for configs).
    pub fn with_datasets(mut self, datasets: Vec<DatasetSpec>) -> Self {
        self.datasets = datasets;
        self
    }

    /// Lets the task generate its own data.
    pub fn with_generator(mut self, generator: impl DataGenerator + 'static) -> Self {
        self.generator = Some(Arc::new(generator));
        self
    }

    /// Replaces the env factory, keeping rubric, prompt and data (e.g. to run the same task's
    /// envs on an env server through [`crate::remote::RemoteEnvFactory`]).
    pub fn with_env(mut self, env: impl EnvFactory + 'static) -> Self {
        self.env = Arc::new(env);
        self
    }

    /// Replaces the rubric (a domain's rubric from config).
    pub fn with_rubric(mut self, rubric: Rubric) -> Self {
        self.rubric = Arc::new(rubric);
        self
    }

    /// The same task under another registered name (a domain's configured copy of a task).
    pub fn renamed(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Discounts the outcome reward over the episode's turns after scoring (seed 001).
    pub fn with_discount(mut self, discount: EpisodeDiscount) -> Self {
        self.discount = Some(discount);
        self
    }

    /// The registered name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The task's system prompt.
    pub fn system_prompt(&self) -> Option<&str> {
        self.system_prompt.as_deref()
    }

    /// The rubric.
    pub fn rubric(&self) -> &Rubric {
        &self.rubric
    }

    /// The declared datasets.
    pub fn datasets(&self) -> &[DatasetSpec] {
        &self.datasets
    }

    /// The episode discount, if any.
    pub fn discount(&self) -> Option<EpisodeDiscount> {
        self.discount
    }

    /// A fresh message env for `sample`.
    pub fn make_env(&self, sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
        self.env.make_env(sample)
    }

    /// The system prompt of `sample`'s episodes: the sample's (its row's, or its domain's as the
    /// sampler set it), else the task's.
    pub fn system_prompt_for(&self, sample: &DataSample) -> Option<String> {
        sample
            .system_prompt
            .clone()
            .or_else(|| self.system_prompt.clone())
    }

    /// A token env for one rollout of `sample`, with [`Task::system_prompt_for`]; env call
    /// durations are recorded under the sample's domain.
    pub fn token_env(
        &self,
        sample: &DataSample,
        renderer: Arc<dyn Renderer>,
        limits: TokenEnvLimits,
    ) -> Result<TokenEnv, EnvError> {
        Ok(TokenEnv::new(
            self.make_env(sample)?,
            renderer,
            limits,
            self.system_prompt_for(sample),
        ))
    }

    /// Scores a finished group: the rubric, then the episode discount when the task has one.
    pub async fn score_group(&self, group: &mut RolloutGroup) {
        self.rubric.score_group(group).await;
        if let Some(d) = self.discount {
            for r in group.rollouts.iter_mut().filter(|r| r.is_terminal()) {
                apply_discount(r, d);
            }
        }
    }

    /// `count` generated samples for `spec` (its split, `train` by default), as a [`Dataset`].
    pub fn generate_dataset(
        &self,
        spec: &DatasetSpec,
        seed: u64,
        count: usize,
    ) -> Result<Dataset, EnvError> {
        let generator = self.generator.as_ref().ok_or_else(|| {
            EnvError::Config(format!("task `{}` does not generate data", self.name))
        })?;
        let split = spec.split.as_deref().unwrap_or("train");
        let samples = generator.generate(split, seed, count)?;
        Ok(Dataset::from_samples(spec.clone(), samples))
    }
}

/// Tasks by name.
#[derive(Debug, Clone, Default)]
pub struct TaskRegistry {
    tasks: BTreeMap<String, Arc<Task>>,
    /// Domain → the registered name of the task that serves it (`[data.domains.<d>] task`, or
    /// the domain's configured copy of a task).
    domain_tasks: BTreeMap<String, String>,
}

impl TaskRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry holding the built-in tasks (`arithmetic`, `sum_digits`, `calculator_tool`,
    /// `stock_tool`, `episodic`, `word_problems`, `qa`, and `python_code` on Linux).
    pub fn builtin() -> Self {
        let mut r = Self::new();
        for task in crate::tasks::builtin_tasks() {
            // Built-in names are distinct by construction.
            let _ = r.register(task);
        }
        r
    }

    /// Adds `task`; a second task with the same name is refused.
    pub fn register(&mut self, task: Task) -> Result<(), EnvError> {
        if self.tasks.contains_key(&task.name) {
            return Err(EnvError::Config(format!(
                "task `{}` is already registered",
                task.name
            )));
        }
        self.tasks.insert(task.name.clone(), Arc::new(task));
        Ok(())
    }

    /// Puts `task` in the place of the task registered under its name (unknown names are
    /// refused).
    pub fn replace(&mut self, task: Task) -> Result<(), EnvError> {
        if !self.tasks.contains_key(&task.name) {
            return Err(EnvError::UnknownTask {
                name: task.name.clone(),
                known: self.names().join(", "),
            });
        }
        self.tasks.insert(task.name.clone(), Arc::new(task));
        Ok(())
    }

    /// The task named `name`.
    pub fn get(&self, name: &str) -> Result<Arc<Task>, EnvError> {
        self.tasks
            .get(name)
            .cloned()
            .ok_or_else(|| EnvError::UnknownTask {
                name: name.to_owned(),
                known: self.names().join(", "),
            })
    }

    /// Serves `domain`'s samples with the task registered as `task`.
    pub fn serve_domain(&mut self, domain: impl Into<String>, task: impl Into<String>) {
        self.domain_tasks.insert(domain.into(), task.into());
    }

    /// Domain → registered name of its task, for the domains that name one.
    pub fn domain_tasks(&self) -> &BTreeMap<String, String> {
        &self.domain_tasks
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tasks.keys().cloned().collect()
    }
}
