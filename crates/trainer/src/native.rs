//! [`NativeTrainer`]: the candle trainer behind [`TrainerBackend`].
//!
//! One `train_step` is: advantages over the batch's groups (an all-zero batch is skipped and
//! publishes nothing) → the kept groups split into `minibatches` contiguous shares → for each
//! share: aggregation weights over that share, packing into `(B, L)` micro-batches, and for each
//! micro-batch the model's training forward (log-probs + entropy of every target), the loss
//! coefficients on the host, and the backward pass of `Σ c_t · logπ(t)`, gradients accumulated
//! over the share's micro-batches → one AdamW update per share → after the last, one published
//! snapshot `version + 1` copied out of the parameters (never aliasing them).
//!
//! With `advantage = "gae"` the critic's part comes between the packing and the first update
//! (`native/critic.rs`): its values give every token its advantage in the micro-batches, and
//! it takes one update per share.
//!
//! The proximal policy of `decoupled_ppo` is the policy at the start of the step. For the first
//! share its log-probs equal the training forward's (detached), so no second forward is needed;
//! the later shares' proximal log-probs are taken by a forward pass over them before the first
//! update. With one share the ratio to the proximal policy is 1 and nothing is clipped: the
//! objective is the truncated behaviour weight alone. With several, later updates are clipped
//! against where the step started, AReaL's trust region (its `ppo_n_minibatches`).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::config::LossKind;
use candle_core::DType;
use sluice_core::{
    BackendError, PolicyVersion, RolloutGroup, TrainStepOutput, TrainerBackend, WeightSnapshot,
};
use sluice_model::{ComputePool, ForwardOptions, TrainableModel};

use crate::advantage::compute_advantages;
use crate::batcher::{Packing, TrainingText, pack};
use crate::error::TrainerError;
use crate::lora::Adapters;
use crate::loss::{LossStats, TextTokens, aggregation_weights, token_terms};
use crate::optim::AdamW;
use crate::report::{StepStats, step_metrics};
use crate::settings::NativeTrainerConfig;
pub use crate::steps::minibatch_ranges;
use crate::steps::{PartClock, record_packing, slot_logprobs};
pub use update::convert_weights;

mod checkpointing;
mod critic;
mod kl_reward;
mod update;
pub use critic::CRITIC_DIR;
use update::StartPolicy;

/// Model snapshots as the model crate defines them.
pub type ModelSnapshot = sluice_model::ModelWeights;

/// One supervised example: a prompt and the reference completion to imitate.
#[derive(Debug, Clone, Copy)]
pub struct SupervisedExample<'a> {
    /// Prompt token ids (context only).
    pub prompt: &'a [u32],
    /// Completion token ids (the cross-entropy targets).
    pub completion: &'a [u32],
}

/// The candle trainer (see the module docs).
pub struct NativeTrainer {
    config: NativeTrainerConfig,
    model: TrainableModel,
    /// With LoRA, the adapters the optimizer trains in place of the weights.
    adapters: Option<Adapters>,
    /// The frozen initial weights: the KL penalty's reference (`kl_coef`, `kl_in_reward`).
    reference: Option<TrainableModel>,
    /// With `kl_in_reward`, its coefficient.
    kl_controller: Option<crate::kl_reward::KlController>,
    /// With `advantage = "gae"`, the critic, from the first RL step on (it starts from the
    /// policy RL starts from, after any supervised warm-up).
    critic: Option<critic::Critic>,
    optim: AdamW,
    version: PolicyVersion,
    steps: u64,
    published: Arc<ModelSnapshot>,
    aux_source: Option<std::path::PathBuf>,
    /// The threads steps run on (`config.threads`).
    pool: ComputePool,
    /// One single-thread pool per data-parallel worker (`config.threads > 1`; empty else).
    workers: Vec<ComputePool>,
}

impl std::fmt::Debug for NativeTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeTrainer")
            .field("version", &self.version)
            .field("steps", &self.steps)
            .field("optim", &self.optim)
            .finish()
    }
}

impl NativeTrainer {
    /// A trainer starting from `initial` (f32 master copies on its device). The KL reference,
    /// when `kl_coef > 0` or `kl_in_reward > 0`, is a frozen copy of `initial`. `aux_source` is a model directory whose
    /// tokenizer and template files checkpoints copy, so each saved model is complete.
    pub fn new(
        initial: Arc<ModelSnapshot>,
        config: NativeTrainerConfig,
        aux_source: Option<&Path>,
    ) -> Result<Self, TrainerError> {
        // The master weights live on the trainer's device whatever the engines' is.
        let device = sluice_model::device(config.device)?;
        let initial = initial.on_device(&device)?;
        let mut model = master_model(&initial, config.compute_dtype)?;
        let reference = if config.loss.kl_coef > 0.0 || config.kl_reward.is_some() {
            // Frozen: its parameters are converted to the compute dtype once, for every step.
            let mut reference = master_model(&initial, config.compute_dtype)?;
            update::convert_weights(&mut reference)?;
            Some(reference)
        } else {
            None
        };
        let adapters = match &config.lora {
            Some(lora) => Some(Adapters::new(&model, lora, config.seed)?),
            None => None,
        };
        train_adapters(&mut model, adapters.as_ref())?;
        let optim = AdamW::new(trained_vars(&model, adapters.as_ref()), config.optim)?;
        if let Some(a) = &adapters {
            tracing::info!(
                rank = a.config().rank,
                alpha = a.config().alpha,
                adapted_weights = a.len(),
                trained = a.trainable_numbers(),
                of = model.config().num_parameters(),
                "LoRA: adapters train in place of the weights"
            );
        }
        let published = Arc::new(model.snapshot(initial.version, Some(config.publish_dtype))?);
        // On a GPU one thread issues all of the trainer's work: candle queues a thread's kernels
        // on that thread's own stream, so micro-batches on several threads would hand tensors
        // (the step's converted weights, their gradients) between streams that are not ordered
        // with each other, and a GPU gains nothing from host threads anyway.
        let threads = if device.is_cuda() { 1 } else { config.threads };
        let pool = ComputePool::new("trainer-compute", threads)?;
        let workers = if threads > 1 {
            (0..threads)
                .map(|w| ComputePool::new(&format!("trainer-worker{w}"), 1))
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        // Built on this thread, run on the pool's.
        sluice_model::device::settle(&device)?;
        Ok(Self {
            kl_controller: config.kl_reward.map(crate::kl_reward::KlController::new),
            pool,
            workers,
            version: initial.version,
            config,
            model,
            adapters,
            reference,
            critic: None,
            optim,
            steps: 0,
            published,
            aux_source: aux_source.map(Path::to_path_buf),
        })
    }

    /// The trainable model (f32 master parameters).
    pub fn model(&self) -> &TrainableModel {
        &self.model
    }

    /// The settings.
    pub fn config(&self) -> &NativeTrainerConfig {
        &self.config
    }

    /// The threads a step runs on (a step's work is issued from the first of them).
    pub fn compute_pool(&self) -> &ComputePool {
        &self.pool
    }

    /// Waits for the device at the end of each part of a step from now on (or not): see
    /// [`NativeTrainerConfig::sync_parts`].
    pub fn set_sync_parts(&mut self, on: bool) {
        self.config.sync_parts = on;
    }

    /// Takes each decoder layer's backward by candle's autograd over the forward's whole graph
    /// (`true`) instead of by hand (the default): the yardstick of `sluice bench trainer
    /// --graph-backward` ([`sluice_model::TrainableModel::set_hand_backward`]).
    pub fn set_graph_backward(&mut self, on: bool) {
        self.model.set_hand_backward(!on);
    }

    /// A clock for the parts of a step, synchronising where the settings ask.
    fn part_clock(&self) -> PartClock {
        PartClock::start(self.config.sync_parts.then(|| self.model.device().clone()))
    }

    /// Training steps taken (RL and supervised); each may take several optimizer updates.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Optimizer updates taken (`minibatches` per RL step, one per supervised step).
    pub fn optimizer_updates(&self) -> u64 {
        self.optim.step_count()
    }

    /// The most recently published snapshot.
    pub fn published(&self) -> &Arc<ModelSnapshot> {
        &self.published
    }

    /// One RL step on `groups`; `None` when nothing is left to train on, because advantage
    /// filtering kept no group or the packing policy left every text out (no update, nothing
    /// published). Runs on the trainer's compute threads.
    pub fn rl_step(
        &mut self,
        groups: &[RolloutGroup],
    ) -> Result<(StepStats, Option<Arc<ModelSnapshot>>), TrainerError> {
        let pool = self.pool.clone();
        pool.install(|| self.rl_step_here(groups))
    }

    fn rl_step_here(
        &mut self,
        groups: &[RolloutGroup],
    ) -> Result<(StepStats, Option<Arc<ModelSnapshot>>), TrainerError> {
        let started = Instant::now();
        let mut adv = compute_advantages(groups, &self.config.advantage);
        let mut stats = StepStats {
            groups_kept: adv.groups_kept,
            groups_filtered: adv.groups_filtered,
            situations: crate::advantage::situation_summary(groups, &adv),
            ..StepStats::default()
        };
        if adv.is_empty() {
            stats.seconds = started.elapsed().as_secs_f64();
            return Ok((stats, None));
        }
        let versions: Vec<Vec<u64>> = adv
            .texts
            .iter()
            .map(|t| t.text.token_versions.iter().map(|v| v.0).collect())
            .collect();
        let aggregation = self.config.aggregation;
        let group_of_text: Vec<usize> = adv.texts.iter().map(|t| t.group).collect();
        let ranges = minibatch_ranges(&group_of_text, self.config.minibatches);
        let shares: Vec<Vec<TrainingText<'_>>> = ranges
            .iter()
            .map(|range| {
                let texts = &adv.texts[range.clone()];
                let keys: Vec<TextTokens> = texts
                    .iter()
                    .map(|t| TextTokens {
                        group: t.group,
                        rollout: t.rollout,
                        tokens: t.text.completion_tokens(),
                    })
                    .collect();
                let weights = aggregation_weights(&keys, aggregation);
                texts
                    .iter()
                    .zip(weights)
                    .zip(&versions[range.clone()])
                    .map(|((t, weight), versions)| TrainingText {
                        prompt: &t.text.prompt_token_ids,
                        completion: &t.text.completion_token_ids,
                        behaviour: &t.text.logprobs,
                        versions,
                        advantage: t.advantage,
                        weight,
                    })
                    .collect()
            })
            .collect();
        let mut packings: Vec<Packing> = shares
            .iter()
            .map(|texts| pack(texts, &self.config.batcher))
            .collect();
        drop(shares);
        record_packing(&mut stats, &packings);
        stats.parts.packing = started.elapsed().as_secs_f64();
        if stats.trained_tokens == 0 {
            // Every text was left out of the batch (too long for `oversized_text = "reject"`): an
            // optimizer step on no gradient would still count a step and publish a version.
            stats.seconds = started.elapsed().as_secs_f64();
            return Ok((stats, None));
        }
        // With `kl_in_reward`: the penalties (the advantages again from the penalised rewards,
        // or per token for GAE).
        let penalties =
            self.kl_reward_part(groups, &mut adv, &ranges, &mut packings, &mut stats)?;
        // With `advantage = "gae"`: the advantages from the critic, and its updates.
        self.critic_part(
            groups,
            &mut adv,
            &ranges,
            &mut packings,
            penalties.as_deref(),
            &mut stats,
        )?;
        if self.critic_warming_up() {
            self.update_kl_controller(&stats);
            stats.seconds = started.elapsed().as_secs_f64();
            return Ok((stats, None));
        }
        let mut clock = self.part_clock();
        let loss_config = self.config.loss.clone();
        let temperature = self.config.temperature;
        // Proximal log-probs of the later shares, under the step's starting weights.
        let mut proximal: Vec<Option<Vec<Vec<f32>>>> = vec![None; packings.len()];
        if loss_config.kind == LossKind::DecoupledPpo {
            // The first share's update reads the same weights: converted once for both.
            update::convert_weights(&mut self.model)?;
            for (prox, packing) in proximal.iter_mut().zip(&packings).skip(1) {
                *prox = Some(self.loss_slot_logprobs(packing, temperature)?);
            }
        }
        stats.parts.scoring += clock.lap()?;
        let mut lag_sum = 0;
        let mut trained_shares = 0;
        for (share, (packing, prox)) in packings.iter().zip(&proximal).enumerate() {
            if packing.stats.loss_tokens == 0 {
                // A share the packing emptied: no optimizer step on no gradient.
                continue;
            }
            trained_shares += 1;
            // Where the policy the step started from is, for the mismatch and the loss.
            let start = match (share, prox.as_deref()) {
                (0, _) => StartPolicy::Current,
                (_, Some(p)) => StartPolicy::Proximal(p),
                (_, None) => StartPolicy::Moved,
            };
            lag_sum += self.update(packing, start, temperature, &mut stats, |inputs| {
                token_terms(inputs, &loss_config).map_err(TrainerError::from)
            })?;
        }
        // Each share's loss is a mean over its own tokens: report their mean, not their sum.
        stats.loss.loss /= f64::from(trained_shares.max(1));
        stats.mean_lag = lag_sum as f64 / stats.trained_tokens.max(1) as f64;
        let mut clock = self.part_clock();
        self.publish()?;
        stats.parts.publish = clock.lap()?;
        self.update_kl_controller(&stats);
        stats.seconds = started.elapsed().as_secs_f64();
        Ok((stats, Some(Arc::clone(&self.published))))
    }

    /// The adaptive KL-in-reward coefficient moved by the step's measured KL.
    fn update_kl_controller(&mut self, stats: &StepStats) {
        if let (Some(controller), Some(k)) = (&mut self.kl_controller, &stats.kl_reward) {
            controller.update(k.kl.mean(), k.kl.rollouts);
        }
    }

    /// One supervised step: cross-entropy of the reference completions given their prompts, the
    /// mean over examples of each example's token mean, so every demonstration weighs the same
    /// whatever its length (a 2-token arithmetic answer next to a 60-token tool call would
    /// otherwise get a thirtieth of the gradient). Updates the weights, so it publishes a new
    /// version like an RL step. Runs on the trainer's compute threads.
    pub fn supervised_step(
        &mut self,
        examples: &[SupervisedExample<'_>],
    ) -> Result<(StepStats, Arc<ModelSnapshot>), TrainerError> {
        let pool = self.pool.clone();
        pool.install(|| self.supervised_step_here(examples))
    }

    fn supervised_step_here(
        &mut self,
        examples: &[SupervisedExample<'_>],
    ) -> Result<(StepStats, Arc<ModelSnapshot>), TrainerError> {
        let started = Instant::now();
        let total: usize = examples.iter().map(|e| e.completion.len()).sum();
        if total == 0 {
            return Err(TrainerError::Input(
                "supervised step without completion tokens".into(),
            ));
        }
        let zeros: Vec<Vec<(f32, u64)>> = examples
            .iter()
            .map(|e| vec![(0.0, self.version.0); e.completion.len()])
            .collect();
        let behaviour: Vec<Vec<f32>> = zeros
            .iter()
            .map(|z| z.iter().map(|p| p.0).collect())
            .collect();
        let versions: Vec<Vec<u64>> = zeros
            .iter()
            .map(|z| z.iter().map(|p| p.1).collect())
            .collect();
        let with_tokens = examples.iter().filter(|e| !e.completion.is_empty()).count();
        let texts: Vec<TrainingText<'_>> = examples
            .iter()
            .zip(behaviour.iter().zip(&versions))
            .map(|(e, (b, v))| TrainingText {
                prompt: e.prompt,
                completion: e.completion,
                behaviour: b,
                versions: v,
                advantage: 1.0,
                weight: 1.0 / (with_tokens * e.completion.len().max(1)) as f32,
            })
            .collect();
        let mut stats = StepStats::default();
        // ℓ = −lp, so the coefficient is −w and the value −Σ w·lp.
        // Cross-entropy of the model's own distribution: temperature 1.
        let packing = pack(&texts, &self.config.batcher);
        record_packing(&mut stats, std::slice::from_ref(&packing));
        if stats.trained_tokens == 0 {
            return Err(TrainerError::Input(format!(
                "supervised step: all {} examples were left out of the batch (each too long for the packing policy, trainer.oversized_text, or without a prompt)",
                examples.len()
            )));
        }
        stats.parts.packing = started.elapsed().as_secs_f64();
        // A supervised step has no engine log-probs to compare: its start policy is not asked.
        let lag_sum = self.update(&packing, StartPolicy::Moved, 1.0, &mut stats, |inputs| {
            let mut s = LossStats {
                tokens: inputs.logprobs.len() as u64,
                ..LossStats::default()
            };
            let coefficients = inputs.weights.iter().map(|w| -w).collect();
            for (lp, w) in inputs.logprobs.iter().zip(inputs.weights) {
                s.loss -= f64::from(*w) * f64::from(*lp);
            }
            if let Some(e) = inputs.entropy {
                s.entropy_sum = e.iter().map(|&x| f64::from(x)).sum();
                s.entropy_tokens = e.len() as u64;
            }
            Ok(crate::loss::LossTerms {
                coefficients,
                entropy_coefficients: Vec::new(),
                stats: s,
            })
        })?;
        stats.mean_lag = lag_sum as f64 / stats.trained_tokens.max(1) as f64;
        let mut clock = self.part_clock();
        self.publish()?;
        stats.parts.publish = clock.lap()?;
        stats.seconds = started.elapsed().as_secs_f64();
        Ok((stats, Arc::clone(&self.published)))
    }

    /// Log-probs of every loss slot of `packing`, one vector per micro-batch (slots in order),
    /// under the current weights: the proximal policy of a later minibatch.
    fn loss_slot_logprobs(
        &self,
        packing: &Packing,
        temperature: f64,
    ) -> Result<Vec<Vec<f32>>, TrainerError> {
        let options = ForwardOptions {
            logits_chunk_rows: self.config.logits_chunk_rows,
            temperature,
            kept_logits_bytes: 0,
        };
        // Data-parallel over the workers like the update's micro-batches: each micro-batch's
        // forward is the same computation on any thread, so the log-probs are the serial ones.
        self.each_micro_batch(&packing.micro_batches, |mb| {
            slot_logprobs(&self.model, mb, options, "proximal log-probs")
        })
    }

    /// Ends a training step: counts it and publishes `version + 1`.
    fn publish(&mut self) -> Result<(), TrainerError> {
        self.steps += 1;
        self.version = self.version.next();
        let dtype = self.config.publish_dtype;
        // On a GPU every parameter's copy in one launch; elsewhere (or when the parameters do
        // not qualify) the model's copy per tensor.
        let tensors: Vec<&candle_core::Tensor> = self
            .model
            .vars()
            .iter()
            .map(|(_, v)| v.as_tensor())
            .collect();
        let weights = match crate::adamw_kernel::snapshot(&tensors, dtype)
            .map_err(crate::error::tensor_ctx("published snapshot"))?
        {
            Some(fresh) => self.model.snapshot_of(self.version, fresh)?,
            None => self.model.snapshot(self.version, Some(dtype))?,
        };
        // The engines read it on their own threads: the copy is finished before it is handed
        // over. Every step that moves the weights ends here, so a step leaves the device idle
        // (a checkpoint taken between steps, on another thread, reads finished weights).
        sluice_model::device::settle(weights.device())?;
        self.published = Arc::new(weights);
        Ok(())
    }
}

impl Drop for NativeTrainer {
    fn drop(&mut self) {
        // The trainer can be dropped on a thread that never did its GPU work (the node's, at
        // shutdown): its buffers are freed there.
        sluice_model::device::bind(self.model.device());
    }
}

impl TrainerBackend for NativeTrainer {
    fn version(&self) -> PolicyVersion {
        self.version
    }

    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError> {
        let (mut stats, snapshot) = self.rl_step(batch).map_err(TrainerError::into_backend)?;
        if stats.rejected_texts > 0 {
            tracing::warn!(
                rejected = stats.rejected_texts,
                "training texts left out by the batcher"
            );
        }
        let situations = std::mem::take(&mut stats.situations);
        Ok(TrainStepOutput {
            metrics: step_metrics(&stats, self.version),
            weights: snapshot.map(|s| s.to_envelope()),
            trained_tokens: stats.trained_tokens as u64,
            situations: Some(situations),
        })
    }

    fn snapshot(&self) -> WeightSnapshot {
        self.published.to_envelope()
    }

    fn checkpoint(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.save(dir).map_err(TrainerError::into_backend)
    }

    fn restore(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.load(dir).map_err(TrainerError::into_backend)
    }

    fn set_version(&mut self, version: PolicyVersion) -> Result<(), BackendError> {
        if version < self.version {
            return Err(BackendError::new(
                "version_backwards",
                format!("cannot relabel weights {} as older {version}", self.version),
            ));
        }
        let published = self
            .model
            .snapshot(version, Some(self.config.publish_dtype))
            .map_err(|e| TrainerError::from(e).into_backend())?;
        self.version = version;
        self.published = Arc::new(published);
        Ok(())
    }
}

/// With LoRA, has `model`'s backward form the adapters' gradients in place of the weights'.
fn train_adapters(
    model: &mut TrainableModel,
    adapters: Option<&Adapters>,
) -> Result<(), TrainerError> {
    let low_rank = adapters.map(Adapters::low_rank).unwrap_or_default();
    Ok(model.set_low_rank(low_rank)?)
}

/// What the optimizer trains: the adapters with LoRA, else every parameter.
fn trained_vars(model: &TrainableModel, adapters: Option<&Adapters>) -> Vec<candle_core::Var> {
    match adapters {
        Some(a) => a.vars(),
        None => model.vars().iter().map(|(_, v)| v.clone()).collect(),
    }
}

/// f32 master parameters from `snapshot`, computing in `compute` (`trainer.compute_dtype`).
fn master_model(snapshot: &ModelSnapshot, compute: DType) -> Result<TrainableModel, TrainerError> {
    let mut model = TrainableModel::from_snapshot(snapshot, DType::F32)?;
    model.set_compute_dtype(compute)?;
    Ok(model)
}
