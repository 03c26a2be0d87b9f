//! The critic of `advantage = "gae"` and the step's part that uses it ([`crate::critic`] has
//! the arithmetic).
//!
//! The critic is a copy of the policy as RL starts (after any supervised warm-up; the first RL
//! step makes it, or the next one after a resume from a checkpoint without one), trained in
//! full, with a value head: one
//! `(1, hidden)` row that reads each slot's final-norm hidden state (Hugging Face's
//! token-classification `score` with one label, verl's critic). The head starts at zero, so the
//! first values are 0 and the first advantages the plain discounted rewards; the LM head is not
//! used and not trained (no optimizer state is kept for it).
//!
//! In a step, before any update: the critic's values at every loss slot of every share
//! (`v₀`), GAE over each rollout's tokens, the advantages whitened and written into the
//! micro-batches; then for each share one critic update on the clipped value loss (token mean),
//! and the policy's updates as for any other advantage. The critic's micro-batches run one after
//! another on the trainer's threads.

use std::path::Path;

use candle_core::{DType, Tensor, Var};
use sluice_core::RolloutGroup;
use sluice_model::{Activations, TrainableModel};

use super::{ModelSnapshot, NativeTrainer, master_model};
use crate::advantage::{AdvantageBatch, ScoredText};
use crate::batcher::{MicroBatch, Packing};
use crate::checkpoint;
use crate::critic::{CriticConfig, CriticStats, ValueTargets, gae, value_terms, whiten};
use crate::error::{TrainerError, tensor_ctx};
use crate::optim::{AdamW, GradAccumulator};
use crate::report::StepStats;
use crate::steps::{packed, pick, rollouts, slot_index, slot_places};

/// The critic's directory in a checkpoint (a checkpoint of its own: model, optimizer, state).
pub const CRITIC_DIR: &str = "critic";
/// The value head's file in [`CRITIC_DIR`].
const HEAD_FILE: &str = "value_head.safetensors";
/// The value head's tensor, as Hugging Face's token classification names it.
const HEAD_TENSOR: &str = "score.weight";

/// The critic: a model, its value head and their optimizer.
pub(super) struct Critic {
    model: TrainableModel,
    head: Var,
    optim: AdamW,
    /// The optimizer's slot of each of the model's parameters (`None`: the LM head).
    slots: Vec<Option<usize>>,
    config: CriticConfig,
    /// RL steps it trained in (`step` of its checkpoint's state): the warm-up's clock.
    steps: u64,
}

impl Critic {
    /// A critic starting from `initial`, its value head at zero.
    pub(super) fn new(
        initial: &ModelSnapshot,
        config: CriticConfig,
        compute: DType,
    ) -> Result<Self, TrainerError> {
        let model = master_model(initial, compute)?;
        let hidden = model.config().hidden_size;
        let head = Var::zeros((1, hidden), DType::F32, model.device())
            .map_err(tensor_ctx("value head"))?;
        Self::assemble(model, head, config)
    }

    /// A critic starting from the one-label classifier in `dir` (`trainer.critic_path`: a
    /// reward model, or a critic saved as a token classifier), its head `score.weight` the
    /// value head. It reads the policy's token ids, so its vocabulary must be the policy's
    /// (`vocab_size`); its other shapes are its own.
    pub(super) fn from_classifier(
        dir: &Path,
        config: CriticConfig,
        compute: DType,
        device: &candle_core::Device,
        vocab_size: usize,
    ) -> Result<Self, TrainerError> {
        let options = sluice_model::LoadOptions {
            dtype: Some(DType::F32),
            device: device.clone(),
        };
        let (weights, head) = sluice_model::reward::load_classifier(dir, &options)
            .map_err(|e| TrainerError::Input(format!("trainer.critic_path: {e}")))?;
        let theirs = weights.config().vocab_size;
        if theirs != vocab_size {
            return Err(TrainerError::Input(format!(
                "trainer.critic_path: {} has a vocabulary of {theirs} tokens, the policy {vocab_size}: the critic reads the policy's tokens, so it must share its tokenizer",
                dir.display()
            )));
        }
        let model = master_model(&weights, compute)?;
        let head = Var::from_tensor(&head).map_err(tensor_ctx("value head"))?;
        tracing::info!(dir = %dir.display(), "the critic starts from a classifier's weights and head");
        Self::assemble(model, head, config)
    }

    fn assemble(
        model: TrainableModel,
        head: Var,
        config: CriticConfig,
    ) -> Result<Self, TrainerError> {
        let mut slots = Vec::with_capacity(model.vars().len());
        let mut trained = Vec::with_capacity(model.vars().len() + 1);
        for (name, var) in model.vars() {
            if name == sluice_model::names::LM_HEAD {
                slots.push(None);
            } else {
                slots.push(Some(trained.len()));
                trained.push(var.clone());
            }
        }
        trained.push(head.clone());
        let optim = AdamW::new(trained, config.optim)?;
        Ok(Self {
            model,
            head,
            optim,
            slots,
            config,
            steps: 0,
        })
    }

    /// The optimizer's slot of the value head (the last).
    fn head_slot(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// The critic's values at `mb`'s loss slots, in order (no gradient).
    fn values(&self, mb: &MicroBatch) -> Result<Vec<f32>, TrainerError> {
        let slots = mb.loss_slots();
        if slots.is_empty() {
            return Ok(Vec::new());
        }
        let (values, _) = self.model.values_for_backward(
            &packed(mb),
            self.head.as_tensor(),
            Activations::Recomputed,
        )?;
        let index = slot_index(&slots, self.model.device())?;
        Ok(pick(&values.detach(), &index, "critic values")?.1)
    }

    /// Gradients of the value loss over `mb`'s loss slots, each token weighted `weight`, keyed
    /// by optimizer slot; adds the loss to `stats`.
    fn micro_gradients(
        &self,
        mb: &MicroBatch,
        targets: &ValueTargets,
        weight: f32,
        activations: Activations,
        stats: &mut CriticStats,
    ) -> Result<Vec<(usize, Tensor)>, TrainerError> {
        let slots = mb.loss_slots();
        let (values, saved) =
            self.model
                .values_for_backward(&packed(mb), self.head.as_tensor(), activations)?;
        let index = slot_index(&slots, self.model.device())?;
        let (picked, host) = pick(&values, &index, "critic values")?;
        let weights = vec![weight; slots.len()];
        let terms = value_terms(&host, targets, &weights, self.config.value_clip);
        stats.tokens += slots.len() as u64;
        stats.clipped += terms.clipped;
        stats.loss += terms.loss;
        let surrogate = Tensor::new(terms.coefficients.as_slice(), self.model.device())
            .and_then(|c| (picked * c)?.sum_all())
            .map_err(tensor_ctx("value loss"))?;
        let store = self.model.backward_saved(&surrogate, saved)?;
        let mut grads: Vec<(usize, Tensor)> = self
            .model
            .parameter_gradients(&store)
            .into_iter()
            .filter_map(|(i, g)| self.slots[i].map(|slot| (slot, g)))
            .collect();
        if let Some(g) = store.get(self.head.as_tensor()) {
            grads.push((self.head_slot(), g.clone()));
        }
        Ok(grads)
    }

    /// Writes the critic into `dir` ([`CRITIC_DIR`] of a checkpoint being written).
    pub(super) fn save(
        &self,
        dir: &Path,
        state: &checkpoint::TrainerState,
    ) -> Result<(), TrainerError> {
        let master = self
            .model
            .snapshot(sluice_core::PolicyVersion(state.version), None)?;
        let state = checkpoint::TrainerState {
            step: self.steps,
            optimizer_step: self.optim.step_count(),
            learning_rate: self.config.optim.learning_rate,
            next_learning_rate: self.config.optim.learning_rate_at(self.optim.step_count()),
            ..state.clone()
        };
        checkpoint::save(
            dir,
            &master,
            None,
            &self.optim.state_tensors(),
            &state,
            |tmp| {
                let path = tmp.join(HEAD_FILE);
                let head = self
                    .head
                    .as_tensor()
                    .to_device(&candle_core::Device::Cpu)
                    .map_err(|e| TrainerError::checkpoint(&path, e))?;
                candle_core::safetensors::save(
                    &std::collections::HashMap::from([(HEAD_TENSOR.to_owned(), head)]),
                    &path,
                )
                .map_err(|e| TrainerError::checkpoint(&path, e))
            },
        )
    }

    /// The critic saved in `dir` by [`Critic::save`], trained on with `config`.
    pub(super) fn load(
        dir: &Path,
        config: CriticConfig,
        compute: DType,
        device: &candle_core::Device,
    ) -> Result<Self, TrainerError> {
        let (snapshot, optim_tensors, state) = checkpoint::load(dir, device)?;
        let model = master_model(&snapshot, compute)?;
        let path = dir.join(HEAD_FILE);
        let mut tensors = candle_core::safetensors::load(&path, device)
            .map_err(|e| TrainerError::checkpoint(&path, e))?;
        let hidden = model.config().hidden_size;
        let head = tensors
            .remove(HEAD_TENSOR)
            .filter(|t| t.dims() == [1, hidden] && t.dtype() == DType::F32)
            .ok_or_else(|| {
                TrainerError::checkpoint(
                    &path,
                    format!("no f32 tensor `{HEAD_TENSOR}` of shape [1, {hidden}]"),
                )
            })?;
        let head = Var::from_tensor(&head).map_err(tensor_ctx("value head"))?;
        let mut critic = Self::assemble(model, head, config)?;
        critic
            .optim
            .load_state(optim_tensors, state.optimizer_step)
            .map_err(|e| TrainerError::checkpoint(dir.join(checkpoint::OPTIMIZER_FILE), e))?;
        critic.steps = state.step;
        Ok(critic)
    }
}

impl NativeTrainer {
    /// The critic's part of an RL step on the packed shares (see the module docs), making the
    /// critic first if this is the first RL step: the advantages written into `packings`, one
    /// critic update per share, the figures in `stats`.
    pub(super) fn critic_part<'a>(
        &mut self,
        groups: &'a [RolloutGroup],
        adv: &mut AdvantageBatch<'a>,
        ranges: &[std::ops::Range<usize>],
        packings: &mut [Packing],
        penalties: Option<&[Vec<f64>]>,
        stats: &mut StepStats,
    ) -> Result<(), TrainerError> {
        let Some(config) = self.config.critic.clone() else {
            return Ok(());
        };
        let mut clock = self.part_clock();
        if self.critic.is_none() {
            let compute = self.config.compute_dtype;
            let critic = match config.init.clone() {
                Some(dir) => {
                    let vocab = self.model.config().vocab_size;
                    Critic::from_classifier(&dir, config, compute, self.model.device(), vocab)?
                }
                None => {
                    let start = self.model.snapshot(self.version, None)?;
                    Critic::new(&start, config, compute)?
                }
            };
            self.critic = Some(critic);
        }
        let mut critic = CriticStats::default();
        let targets = self.gae_advantages(
            groups,
            &mut adv.texts,
            ranges,
            packings,
            penalties,
            &mut critic,
        )?;
        stats.situations = crate::advantage::situation_summary(groups, adv);
        stats.parts.scoring += clock.lap()?;
        for (packing, targets) in packings.iter().zip(&targets) {
            if packing.stats.loss_tokens > 0 {
                self.critic_update(packing, targets, &mut critic)?;
            }
        }
        stats.critic = Some(critic);
        stats.parts.critic += clock.lap()?;
        if let Some(critic) = &mut self.critic {
            critic.steps += 1;
        }
        Ok(())
    }

    /// Whether this RL step (its critic part done) is one of `trainer.critic_warmup`'s, where
    /// the policy waits: no update, nothing published, the batch spent on the critic.
    pub(super) fn critic_warming_up(&self) -> bool {
        self.critic
            .as_ref()
            .is_some_and(|c| c.steps <= c.config.warmup_steps)
    }

    /// GAE for the step's texts `texts` (packed share by share into `packings`, share `s`
    /// holding `texts[ranges[s]]`; `penalties`, the KL penalty's reward per text and token when
    /// it is on): the critic's starting values at every loss slot, each rollout's advantages
    /// and returns, the advantages whitened over the step's tokens and
    /// written into the micro-batches (and each text's mean into `texts`). Returns what each
    /// micro-batch's value loss reads.
    fn gae_advantages(
        &mut self,
        groups: &[RolloutGroup],
        texts: &mut [ScoredText<'_>],
        ranges: &[std::ops::Range<usize>],
        packings: &mut [Packing],
        penalties: Option<&[Vec<f64>]>,
        stats: &mut CriticStats,
    ) -> Result<Vec<Vec<ValueTargets>>, TrainerError> {
        let critic = self
            .critic
            .as_mut()
            .ok_or_else(|| TrainerError::Input("advantage = \"gae\" without a critic".into()))?;
        super::update::convert_weights(&mut critic.model)?;
        let critic = self.critic.as_ref().expect("checked above");
        // Each text's values, token by token: 0 where no slot scored it (a text the packing
        // left out, which trains nothing either).
        let mut values: Vec<Vec<f32>> = texts
            .iter()
            .map(|t| vec![0.0; t.text.completion_tokens()])
            .collect();
        let mut packed_text = vec![false; texts.len()];
        let mut placed: Vec<Vec<Vec<(usize, usize)>>> = Vec::with_capacity(packings.len());
        for (packing, range) in packings.iter().zip(ranges) {
            let share = &texts[range.clone()];
            let at = slot_places(packing, share, range.start)?;
            let scored = self.each_micro_batch(&packing.micro_batches, |mb| critic.values(mb))?;
            for (places, scores) in at.iter().zip(scored) {
                for (&(text, c), v) in places.iter().zip(scores) {
                    values[text][c] = v;
                    packed_text[text] = true;
                }
            }
            placed.push(at);
        }
        let c = &critic.config;
        let mut advantages: Vec<Vec<f64>> = vec![Vec::new(); texts.len()];
        let mut returns: Vec<Vec<f64>> = vec![Vec::new(); texts.len()];
        for rollout in rollouts(texts) {
            let reward =
                groups[texts[rollout.start].group].rollouts[texts[rollout.start].rollout].reward;
            let chain: Vec<f32> = rollout
                .clone()
                .flat_map(|i| values[i].iter().copied())
                .collect();
            // The KL penalty's reward on every token where it is on, the rollout's after the last.
            let mut rewards: Vec<f64> = match penalties {
                Some(p) => rollout.clone().flat_map(|i| p[i].iter().copied()).collect(),
                None => vec![0.0; chain.len()],
            };
            if let Some(last) = rewards.last_mut() {
                *last += reward;
            }
            let (a, r) = gae(&chain, &rewards, c.gamma, c.lambda);
            let mut from = 0;
            for i in rollout {
                let n = values[i].len();
                advantages[i] = a[from..from + n].to_vec();
                returns[i] = r[from..from + n].to_vec();
                from += n;
            }
        }
        // Whitened over the tokens that train (a text the packing left out has no say).
        for (a, &p) in advantages.iter_mut().zip(&packed_text) {
            if !p {
                a.clear();
            }
        }
        whiten(&mut advantages);
        for (i, text) in texts
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| packed_text[*i])
        {
            let a = &advantages[i];
            text.advantage = (a.iter().sum::<f64>() / a.len().max(1) as f64) as f32;
            for (v, r) in values[i].iter().zip(&returns[i]) {
                stats.score(f64::from(*v), *r);
            }
        }
        let mut targets = Vec::with_capacity(packings.len());
        for (packing, at) in packings.iter_mut().zip(&placed) {
            let mut share = Vec::with_capacity(at.len());
            for (mb, places) in packing.micro_batches.iter_mut().zip(at) {
                let mut t = ValueTargets::default();
                for (&slot, &(text, c)) in mb.loss_slots().iter().zip(places) {
                    mb.advantages[slot] = advantages[text][c] as f32;
                    t.returns.push(returns[text][c] as f32);
                    t.old_values.push(values[text][c]);
                }
                share.push(t);
            }
            targets.push(share);
        }
        Ok(targets)
    }

    /// One critic update on `packing`'s value loss (each token weighted alike over the share).
    fn critic_update(
        &mut self,
        packing: &Packing,
        targets: &[ValueTargets],
        stats: &mut CriticStats,
    ) -> Result<(), TrainerError> {
        let activations = if self.config.activation_checkpointing {
            Activations::Recomputed
        } else {
            Activations::Kept
        };
        let critic = self
            .critic
            .as_mut()
            .ok_or_else(|| TrainerError::Input("advantage = \"gae\" without a critic".into()))?;
        super::update::convert_weights(&mut critic.model)?;
        let tokens = packing.stats.loss_tokens.max(1);
        let weight = 1.0 / tokens as f32;
        let mut grads = GradAccumulator::new(critic.head_slot() + 1);
        let mut loss = CriticStats::default();
        for (mb, t) in packing.micro_batches.iter().zip(targets) {
            if t.returns.is_empty() {
                continue;
            }
            grads.add_gradients(critic.micro_gradients(
                mb,
                t,
                weight,
                activations,
                &mut loss,
            )?)?;
        }
        if !loss.loss.is_finite() {
            return Err(TrainerError::NonFinite {
                what: "value loss",
                value: loss.loss,
            });
        }
        critic.model.clear_step_weights();
        let report = critic.optim.step(&grads)?;
        stats.tokens += loss.tokens;
        stats.clipped += loss.clipped;
        stats.loss += loss.loss;
        stats.updates += 1;
        stats.grad_norm = report.grad_norm;
        Ok(())
    }
}
