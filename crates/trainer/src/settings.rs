//! [`NativeTrainerConfig`]: the native trainer's settings, gathered from the validated config.

use crate::config::TrainerConfig;
use candle_core::DType;
use sluice_model::ForwardOptions;
use sluice_model::config::candle_dtype;

use crate::advantage::AdvantageConfig;
use crate::batcher::BatcherConfig;
use crate::loss::{Aggregation, LossConfig};
use crate::optim::OptimConfig;

/// Everything the native trainer needs to know; [`NativeTrainerConfig::from_config`] builds it
/// from the validated `[trainer]` section and a [`TrainerRunContext`].
#[derive(Debug, Clone, PartialEq)]
pub struct NativeTrainerConfig {
    /// Advantage computation.
    pub advantage: AdvantageConfig,
    /// Objective.
    pub loss: LossConfig,
    /// Loss aggregation over the global batch.
    pub aggregation: Aggregation,
    /// Micro-batch shape and oversized-text policy.
    pub batcher: BatcherConfig,
    /// AdamW and schedule (in optimizer updates: `minibatches` per training step).
    pub optim: OptimConfig,
    /// Optimizer updates per training step, each on its own share of the step's groups (≥ 1).
    pub minibatches: usize,
    /// Dtype of published snapshots (the engines' dtype); master weights stay f32.
    pub publish_dtype: DType,
    /// Where the master weights, the optimizer state and published snapshots live
    /// (`trainer.device`); the initial weights are copied there when they are elsewhere.
    pub device: sluice_core::config::Device,
    /// Rows of logits formed at a time in the training forward.
    pub logits_chunk_rows: usize,
    /// Bytes of logits the training forward keeps for the backward (`trainer.kept_logits_mib`),
    /// which forms the rest again.
    pub kept_logits_bytes: usize,
    /// Sampling temperature of the rollouts: RL log-probs are taken of `softmax(z / T)` so they
    /// match the behaviour log-probs (1 when sampling was greedy, `T = 0`).
    pub temperature: f64,
    /// The run's seed (recorded in checkpoints; LoRA's `A` matrices are drawn from it).
    pub seed: u64,
    /// With `trainer.kl_in_reward` > 0, the KL penalty in the reward.
    pub kl_reward: Option<crate::kl_reward::KlRewardConfig>,
    /// With `trainer.advantage = "gae"`, the critic's settings.
    pub critic: Option<crate::critic::CriticConfig>,
    /// Low-rank adapters trained in place of the full weights (`trainer.lora_rank` > 0).
    pub lora: Option<crate::lora::LoraConfig>,
    /// Compute threads of the forward, backward and optimizer (≥ 1; `trainer.threads`
    /// resolved: 0 there means half the cores beside a native engine, else all of them).
    pub threads: usize,
    /// Keep only each layer's input in the forward and recompute the rest in the backward
    /// (`trainer.activation_checkpointing`): one layer's activations at a time instead of all.
    pub activation_checkpointing: bool,
    /// Dtype of the training forward's products and activations (`trainer.compute_dtype`):
    /// bf16 runs autocast style over the f32 master weights.
    pub compute_dtype: DType,
    /// Wait for the device at the end of each part of a step, so that [`crate::StepParts`]
    /// charge each part its device time on a GPU (which otherwise lands on the next part that
    /// reads a result). Slower by the lost overlap: for benchmarks (`sluice bench trainer`
    /// turns it on for its split of a step's time); no config key.
    pub sync_parts: bool,
}

/// What the native trainer's settings take from outside `[trainer]`, filled in by whoever holds
/// the whole config (`sluice_node::native::setup::native_trainer_config`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainerRunContext {
    /// `run.max_steps`: the schedule's length, in training steps.
    pub max_steps: u64,
    /// `run.seed`.
    pub seed: u64,
    /// `model.dtype`: the engines' dtype, which published snapshots take.
    pub model_dtype: sluice_core::config::DType,
    /// `rollout.temperature`.
    pub rollout_temperature: f64,
    /// `rollout.max_new_tokens`: the constant length of `token_sum_normalized` aggregation.
    pub max_new_tokens: u64,
    /// `replay.filter_zero_advantage`.
    pub filter_zero_advantage: bool,
    /// `engine.backend = "native"`: a native engine in the same process takes half the cores.
    pub native_engine_in_process: bool,
}

impl NativeTrainerConfig {
    /// The settings of the `[trainer]` section `t` in the run `run`.
    pub fn from_config(t: &TrainerConfig, run: &TrainerRunContext) -> Self {
        // The schedule counts optimizer updates; the config counts training steps.
        let optim = OptimConfig {
            learning_rate: t.learning_rate,
            schedule: t.lr_schedule,
            warmup_steps: t.warmup_steps * u64::from(t.minibatches.get()),
            total_steps: run.max_steps * u64::from(t.minibatches.get()),
            weight_decay: t.weight_decay,
            max_grad_norm: t.max_grad_norm,
            ..OptimConfig::default()
        };
        Self {
            advantage: AdvantageConfig {
                kind: t.advantage,
                normalize_std: t.normalize_advantage_std,
                gamma: t.gamma,
                // Per domain: filled in by whoever knows the domains' tasks.
                domain_gamma: Default::default(),
                only_keep_outcome: t.only_keep_outcome,
                pad_situations: t.pad_situations,
                drop_zero_signal_situations: t.drop_zero_signal_situations,
                filter_zero_advantage: run.filter_zero_advantage,
            },
            loss: LossConfig {
                kind: t.loss,
                clip_low: t.clip_low,
                clip_high: t.clip_high,
                tis_level: t.tis_level,
                tis_mode: t.tis_mode,
                is_cap: t.is_cap,
                kl_coef: t.kl_coef,
                kl_estimator: t.kl_estimator,
                dual_clip: t.dual_clip,
                entropy_coeff: t.entropy_coeff,
            },
            aggregation: Aggregation::new(
                t.loss_aggregation,
                usize::try_from(run.max_new_tokens).unwrap_or(usize::MAX),
            ),
            batcher: BatcherConfig {
                rows: t.micro_batch_size.get() as usize,
                row_len: t.max_seq_len.get() as usize,
                oversized: t.oversized_text,
                pad_id: 0,
                share_prompts: t.share_prompts,
            },
            critic: (t.advantage == crate::config::AdvantageKind::Gae).then_some(
                crate::critic::CriticConfig {
                    init: t.critic_path.as_ref().map(std::path::PathBuf::from),
                    gamma: t.gae_gamma,
                    lambda: t.gae_lambda,
                    value_clip: t.value_clip,
                    warmup_steps: t.critic_warmup,
                    // One critic update per share, as the policy takes: the same schedule.
                    optim: OptimConfig {
                        learning_rate: t.critic_learning_rate,
                        ..optim
                    },
                },
            ),
            kl_reward: (t.kl_in_reward > 0.0).then_some(crate::kl_reward::KlRewardConfig {
                coef: t.kl_in_reward,
                target: t.kl_in_reward_target,
                horizon: f64::from(t.kl_in_reward_horizon.get()),
                estimator: t.kl_in_reward_estimator,
            }),
            optim,
            minibatches: t.minibatches.get() as usize,
            publish_dtype: candle_dtype(run.model_dtype),
            compute_dtype: candle_dtype(t.compute_dtype),
            device: t.device,
            logits_chunk_rows: ForwardOptions::default().logits_chunk_rows,
            kept_logits_bytes: usize::try_from(t.kept_logits_mib)
                .unwrap_or(usize::MAX)
                .saturating_mul(1 << 20),
            temperature: if run.rollout_temperature > 0.0 {
                run.rollout_temperature
            } else {
                1.0
            },
            seed: run.seed,
            lora: (t.lora_rank > 0).then(|| crate::lora::LoraConfig {
                rank: t.lora_rank as usize,
                alpha: t.lora_alpha,
                targets: t.lora_targets.clone(),
            }),
            activation_checkpointing: t.activation_checkpointing,
            sync_parts: false,
            threads: sluice_model::threads::role_threads(
                t.threads,
                // A native engine in the same process takes the other half.
                if run.native_engine_in_process { 2 } else { 1 },
            ),
        }
    }
}
