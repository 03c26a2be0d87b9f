//! Phase two of `[trainer]` and `[trainer.simulated]`.

use std::num::NonZeroU32;

use sluice_core::config::check::{
    Ctx, choice, non_negative, non_zero_u32, number, positive, u32_incl_zero, u64_incl_zero,
};
use sluice_core::config::{ConfigError, DType, Device};

use super::raw::{RawSimTrainer, RawTrainer};
use super::typed::{AdvantageKind, LossAggregation, LossKind, SimTrainerConfig, TrainerConfig};

/// Optimizer updates per step when `trainer.minibatches` is unset: one for `ppo` and `tis`, and
/// for `decoupled_ppo` [`DECOUPLED_MINIBATCHES`] (at most one per group). With a single update the
/// decoupled objective's proximal policy is the current one, its ratio is always 1 and nothing is
/// clipped: the trust region exists only for the updates after the first, which are clipped
/// against the step's starting policy (AReaL's `ppo_n_minibatches`, 4 by default there too).
pub fn default_minibatches(loss: LossKind, groups_per_step: NonZeroU32) -> NonZeroU32 {
    match loss {
        LossKind::DecoupledPpo => DECOUPLED_MINIBATCHES.min(groups_per_step),
        LossKind::Ppo | LossKind::Tis | LossKind::Gspo => NonZeroU32::MIN,
    }
}

/// `(trainer.clip_low, trainer.clip_high)` when unset: 0.2 on both sides (PPO's), and for `gspo`
/// the GSPO paper's 3e-4 and 4e-4: a text's ratio is the geometric mean of its tokens' ratios and
/// moves far less than any one of them, so PPO's range would clip nothing.
pub fn default_clip(loss: LossKind) -> (f64, f64) {
    match loss {
        LossKind::Gspo => (3e-4, 4e-4),
        LossKind::Ppo | LossKind::Tis | LossKind::DecoupledPpo => (0.2, 0.2),
    }
}

/// `trainer.loss_aggregation` when unset: `sequence_mean` for `gspo` (its objective is a mean
/// over texts), `token_mean` otherwise.
pub fn default_loss_aggregation(loss: LossKind) -> LossAggregation {
    match loss {
        LossKind::Gspo => LossAggregation::SequenceMean,
        LossKind::Ppo | LossKind::Tis | LossKind::DecoupledPpo => LossAggregation::TokenMean,
    }
}

/// `decoupled_ppo`'s optimizer updates per step unless the config says otherwise.
pub const DECOUPLED_MINIBATCHES: NonZeroU32 = NonZeroU32::new(4).unwrap();

fn validate_sim_trainer(
    raw: RawSimTrainer,
    simulated_engine: bool,
    ctx: &Ctx<'_>,
) -> Result<SimTrainerConfig, ConfigError> {
    let seconds = |name: &str, v: f64| {
        number(
            ctx,
            &format!("trainer.simulated.{name}"),
            v,
            "a number of seconds ≥ 0",
            |v| v >= 0.0,
        )
    };
    Ok(SimTrainerConfig {
        enabled: raw.enabled.unwrap_or(simulated_engine),
        step_base_seconds: seconds("step_base_seconds", raw.step_base_seconds)?,
        step_seconds_per_token: seconds("step_seconds_per_token", raw.step_seconds_per_token)?,
    })
}

/// Phase two of `[trainer]`; `device` is `trainer.device` resolved, `simulated_engine` says
/// `engine.backend = "simulated"` (the default of `trainer.simulated.enabled`).
pub fn validate_trainer(
    raw: RawTrainer,
    simulated_engine: bool,
    device: Device,
    ctx: &Ctx<'_>,
) -> Result<TrainerConfig, ConfigError> {
    let loss = choice(ctx, "trainer.loss", &raw.loss)?;
    let advantage = choice(ctx, "trainer.advantage", &raw.advantage)?;
    if advantage == AdvantageKind::Gae && loss == LossKind::Gspo {
        return Err(ctx.value(
            "trainer.advantage",
            "`gae` gives every token its own advantage, and loss = \"gspo\" clips whole texts under one advantage each: use loss = \"ppo\" (or another per-token loss) with gae",
        ));
    }
    let critic_path = match raw.critic_path {
        Some(_) if advantage != AdvantageKind::Gae => {
            return Err(ctx.value(
                "trainer.critic_path",
                "only a critic reads it, and trainer.advantage is not \"gae\" (PPO with a critic)",
            ));
        }
        Some(p) if p.trim().is_empty() => {
            return Err(ctx.value(
                "trainer.critic_path",
                "expected a model directory, got an empty path (leave it unset to start the critic from the policy)",
            ));
        }
        other => other,
    };
    let critic_warmup = u64_incl_zero(ctx, "trainer.critic_warmup", raw.critic_warmup)?;
    if critic_warmup > 0 && advantage != AdvantageKind::Gae {
        return Err(ctx.value(
            "trainer.critic_warmup",
            "only a critic warms up, and trainer.advantage is not \"gae\" (PPO with a critic)",
        ));
    }
    let (clip_low, clip_high) = default_clip(loss);
    Ok(TrainerConfig {
        device,
        simulated: validate_sim_trainer(raw.simulated, simulated_engine, ctx)?,
        loss,
        learning_rate: positive(ctx, "trainer.learning_rate", raw.learning_rate)?,
        lr_schedule: choice(ctx, "trainer.lr_schedule", &raw.lr_schedule)?,
        warmup_steps: u64_incl_zero(ctx, "trainer.warmup_steps", raw.warmup_steps)?,
        weight_decay: non_negative(ctx, "trainer.weight_decay", raw.weight_decay)?,
        max_grad_norm: positive(ctx, "trainer.max_grad_norm", raw.max_grad_norm)?,
        clip_low: number(
            ctx,
            "trainer.clip_low",
            raw.clip_low.unwrap_or(clip_low),
            "a number in [0, 1)",
            |v| (0.0..1.0).contains(&v),
        )?,
        clip_high: non_negative(ctx, "trainer.clip_high", raw.clip_high.unwrap_or(clip_high))?,
        kl_coef: non_negative(ctx, "trainer.kl_coef", raw.kl_coef)?,
        kl_estimator: choice(ctx, "trainer.kl_estimator", &raw.kl_estimator)?,
        dual_clip: number(
            ctx,
            "trainer.dual_clip",
            raw.dual_clip,
            "0 (off) or a number > 1",
            |v| v == 0.0 || v > 1.0,
        )?,
        entropy_coeff: non_negative(ctx, "trainer.entropy_coeff", raw.entropy_coeff)?,
        micro_batch_size: non_zero_u32(ctx, "trainer.micro_batch_size", raw.micro_batch_size)?,
        max_seq_len: non_zero_u32(ctx, "trainer.max_seq_len", raw.max_seq_len)?,
        // Unset: resolved with `rollout.groups_per_step` by `default_minibatches`.
        minibatches: non_zero_u32(ctx, "trainer.minibatches", raw.minibatches.unwrap_or(1))?,
        threads: u32_incl_zero(ctx, "trainer.threads", raw.threads)?,
        activation_checkpointing: raw.activation_checkpointing,
        kept_logits_mib: match raw.kept_logits_mib {
            Some(v) => u64_incl_zero(ctx, "trainer.kept_logits_mib", v)?,
            None => default_kept_logits_mib(device, raw.activation_checkpointing),
        },
        compute_dtype: compute_dtype(raw.compute_dtype.as_deref(), device, ctx)?,
        share_prompts: raw.share_prompts,
        advantage,
        normalize_advantage_std: normalize_advantage_std(
            advantage,
            raw.normalize_advantage_std,
            ctx,
        )?,
        gamma: number(ctx, "trainer.gamma", raw.gamma, "a number in (0, 1]", |v| {
            v > 0.0 && v <= 1.0
        })?,
        only_keep_outcome: raw.only_keep_outcome,
        pad_situations: raw.pad_situations,
        drop_zero_signal_situations: raw.drop_zero_signal_situations,
        loss_aggregation: match raw.loss_aggregation.as_deref() {
            Some(v) => choice(ctx, "trainer.loss_aggregation", v)?,
            None => default_loss_aggregation(loss),
        },
        tis_level: choice(ctx, "trainer.tis_level", &raw.tis_level)?,
        tis_mode: choice(ctx, "trainer.tis_mode", &raw.tis_mode)?,
        is_cap: positive(ctx, "trainer.is_cap", raw.is_cap)?,
        oversized_text: choice(ctx, "trainer.oversized_text", &raw.oversized_text)?,
        lora_rank: u32_incl_zero(ctx, "trainer.lora_rank", raw.lora_rank)?,
        lora_alpha: positive(ctx, "trainer.lora_alpha", raw.lora_alpha)?,
        lora_targets: lora_targets(&raw.lora_targets, ctx)?,
        gae_gamma: number(
            ctx,
            "trainer.gae_gamma",
            raw.gae_gamma,
            "a number in (0, 1]",
            |v| v > 0.0 && v <= 1.0,
        )?,
        gae_lambda: number(
            ctx,
            "trainer.gae_lambda",
            raw.gae_lambda,
            "a number in [0, 1]",
            |v| (0.0..=1.0).contains(&v),
        )?,
        critic_learning_rate: positive(
            ctx,
            "trainer.critic_learning_rate",
            raw.critic_learning_rate.unwrap_or(raw.learning_rate),
        )?,
        critic_path,
        value_clip: positive(ctx, "trainer.value_clip", raw.value_clip)?,
        critic_warmup,
        kl_in_reward: non_negative(ctx, "trainer.kl_in_reward", raw.kl_in_reward)?,
        kl_in_reward_target: match raw.kl_in_reward_target {
            Some(_) if raw.kl_in_reward == 0.0 => {
                return Err(ctx.value(
                    "trainer.kl_in_reward_target",
                    "the adaptive controller steers trainer.kl_in_reward, which is 0 (off): set a starting coefficient (verl's kl_ctrl.kl_coef, 0.001 there) or leave the target unset",
                ));
            }
            Some(t) => Some(positive(ctx, "trainer.kl_in_reward_target", t)?),
            None => None,
        },
        kl_in_reward_horizon: non_zero_u32(
            ctx,
            "trainer.kl_in_reward_horizon",
            raw.kl_in_reward_horizon,
        )?,
        kl_in_reward_estimator: choice(
            ctx,
            "trainer.kl_in_reward_estimator",
            &raw.kl_in_reward_estimator,
        )?,
    })
}

/// `trainer.lora_targets`: module names of [`crate::lora::TARGETS`], each once, or
/// `all-linear` (PEFT's and verl's name for every one of them).
fn lora_targets(raw: &[String], ctx: &Ctx<'_>) -> Result<Vec<String>, ConfigError> {
    const KEY: &str = "trainer.lora_targets";
    const ALL: &str = "all-linear";
    let known = || format!("`{ALL}` or names of {}", crate::lora::TARGETS.join(", "));
    if raw.is_empty() {
        return Err(ctx.value(KEY, format!("no module named: {}", known())));
    }
    if raw.iter().any(|t| t == ALL) {
        if raw.len() > 1 {
            return Err(ctx.value(KEY, format!("`{ALL}` names every module: list it alone")));
        }
        return Ok(crate::lora::TARGETS
            .iter()
            .map(|t| (*t).to_owned())
            .collect());
    }
    let mut targets: Vec<String> = Vec::with_capacity(raw.len());
    for t in raw {
        if !crate::lora::TARGETS.contains(&t.as_str()) {
            return Err(ctx.value(
                KEY,
                format!("`{t}` is not a module LoRA adapts: {}", known()),
            ));
        }
        if targets.contains(t) {
            return Err(ctx.value(KEY, format!("`{t}` is listed twice")));
        }
        targets.push(t.clone());
    }
    Ok(targets)
}

/// `trainer.normalize_advantage_std`: unset, on for the group and situational baselines (GRPO's
/// division by the group's reward std) and off for RLOO (its estimator is the plain
/// leave-one-out difference); REINFORCE++-baseline whitens the whole step instead and refuses
/// it on.
fn normalize_advantage_std(
    advantage: AdvantageKind,
    raw: Option<bool>,
    ctx: &Ctx<'_>,
) -> Result<bool, ConfigError> {
    match (advantage, raw) {
        (AdvantageKind::ReinforcePlusPlusBaseline, Some(true)) => Err(ctx.value(
            "trainer.normalize_advantage_std",
            "advantage = \"reinforce_plus_plus_baseline\" divides by the step's spread, not each group's: leave it unset or false",
        )),
        (AdvantageKind::Gae, Some(true)) => Err(ctx.value(
            "trainer.normalize_advantage_std",
            "advantage = \"gae\" whitens every token's advantage over the step, not per group: leave it unset or false",
        )),
        (_, Some(v)) => Ok(v),
        (AdvantageKind::Group | AdvantageKind::Situational, None) => Ok(true),
        (
            AdvantageKind::Rloo | AdvantageKind::ReinforcePlusPlusBaseline | AdvantageKind::Gae,
            None,
        ) => Ok(false),
    }
}

/// `trainer.kept_logits_mib` unset: on a GPU enough for a `[8, 2048]` micro-batch of a
/// 151,936-token vocabulary in bf16 (4.6 GiB), on the CPU a gibibyte of host memory; nothing
/// under `activation_checkpointing`, which asks for the least memory (there the logits would
/// outweigh every layer's saved input together).
pub fn default_kept_logits_mib(device: Device, activation_checkpointing: bool) -> u64 {
    match device {
        _ if activation_checkpointing => 0,
        Device::Cpu => 1024,
        Device::Cuda(_) => 8192,
    }
}

/// `trainer.compute_dtype`: unset, bf16 on a GPU (tensor cores) and f32 on the CPU (whose
/// fused training kernels are f32). f16 is refused: without loss scaling its gradients
/// underflow.
fn compute_dtype(raw: Option<&str>, device: Device, ctx: &Ctx<'_>) -> Result<DType, ConfigError> {
    const KEY: &str = "trainer.compute_dtype";
    match raw {
        None => Ok(match device {
            Device::Cpu => DType::F32,
            Device::Cuda(_) => DType::Bf16,
        }),
        Some(v) => match choice(ctx, KEY, v)? {
            DType::F16 => Err(ctx.value(
                KEY,
                "`f16` is not supported (its gradients underflow without loss scaling): use `bf16` or `f32`",
            )),
            d => Ok(d),
        },
    }
}
