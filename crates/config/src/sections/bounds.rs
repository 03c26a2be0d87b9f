//! Upper bounds of the numeric keys of the node-level sections (`sluice_core::config::bounds`):
//! generous for real use, far below what breaks arithmetic or memory. Resource keys are bounded by
//! what one node holds.

use sluice_core::config::bounds::{
    Bound, MAX_COUNT, MAX_REWARD, MAX_SECONDS, MAX_TOKENS, REWARD, SECONDS, STEPS, TOKENS, bound,
};

/// Every bound of the node-level sections.
pub const BOUNDS: &[Bound] = &[
    bound("run.max_steps", MAX_COUNT, STEPS),
    bound("rollout.env_workers", 1024.0, "env workers on one node"),
    bound("node.heartbeat_s", MAX_SECONDS, SECONDS),
    bound("node.lost_after_s", MAX_SECONDS, SECONDS),
    bound("node.max_nodes", 4096.0, "members of one head"),
    bound(
        "rollout.env_calls_per_worker",
        65_536.0,
        "concurrent env calls per worker",
    ),
    bound("rollout.group_size", 4096.0, "rollouts per group"),
    bound("rollout.max_prompt_tokens", MAX_TOKENS, TOKENS),
    bound("rollout.balance_threshold", MAX_REWARD, REWARD),
    bound("rollout.overlong_buffer_tokens", MAX_TOKENS, TOKENS),
    bound("rollout.overlong_penalty", MAX_REWARD, REWARD),
    bound(
        "rollout.groups_per_step",
        65_536.0,
        "groups per training step",
    ),
    bound("rollout.max_turns", 1024.0, "turns per episode"),
    bound("rollout.max_history_turns", 1024.0, "turns per prompt"),
    bound("rollout.max_new_tokens", MAX_TOKENS, TOKENS),
    bound("rollout.temperature", 100.0, "the sampling temperature"),
    bound("rollout.top_k", MAX_TOKENS, "candidate tokens"),
    bound(
        "rollout.max_version_lag",
        sluice_core::knobs::MAX_VERSION_LAG as f64,
        "policy versions",
    ),
    bound(
        "rollout.tail_batch_candidate_steps",
        sluice_core::knobs::MAX_TAIL_COUNT as f64,
        "aborts",
    ),
    bound(
        "rollout.tail_batch_trigger_size",
        sluice_core::knobs::MAX_TAIL_COUNT as f64,
        "groups",
    ),
    bound(
        "rollout.max_concurrent_rollouts",
        sluice_core::knobs::MAX_CONCURRENT_ROLLOUTS as f64,
        "rollouts in flight on one node",
    ),
    bound(
        "rollout.domain_mix.*",
        sluice_core::knobs::MAX_DOMAIN_WEIGHT,
        "a relative weight",
    ),
    bound("warmup.max_steps", MAX_COUNT, STEPS),
    bound("warmup.batch_size", 65_536.0, "demonstrations per step"),
    bound("warmup.learning_rate", 1.0, "the learning rate"),
    bound("warmup.check_every", MAX_COUNT, STEPS),
    bound("warmup.probe_samples", 1_048_576.0, "samples"),
    bound("eval.every_steps", MAX_COUNT, STEPS),
    bound("eval.samples", 1_048_576.0, "samples"),
    bound("eval.temperature", 100.0, "the sampling temperature"),
    bound("eval.sample_temperature", 100.0, "the sampling temperature"),
    bound("eval.samples_per_problem", 64.0, "replies per problem"),
    bound(
        "supervision.restart_backoff_initial_s",
        MAX_SECONDS,
        SECONDS,
    ),
    bound("supervision.restart_backoff_max_s", MAX_SECONDS, SECONDS),
    bound("supervision.engine_watchdog_s", MAX_SECONDS, SECONDS),
    bound("supervision.checkpoint_every_steps", MAX_COUNT, STEPS),
    bound("supervision.shutdown_timeout_s", MAX_SECONDS, SECONDS),
    bound("supervision.env_step_timeout_s", MAX_SECONDS, SECONDS),
    bound(
        "supervision.engine_max_restarts",
        MAX_COUNT,
        "failures in a row",
    ),
    bound(
        "supervision.engine_unavailable_timeout_s",
        MAX_SECONDS,
        SECONDS,
    ),
    bound("supervision.no_progress_groups", MAX_COUNT, "groups"),
    bound("faults.*", MAX_COUNT, "a fault period"),
];
