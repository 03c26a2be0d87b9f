//! `[trainer]` and `[trainer.simulated]` as serde reads them.

use serde::{Deserialize, Serialize};

/// `[trainer]`: optimisation and loss.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawTrainer {
    /// `ppo`, `tis`, `decoupled_ppo` or `gspo`.
    pub loss: String,
    /// `cpu` or `cuda:N` of the native trainer (default `model.device`).
    pub device: Option<String>,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// `constant` or `cosine` (after warmup).
    pub lr_schedule: String,
    /// Linear warmup steps.
    pub warmup_steps: i64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
    /// Lower clip ε of the ratio (`1 − ε`); unset: chosen from the loss
    /// (`validate::trainer::default_clip`).
    pub clip_low: Option<f64>,
    /// Upper clip ε of the ratio (`1 + ε`); unset: chosen from the loss.
    pub clip_high: Option<f64>,
    /// KL penalty coefficient against the reference policy (0 disables it).
    pub kl_coef: f64,
    /// `k1`, `k2` or `k3`: the KL penalty's estimator.
    pub kl_estimator: String,
    /// Dual-clip bound `c` (> 1) of the clipped terms with a negative advantage (0 disables it).
    pub dual_clip: f64,
    /// Entropy bonus coefficient: the loss subtracts this times each token's policy entropy,
    /// aggregated as the loss is (0 disables it).
    pub entropy_coeff: f64,
    /// Rows `B` of one packed micro-batch.
    pub micro_batch_size: i64,
    /// Row length `L` of one packed micro-batch, tokens.
    pub max_seq_len: i64,
    /// Optimizer updates per training step: the step's groups are split into this many
    /// minibatches, one update each, and the step still publishes one version. Unset: chosen
    /// from the loss (see `validate::trainer::default_minibatches`).
    pub minibatches: Option<i64>,
    /// `group`, `situational`, `rloo`, `reinforce_plus_plus_baseline` or `gae`.
    pub advantage: String,
    /// Divide group advantages by the group's reward std; unset: chosen from the advantage.
    pub normalize_advantage_std: Option<bool>,
    /// Discount of the final reward per turn back from the end of an episode, in (0, 1].
    pub gamma: f64,
    /// Train only on the last turn of each rollout.
    pub only_keep_outcome: bool,
    /// Situational advantages: pad shorter rollouts into every situation baseline.
    pub pad_situations: bool,
    /// Situational advantages: leave out situations whose texts all have zero advantage.
    pub drop_zero_signal_situations: bool,
    /// `token_mean`, `sequence_mean`, `rollout_normalized` or `token_sum_normalized`; unset:
    /// chosen from the loss.
    pub loss_aggregation: Option<String>,
    /// `token` or `sequence` importance weights (`tis`).
    pub tis_level: String,
    /// `truncate` or `mask` importance weights above `is_cap`.
    pub tis_mode: String,
    /// Importance-weight cap (`tis`, `decoupled_ppo`).
    pub is_cap: f64,
    /// `split` or `reject` a training text longer than `max_seq_len`.
    pub oversized_text: String,
    /// Compute threads of the native trainer (0 = half the cores beside a native engine, else
    /// all of them).
    pub threads: i64,
    /// Keep only each layer's input in the forward and recompute the rest in the backward.
    pub activation_checkpointing: bool,
    /// MiB of the head's logits the forward keeps for the backward; unset: 0 with activation
    /// checkpointing, else 8192 on a GPU and 1024 on the CPU.
    pub kept_logits_mib: Option<i64>,
    /// Dtype of the forward's products and activations (`f32` or `bf16`); unset: `bf16` on a
    /// GPU, `f32` on the CPU. Master weights and AdamW moments stay f32 either way.
    pub compute_dtype: Option<String>,
    /// Pack a prompt once for all the completions that continue it (a group's rollouts).
    pub share_prompts: bool,
    /// Rank of the LoRA adapters trained in place of the full weights (0: every weight trains).
    pub lora_rank: i64,
    /// LoRA's `alpha`: the adapters' update is scaled by `alpha / rank`.
    pub lora_alpha: f64,
    /// The projections LoRA adapts, by module name (`all-linear`: every one).
    pub lora_targets: Vec<String>,
    /// `advantage = "gae"`: the discount of each token's reward back from the end.
    pub gae_gamma: f64,
    /// `advantage = "gae"`: GAE's `λ` (1: the return minus the value; 0: the one-step TD error).
    pub gae_lambda: f64,
    /// `advantage = "gae"`: the critic's peak learning rate; unset: `learning_rate`.
    pub critic_learning_rate: Option<f64>,
    /// `advantage = "gae"`: the model directory the critic starts from (a one-label
    /// classifier: a reward model, or a critic saved as a token classifier); unset: the policy.
    pub critic_path: Option<String>,
    /// `advantage = "gae"`: how far the critic's value may move from the step's starting one
    /// before the value loss's clipped term binds.
    pub value_clip: f64,
    /// `advantage = "gae"`: RL steps at the start that train the critic alone (the policy
    /// waits; verl's `trainer.critic_warmup`).
    pub critic_warmup: i64,
    /// KL penalty in the reward (verl's `use_kl_in_reward` with `kl_ctrl.kl_coef`): each
    /// rollout's reward less this times its tokens' summed KL to the reference (0 disables it).
    pub kl_in_reward: f64,
    /// Target KL per token of the adaptive controller (verl's `kl_ctrl.type = "adaptive"`,
    /// `target_kl`); unset: the coefficient stays fixed.
    pub kl_in_reward_target: Option<f64>,
    /// Horizon of the adaptive controller, in rollouts (verl's `kl_ctrl.horizon`).
    pub kl_in_reward_horizon: i64,
    /// The per-token estimate of the KL penalty in the reward: `k1`, `k2` or `k3` (verl's
    /// `algorithm.kl_penalty`: `kl`, `mse`, `low_var_kl`).
    pub kl_in_reward_estimator: String,
    /// `[trainer.simulated]`: the step-time model of the simulated trainer.
    pub simulated: RawSimTrainer,
}

/// `[trainer.simulated]`: step time `c + d · tokens`, simulated seconds (scaled by
/// `engine.simulated.time_scale`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSimTrainer {
    /// Use the simulated trainer (default: when `engine.backend = "simulated"`).
    pub enabled: Option<bool>,
    /// `c`: fixed cost of a step.
    pub step_base_seconds: f64,
    /// `d`: cost per trained token.
    pub step_seconds_per_token: f64,
}

impl Default for RawSimTrainer {
    fn default() -> Self {
        Self {
            enabled: None,
            step_base_seconds: 0.5,
            step_seconds_per_token: 0.000_01,
        }
    }
}

impl Default for RawTrainer {
    fn default() -> Self {
        Self {
            loss: "ppo".into(),
            device: None,
            learning_rate: 1e-5,
            lr_schedule: "constant".into(),
            warmup_steps: 0,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            clip_low: None,
            clip_high: None,
            kl_coef: 0.0,
            kl_estimator: "k3".into(),
            dual_clip: 0.0,
            entropy_coeff: 0.0,
            micro_batch_size: 4,
            max_seq_len: 2048,
            minibatches: None,
            advantage: "group".into(),
            normalize_advantage_std: None,
            gamma: 1.0,
            only_keep_outcome: false,
            pad_situations: false,
            drop_zero_signal_situations: false,
            loss_aggregation: None,
            tis_level: "token".into(),
            tis_mode: "truncate".into(),
            is_cap: 2.0,
            oversized_text: "split".into(),
            threads: 0,
            activation_checkpointing: false,
            kept_logits_mib: None,
            compute_dtype: None,
            share_prompts: true,
            lora_rank: 0,
            lora_alpha: 16.0,
            lora_targets: vec!["all-linear".into()],
            gae_gamma: 1.0,
            gae_lambda: 1.0,
            critic_learning_rate: None,
            critic_path: None,
            value_clip: 0.5,
            critic_warmup: 0,
            kl_in_reward: 0.0,
            kl_in_reward_target: None,
            kl_in_reward_horizon: 10_000,
            kl_in_reward_estimator: "k1".into(),
            simulated: RawSimTrainer::default(),
        }
    }
}
