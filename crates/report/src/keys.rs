//! The `metrics.jsonl` keys of what a run's rollouts look like and how training sees them: the
//! run monitor writes them, the plot's second row draws them (docs/metrics.md lists them).

/// Mean response tokens of the rollouts generated (the length-bias window).
pub const LENGTH_GENERATED_MEAN: &str = "length.generated_mean";
/// Mean response tokens of the rollouts the step trained on.
pub const LENGTH_TRAINED_MEAN: &str = "length.trained_mean";
/// The length bias: `(trained − generated) / generated` mean response length over its windows.
pub const LENGTH_BIAS: &str = "length.bias";
/// Kolmogorov–Smirnov distance of the generated and trained lengths, in [0, 1].
pub const LENGTH_KS_DISTANCE: &str = "length.ks_distance";
/// Lag-0 tokens the step compared with the engine's log-probs.
pub const MISMATCH_TOKENS: &str = "mismatch.tokens";
/// Mean |behaviour − trainer| log-prob over those tokens, nats.
pub const MISMATCH_LOGPROB_ABS_MEAN: &str = "mismatch.logprob_abs_mean";
/// Largest |behaviour − trainer| log-prob over those tokens, nats.
pub const MISMATCH_LOGPROB_ABS_MAX: &str = "mismatch.logprob_abs_max";
/// k3 estimate of KL(engine ‖ trainer) over those tokens, nats per token.
pub const MISMATCH_KL: &str = "mismatch.kl";
/// Mean seconds of a group from admission to stored, over every domain's timed groups.
pub const TIME_GROUP_SECONDS: &str = "time.group_seconds";
/// Of that, mean seconds per rollout waiting on the engine.
pub const TIME_ENGINE_SECONDS: &str = "time.engine_seconds";
/// Of that, mean seconds per rollout waiting on the environment.
pub const TIME_ENV_SECONDS: &str = "time.env_seconds";
/// Fraction of the finished rollouts truncated, over every domain's shape window.
pub const TRUNCATED_RATIO: &str = "rollout.truncated_ratio";
/// Prefix of each domain's rollout figures: `rollout.<domain>.<figure>`.
pub const ROLLOUT_PREFIX: &str = "rollout.";

/// The trainer's figures of a step, each under its `metrics.jsonl` key, from the catalog metric
/// the trainer reports it as (the `sluice_trainer_*` gauges hold only the last step's).
pub const TRAINER_FIGURES: &[(&str, &str)] = {
    use sluice_core::metrics as m;
    &[
        ("train.entropy", m::TRAINER_ENTROPY_NATS),
        ("train.clip_fraction", m::TRAINER_CLIP_RATIO),
        ("train.clip_low_fraction", m::TRAINER_CLIP_LOW_RATIO),
        ("train.clip_high_fraction", m::TRAINER_CLIP_HIGH_RATIO),
        ("train.dual_clip_fraction", m::TRAINER_DUAL_CLIP_RATIO),
        ("train.kl", m::TRAINER_KL_NATS),
        (
            "train.importance_weight_mean",
            m::TRAINER_IMPORTANCE_WEIGHT_MEAN_RATIO,
        ),
        (
            "train.importance_weight_max",
            m::TRAINER_IMPORTANCE_WEIGHT_MAX_RATIO,
        ),
        (
            "train.effective_sample_size",
            m::TRAINER_EFFECTIVE_SAMPLE_SIZE_RATIO,
        ),
        ("train.grad_norm", m::TRAINER_GRAD_NORM_VALUE),
        ("train.learning_rate", m::TRAINER_LEARNING_RATE_VALUE),
        (
            "train.packing_efficiency",
            m::TRAINER_PACKING_EFFICIENCY_RATIO,
        ),
        ("train.step_seconds", m::TRAINER_STEP_SECONDS),
        ("train.tokens_per_s", m::TRAINER_TOKENS_PER_SECOND),
        (
            "train.kl_in_reward_coef",
            m::TRAINER_KL_IN_REWARD_COEF_VALUE,
        ),
        ("train.kl_in_reward", m::TRAINER_KL_IN_REWARD_NATS),
        ("critic.loss", m::TRAINER_CRITIC_LOSS_VALUE),
        (
            "critic.value_clip_fraction",
            m::TRAINER_CRITIC_VALUE_CLIP_RATIO,
        ),
        ("critic.values_mean", m::TRAINER_CRITIC_VALUES_MEAN_VALUE),
        ("critic.returns_mean", m::TRAINER_CRITIC_RETURNS_MEAN_VALUE),
        (
            "critic.explained_variance",
            m::TRAINER_CRITIC_EXPLAINED_VARIANCE_RATIO,
        ),
        ("critic.grad_norm", m::TRAINER_CRITIC_GRAD_NORM_VALUE),
    ]
};
