//! `[trainer]` and `[trainer.simulated]`, validated.

use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

/// Policy-gradient loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// Clipped ratio against the behaviour log-probs (PPO / GRPO).
    Ppo,
    /// Truncated importance sampling.
    Tis,
    /// AReaL's decoupled objective: clip against a recomputed proximal policy.
    DecoupledPpo,
    /// GSPO: one clipped ratio per text, the geometric mean of its tokens' ratios.
    Gspo,
}

/// How the KL penalty estimates `KL(π_θ ‖ π_ref)` from a sampled token (Schulman's k1, k2, k3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `log π_θ − log π_ref`: unbiased, its value often negative.
    K1,
    /// `½ (log π_θ − log π_ref)²`: low variance, biased.
    K2,
    /// `r − log r − 1` with `r = π_ref/π_θ`: unbiased and never negative (GRPO's).
    K3,
}

impl KlEstimator {
    /// The estimate at one sampled token whose log-ratio is `d = log π − log π_ref`.
    pub fn at(self, d: f64) -> f64 {
        match self {
            KlEstimator::K1 => d,
            KlEstimator::K2 => 0.5 * d * d,
            KlEstimator::K3 => (-d).exp() + d - 1.0,
        }
    }
}

/// Learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// Constant at the peak.
    Constant,
    /// Cosine decay to zero at `max_steps`.
    Cosine,
}

/// How advantages are baselined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageKind {
    /// GRPO: reward minus the group mean.
    Group,
    /// Baseline within (group × situation label).
    Situational,
    /// RLOO: each rollout against the mean of the others in its group.
    Rloo,
    /// REINFORCE++ with a group baseline: reward minus the group mean, then whitened over the
    /// step's tokens.
    ReinforcePlusPlusBaseline,
    /// PPO's generalized advantage estimation against a learned critic: one advantage per
    /// token, whitened over the step's tokens.
    Gae,
}

/// How per-token losses are averaged over the global batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossAggregation {
    /// Every completion token counts the same.
    TokenMean,
    /// Every training text counts once.
    SequenceMean,
    /// Every rollout counts once, however many texts it has.
    RolloutNormalized,
    /// Each text's token sum over a constant length (Dr. GRPO), every text once.
    TokenSumNormalized,
}

/// Granularity of truncated importance weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TisLevel {
    /// One weight per token.
    Token,
    /// One weight per training text (product of its token ratios).
    Sequence,
}

/// What happens to an importance weight above the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TisMode {
    /// Use the cap instead.
    Truncate,
    /// Drop the token (or sequence) from the loss.
    Mask,
}

/// What happens to a training text longer than `max_seq_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OversizedText {
    /// Cut into row-sized pieces (later pieces lose the context before them).
    Split,
    /// Leave it out of the batch (counted).
    Reject,
}

sluice_core::impl_choice!(
    LossKind,
    KlEstimator,
    LrSchedule,
    AdvantageKind,
    LossAggregation,
    TisLevel,
    TisMode,
    OversizedText,
);

/// `[trainer]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainerConfig {
    /// Loss.
    pub loss: LossKind,
    /// Device of the native trainer's master weights (`model.device` unless set).
    pub device: sluice_core::config::Device,
    /// Peak learning rate (> 0).
    pub learning_rate: f64,
    /// Schedule after warmup.
    pub lr_schedule: LrSchedule,
    /// Warmup steps.
    pub warmup_steps: u64,
    /// AdamW weight decay (≥ 0).
    pub weight_decay: f64,
    /// Global gradient-norm clip (> 0).
    pub max_grad_norm: f64,
    /// Lower clip ε, in [0, 1).
    pub clip_low: f64,
    /// Upper clip ε (≥ 0).
    pub clip_high: f64,
    /// KL coefficient (≥ 0).
    pub kl_coef: f64,
    /// The KL penalty's estimator.
    pub kl_estimator: KlEstimator,
    /// Dual-clip bound `c` of the clipped losses (0 = off, else > 1).
    pub dual_clip: f64,
    /// Entropy bonus coefficient (≥ 0; 0 = off).
    pub entropy_coeff: f64,
    /// Micro-batch rows `B`.
    pub micro_batch_size: NonZeroU32,
    /// Micro-batch row length `L`.
    pub max_seq_len: NonZeroU32,
    /// Optimizer updates (minibatches) per training step.
    pub minibatches: NonZeroU32,
    /// Compute threads of the native trainer; 0 = automatic (half the cores beside a native
    /// engine, else all).
    pub threads: u32,
    /// Recompute each layer's activations in the backward instead of keeping them.
    pub activation_checkpointing: bool,
    /// MiB of the head's logits kept from the forward for the backward, which forms the rest
    /// again.
    pub kept_logits_mib: u64,
    /// Dtype of the training forward's products and activations (`f32` or `bf16`, autocast
    /// style: norms' statistics, softmax, log-probs and the loss stay f32).
    pub compute_dtype: sluice_core::config::DType,
    /// Pack each prompt once for the completions that share it (same log-probs and gradients).
    pub share_prompts: bool,
    /// Advantage baseline.
    pub advantage: AdvantageKind,
    /// Divide by group std.
    pub normalize_advantage_std: bool,
    /// Per-turn discount of the final reward, in (0, 1].
    pub gamma: f64,
    /// Train only on the last turn of each rollout.
    pub only_keep_outcome: bool,
    /// Pad shorter rollouts into situation baselines.
    pub pad_situations: bool,
    /// Leave zero-signal situations out of training.
    pub drop_zero_signal_situations: bool,
    /// Loss aggregation.
    pub loss_aggregation: LossAggregation,
    /// Importance-weight granularity.
    pub tis_level: TisLevel,
    /// Importance weights above the cap.
    pub tis_mode: TisMode,
    /// Importance-weight cap (> 0).
    pub is_cap: f64,
    /// Texts longer than `max_seq_len`.
    pub oversized_text: OversizedText,
    /// Rank of the LoRA adapters (0 = off: every weight trains).
    pub lora_rank: u32,
    /// LoRA's `alpha` (> 0): the adapters' update is scaled by `alpha / lora_rank`.
    pub lora_alpha: f64,
    /// The projections LoRA adapts, by module name (`crate::lora::TARGETS`), `all-linear`
    /// resolved.
    pub lora_targets: Vec<String>,
    /// GAE's per-token discount `γ`, in (0, 1].
    pub gae_gamma: f64,
    /// GAE's `λ`, in [0, 1].
    pub gae_lambda: f64,
    /// The critic's peak learning rate (> 0; its schedule is the policy's).
    pub critic_learning_rate: f64,
    /// The directory the critic starts from (a one-label classifier); unset: the policy as RL
    /// starts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub critic_path: Option<String>,
    /// The critic's value clip `ε_v` around the step's starting values (> 0).
    pub value_clip: f64,
    /// RL steps at the start that train the critic alone (0: none).
    pub critic_warmup: u64,
    /// KL penalty in the reward, `β` (≥ 0; 0 = off): each rollout's reward less `β` times its
    /// tokens' summed KL estimate to the reference.
    pub kl_in_reward: f64,
    /// The adaptive controller's target KL per token (unset: `β` stays fixed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_in_reward_target: Option<f64>,
    /// The adaptive controller's horizon, in rollouts.
    pub kl_in_reward_horizon: NonZeroU32,
    /// The KL penalty in the reward's per-token estimate.
    pub kl_in_reward_estimator: KlEstimator,
    /// `[trainer.simulated]`
    pub simulated: SimTrainerConfig,
}

/// `[trainer.simulated]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimTrainerConfig {
    /// Whether the simulated trainer runs instead of the real one.
    pub enabled: bool,
    /// `c` in `c + d · tokens`, simulated seconds.
    pub step_base_seconds: f64,
    /// `d` in `c + d · tokens`, simulated seconds per token.
    pub step_seconds_per_token: f64,
}
