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
