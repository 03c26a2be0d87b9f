//! The one catalog of Prometheus metric names (`DESIGN.md` §8).
//!
//! Names follow `sluice_<subsystem>_[<name>_]<unit>[_total]`: counters end in `_total`, every name
//! ends in its unit, and labels are bounded (never a sample or request id). Code records metrics only
//! through the constants below, so a name is spelled once; [`describe_all`] registers the help text
//! with whatever `metrics` recorder is installed.
//!
//! Renaming a metric breaks dashboards and alerts: treat every name here as public interface.

/// What kind of Prometheus series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Monotonic counter (`_total`).
    Counter,
    /// Value that goes up and down.
    Gauge,
    /// Distribution with explicit buckets.
    Histogram,
}

/// One catalog entry.
#[derive(Debug, Clone, Copy)]
pub struct MetricDef {
    /// Full Prometheus name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// HELP text.
    pub help: &'static str,
    /// Label names; each has a bounded value set.
    pub labels: &'static [&'static str],
    /// Bucket upper bounds for histograms.
    pub buckets: &'static [f64],
}

/// Subsystems a metric name may start with (after `sluice_`).
pub const SUBSYSTEMS: &[&str] = &[
    "node", "actor", "data", "rollout", "engine", "env", "replay", "trainer", "domain",
];

/// Units a metric name may end with (before `_total`).
pub const UNITS: &[&str] = &[
    "seconds",
    "bytes",
    "tokens",
    "groups",
    "rollouts",
    "samples",
    "requests",
    "sequences",
    "steps",
    "ratio",
    "version",
    "versions",
    "value",
    "reward",
    "nats",
    "lines",
    "messages",
    "errors",
    "restarts",
    "transitions",
    "failures",
    "tokens_per_second",
    "info",
    "blocks",
    "turns",
];

/// Names fixed verbatim by `DESIGN.md` / the issues that predate the unit rule; they are checked
/// for prefix and subsystem but not for a unit suffix.
pub const FIXED_NAMES: &[&str] = &[DOMAIN_MIX_ACTUAL, DOMAIN_MIX_TARGET];

/// Suffixes Prometheus reserves for the series of histograms and summaries (`promtool check
/// metrics` rejects a counter or gauge whose name ends in one).
pub const RESERVED_SUFFIXES: &[&str] = &["_bucket", "_count", "_sum"];

macro_rules! catalog {
    ($($(#[$doc:meta])* $konst:ident = $name:literal, $kind:ident, [$($label:literal),*], $buckets:expr, $help:literal;)*) => {
        $( $(#[$doc])* #[doc = concat!("`", $name, "`: ", $help)] pub const $konst: &str = $name; )*
        /// Every metric Sluice exports, in one list.
        pub const CATALOG: &[MetricDef] = &[
            $( MetricDef { name: $name, kind: MetricKind::$kind, help: $help, labels: &[$($label),*], buckets: $buckets }, )*
        ];
    };
}

/// Most (domain, component) series of `sluice_rollout_reward_component_mean_reward`: component
/// names come from rubrics and from envs (maybe remote), so their label values are capped.
pub const MAX_REWARD_COMPONENT_SERIES: usize = 256;

/// The (domain, component) label pairs of `sluice_rollout_reward_component_mean_reward` exported
/// so far: the first [`MAX_REWARD_COMPONENT_SERIES`] are admitted, later new ones are refused
/// (with one warning), so an env inventing component names cannot grow the series without bound.
#[derive(Debug, Default)]
pub struct ComponentSeries {
    admitted: std::collections::HashSet<(String, String)>,
    warned: bool,
}

impl ComponentSeries {
    /// Whether the series (`domain`, `component`) may be recorded.
    pub fn admit(&mut self, domain: &str, component: &str) -> bool {
        let key = (domain.to_owned(), component.to_owned());
        if self.admitted.contains(&key) {
            return true;
        }
        if self.admitted.len() >= MAX_REWARD_COMPONENT_SERIES {
            if !self.warned {
                self.warned = true;
                tracing::warn!(
                    domain,
                    component,
                    max = MAX_REWARD_COMPONENT_SERIES,
                    "too many reward component series; new component names are not exported"
                );
            }
            return false;
        }
        self.admitted.insert(key);
        true
    }
}

/// Buckets for durations from a millisecond to ten minutes.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
];
/// Buckets for version lags (integers; η is small in practice).
pub const LAG_BUCKETS: &[f64] = &[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0];
/// Buckets for response lengths in tokens (powers of two, 16 to 32 Ki).
pub const TOKEN_BUCKETS: &[f64] = &[
    16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
];
/// Buckets for model turns per episode.
pub const TURN_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0];
/// Buckets of batch sizes (items per batch).
pub const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
const NONE: &[f64] = &[];

catalog! {
    NODE_UP_INFO = "sluice_node_up_info", Gauge, ["version"], NONE,
        "1 while the node runs; the label carries the Sluice version.";
    NODE_KNOB_VALUE = "sluice_node_knob_value", Gauge, ["knob"], NONE,
        "Current value of each scalar runtime knob (booleans as 0/1).";
    NODE_WEIGHT_UPDATE_MODE_INFO = "sluice_node_weight_update_mode_info", Gauge, ["mode"], NONE,
        "1 for the active weight_update_mode, 0 for the others.";
    NODE_ADMISSION_MODE_INFO = "sluice_node_admission_mode_info", Gauge, ["mode"], NONE,
        "1 for the active admission mode (demand or eta), 0 for the other.";
    NODE_MEMBER_UP = "sluice_node_member_up_info", Gauge, ["node", "role"], NONE,
        "Head: 1 while a joined engine or env node heartbeats and is reachable, 0 while it is lost or unreachable; rendered from the membership at each scrape, so a node that left, or whose place went to a new member, has no series (at most node.max_nodes).";
    NODE_MEMBER_WEIGHT_VERSION = "sluice_node_member_weight_version", Gauge, ["node"], NONE,
        "Head: the policy version a joined engine node last reported loaded (rendered from the membership at each scrape, as sluice_node_member_up_info).";
    NODE_MEMBER_LOST = "sluice_node_member_lost_failures_total", Counter, ["role"], NONE,
        "Head: joined nodes that stopped heartbeating (lost without leaving).";
    NODE_MEMBER_UNREACHABLE = "sluice_node_member_unreachable_failures_total", Counter, ["role"], NONE,
        "Head: times a joined engine node was marked unreachable (a call of the replica on it got no answer); it gets no replica until a probe of its URL answers or it joins again.";
    NODE_WEIGHTS_SERVED = "sluice_node_weights_served_bytes_total", Counter, [], NONE,
        "Head: weight bytes streamed to engine nodes (GET /v1/weights).";
    ACTOR_RESTARTS = "sluice_actor_restarts_total", Counter, ["actor"], NONE,
        "Times the supervisor restarted an actor.";
    ACTOR_RECEIVED = "sluice_actor_received_messages_total", Counter, ["actor"], NONE,
        "Messages an actor received.";
    ACTOR_SENT = "sluice_actor_sent_messages_total", Counter, ["actor"], NONE,
        "Messages an actor sent downstream.";
    ACTOR_DROPPED = "sluice_actor_dropped_messages_total", Counter, ["actor"], NONE,
        "Messages an actor dropped (e.g. results for a request that was already aborted).";
    ACTOR_ERRORS = "sluice_actor_errors_total", Counter, ["actor", "kind"], NONE,
        "Errors by actor and stable error kind.";
    DATA_SAMPLES = "sluice_data_samples_total", Counter, ["domain"], NONE,
        "Dataset rows handed to the rollout controller.";
    DATA_BAD_LINES = "sluice_data_bad_lines_total", Counter, ["dataset"], NONE,
        "Dataset lines that could not be parsed (skipped or fatal per config).";
    DOMAIN_MIX_ACTUAL = "sluice_domain_mix_actual", Gauge, ["domain"], NONE,
        "Share of completed rollouts per domain since the start of the run.";
    DOMAIN_MIX_TARGET = "sluice_domain_mix_target", Gauge, ["domain"], NONE,
        "Target share per domain (the domain_mix knob, normalized).";
    /// Was `sluice_domain_mix_count` (a gauge): Prometheus reserves `_count` for histograms.
    DOMAIN_MIX_ROLLOUTS = "sluice_domain_mix_rollouts_total", Counter, ["domain"], NONE,
        "Completed rollouts per domain since the start of the run.";
    ROLLOUT_ADMITTED_GROUPS = "sluice_rollout_admitted_groups_total", Counter, [], NONE,
        "Groups admitted by the controller (running + completed + trained, since the start).";
    ROLLOUT_IN_FLIGHT_GROUPS = "sluice_rollout_in_flight_groups", Gauge, [], NONE,
        "Groups currently generating.";
    ROLLOUT_FINISHED_ROLLOUTS = "sluice_rollout_finished_rollouts_total", Counter, ["status"], NONE,
        "Rollouts of the groups that finished generating, by final status (completed, truncated, prompt_too_long, timeout, error); groups a weight update aborted, and expired ones, are counted by sluice_replay_transitions_total{to}.";
    ROLLOUT_MEAN_REWARD = "sluice_rollout_mean_reward", Gauge, ["domain"], NONE,
        "Mean reward of the most recently completed groups, per domain.";
    ROLLOUT_REWARD_COMPONENT_MEAN_REWARD = "sluice_rollout_reward_component_mean_reward", Gauge, ["domain", "component"], NONE,
        "Mean of each named reward component (rubric functions, `env`, `env.<name>`) over the most recently completed group, per domain; at most MAX_REWARD_COMPONENT_SERIES series.";
    ROLLOUT_OUTCOME_EMA_REWARD = "sluice_rollout_outcome_ema_reward", Gauge, [], NONE,
        "Exponential moving average of outcome rewards.";
    ROLLOUT_BELOW_BALANCE_RATIO = "sluice_rollout_below_balance_ratio", Gauge, [], NONE,
        "Fraction of recent groups whose mean reward is below the balance threshold.";
    ROLLOUT_ABOVE_BALANCE_RATIO = "sluice_rollout_above_balance_ratio", Gauge, [], NONE,
        "Fraction of recent groups whose mean reward is above the balance threshold.";
    ROLLOUT_TAIL_CANDIDATE_ROLLOUTS = "sluice_rollout_tail_candidate_rollouts", Gauge, [], NONE,
        "Rollouts waiting as tail-batch candidates.";
    ROLLOUT_RESPONSE_TOKENS = "sluice_rollout_response_tokens", Histogram, ["domain"], TOKEN_BUCKETS,
        "Response tokens (completion tokens of every turn) of each finished rollout, per domain.";
    ROLLOUT_EPISODE_TURNS = "sluice_rollout_episode_turns", Histogram, ["domain"], TURN_BUCKETS,
        "Model turns of each finished rollout, per domain.";
    ROLLOUT_TRUNCATED_RATIO = "sluice_rollout_truncated_ratio", Gauge, ["domain"], NONE,
        "Fraction of the domain's last 256 finished rollouts that hit max_new_tokens (status truncated).";
    DOMAIN_FINISHED_ROLLOUTS = "sluice_domain_finished_rollouts_total", Counter, ["domain", "status"], NONE,
        "Finished rollouts per domain by final status: the finish reasons of the domain's episodes.";
    ROLLOUT_GROUP_SECONDS = "sluice_rollout_group_seconds", Histogram, ["domain"], SECONDS_BUCKETS,
        "Wall time of a group from admission to durably stored in a bucket other than aborted (its trips through the aborted bucket included).";
    ROLLOUT_GROUP_ENGINE_SECONDS = "sluice_rollout_group_engine_seconds", Histogram, ["domain"], SECONDS_BUCKETS,
        "Of a group's time, the mean per rollout spent waiting on the engine (every request of every turn and trip).";
    ROLLOUT_GROUP_ENV_SECONDS = "sluice_rollout_group_env_seconds", Histogram, ["domain"], SECONDS_BUCKETS,
        "Of a group's time, the mean per rollout spent waiting on the environment (first prompt, steps, group scoring).";
    ROLLOUT_LENGTH_BIAS_RATIO = "sluice_rollout_length_bias_ratio", Gauge, [], NONE,
        "Length bias: (trained mean - generated mean) / generated mean response length, over the last 4096 rollouts trained and the last 4096 generated (expired, filtered and cleared ones included); negative when training sees shorter responses than the policy writes, 0 when it sees what the policy writes.";
    ENGINE_GENERATED_TOKENS = "sluice_engine_generated_tokens_total", Counter, ["replica"], NONE,
        "Tokens decoded by each engine replica.";
    ENGINE_DECODE_TOKENS_PER_SECOND = "sluice_engine_decode_tokens_per_second", Gauge, ["replica"], NONE,
        "Recent decode throughput of each engine replica.";
    ENGINE_BUSY_RATIO = "sluice_engine_busy_ratio", Gauge, ["replica"], NONE,
        "Fraction of recent wall time each engine replica spent computing.";
    ENGINE_RUNNING_SEQUENCES = "sluice_engine_running_sequences", Gauge, ["replica"], NONE,
        "Sequences in the running batch.";
    ENGINE_WAITING_REQUESTS = "sluice_engine_waiting_requests", Gauge, ["replica"], NONE,
        "Requests queued but not yet admitted to the batch.";
    ENGINE_FINISHED_REQUESTS = "sluice_engine_finished_requests_total", Counter, ["reason"], NONE,
        "Requests that left the engine, by reason (stop, length, abort, error).";
    ENGINE_DISCARDED_TOKENS = "sluice_engine_discarded_tokens_total", Counter, [], NONE,
        "Generated tokens thrown away: partials regenerated, groups dropped when expired (replay.expired = \"drop\") or cleared by an operator.";
    ENGINE_WEIGHT_SYNC_PAUSE_SECONDS = "sluice_engine_weight_sync_pause_seconds", Histogram, ["mode"], SECONDS_BUCKETS,
        "Time from a weight-update request to the first step on the new weights.";
    ENGINE_KV_CACHE_USED_BLOCKS = "sluice_engine_kv_cache_used_blocks", Gauge, ["replica"], NONE,
        "KV cache blocks in running sequences' block tables (native replicas).";
    ENGINE_KV_CACHE_CACHED_BLOCKS = "sluice_engine_kv_cache_cached_blocks", Gauge, ["replica"], NONE,
        "Unreferenced KV cache blocks kept for prefix hits, evicted least recently used first.";
    ENGINE_KV_CACHE_TOTAL_BLOCKS = "sluice_engine_kv_cache_total_blocks", Gauge, ["replica"], NONE,
        "KV cache blocks in each native replica's pool (engine.kv_cache_mb).";
    ENGINE_PROMPT_TOKENS = "sluice_engine_prompt_tokens_total", Counter, ["replica"], NONE,
        "Prompt tokens (prompt plus resumed completion) of requests admitted to a native replica.";
    ENGINE_PREFIX_CACHE_HIT_TOKENS = "sluice_engine_prefix_cache_hit_tokens_total", Counter, ["replica"], NONE,
        "Of the prompt tokens, those whose keys and values came from the prefix cache (not prefilled).";
    ENGINE_PREFIX_CACHE_HIT_RATIO = "sluice_engine_prefix_cache_hit_ratio", Gauge, ["replica"], NONE,
        "Prefix-cache hit tokens over prompt tokens since the replica started.";
    ENGINE_PREEMPTED_SEQUENCES = "sluice_engine_preempted_sequences_total", Counter, ["replica"], NONE,
        "Running sequences preempted because the KV cache ran out of blocks (returned as aborts with their partials, or requeued when they had generated nothing or the engine is `sluice serve`'s).";
    ENGINE_UNPUBLISHED_VERSION_ERRORS = "sluice_engine_unpublished_version_errors_total", Counter, [], NONE,
        "Replies and load readings of a remote engine server carrying a weight version this head never published (its weights were replaced behind the head's back); each marks the server down, so its replica is rebuilt on the run's weights.";
    ENV_STEP_SECONDS = "sluice_env_step_seconds", Histogram, ["domain"], SECONDS_BUCKETS,
        "Time an environment step (or init) took.";
    ENV_FAILURES = "sluice_env_failures_total", Counter, ["kind"], NONE,
        "Environment or reward-function failures (panic, timeout, error) by kind.";
    ENV_JUDGE_REQUESTS = "sluice_env_judge_requests_total", Counter, ["outcome"], NONE,
        "Requests of the `judge` reward function to its model, by outcome: `scored`, `unparsed` (the answer held no score; the rollout's scoring fails) or `failed` (refused, unreachable or past its deadline).";
    ENV_JUDGE_SECONDS = "sluice_env_judge_seconds", Histogram, [], SECONDS_BUCKETS,
        "Time one request of the `judge` reward function took, from sending it to its score.";
    ENV_REWARD_MODEL_SECONDS = "sluice_env_reward_model_seconds", Histogram, [], SECONDS_BUCKETS,
        "Time the `reward_model` reward function took to score one rollout: its conversation rendered and tokenized, the wait for the model, and the forward.";
    ENV_REWARD_MODEL_BATCH_ROLLOUTS = "sluice_env_reward_model_batch_rollouts", Histogram, [], BATCH_BUCKETS,
        "Rollouts each forward of a reward model scored: those that reached it while the previous forward ran.";
    ENV_FAILOVER_ROLLOUTS = "sluice_env_failover_rollouts_total", Counter, [], NONE,
        "Head: episodes moved to another env node because theirs was gone (unreachable, restarted or full); each replays its turns there.";
    REPLAY_BUCKET_GROUPS = "sluice_replay_bucket_groups", Gauge, ["bucket"], NONE,
        "Groups currently in each replay-store bucket.";
    REPLAY_TRANSITIONS = "sluice_replay_transitions_total", Counter, ["from", "to"], NONE,
        "Bucket transitions of groups in the replay store.";
    REPLAY_PERSIST_SECONDS = "sluice_replay_persist_seconds", Histogram, [], SECONDS_BUCKETS,
        "Time to durably write a group before acknowledging it.";
    TRAINER_POLICY_VERSION = "sluice_trainer_policy_version", Gauge, [], NONE,
        "Version of the most recently published weights.";
    TRAINER_STEPS = "sluice_trainer_steps_total", Counter, [], NONE,
        "Optimizer steps taken.";
    TRAINER_TRAINED_TOKENS = "sluice_trainer_trained_tokens_total", Counter, [], NONE,
        "Completion tokens trained on.";
    TRAINER_TOKEN_VERSION_LAG_VERSIONS = "sluice_trainer_token_version_lag_versions", Histogram, [], LAG_BUCKETS,
        "Version lag of each trained token at training time (never above max_version_lag).";
    TRAINER_FUTURE_VERSION_TOKENS = "sluice_trainer_future_version_tokens_total", Counter, [], NONE,
        "Tokens of a trained batch tagged with a weight version newer than the one the step trains from (possible only when an engine's weights were replaced behind the head's back); each also counts as a lag violation.";
    TRAINER_IDLE_RATIO = "sluice_trainer_idle_ratio", Gauge, [], NONE,
        "Fraction of recent wall time the trainer waited for data.";
    TRAINER_STEP_SECONDS = "sluice_trainer_step_seconds", Histogram, [], SECONDS_BUCKETS,
        "Wall time of one training step.";
    TRAINER_LOSS_VALUE = "sluice_trainer_loss_value", Gauge, [], NONE,
        "Policy loss of the last step.";
    TRAINER_CLIP_RATIO = "sluice_trainer_clip_ratio", Gauge, [], NONE,
        "Fraction of tokens whose ratio was clipped in the last step.";
    TRAINER_ENTROPY_NATS = "sluice_trainer_entropy_nats", Gauge, [], NONE,
        "Mean per-token entropy of the policy in the last step.";
    TRAINER_KL_NATS = "sluice_trainer_kl_nats", Gauge, [], NONE,
        "Mean per-token KL to the reference policy in the last step.";
    TRAINER_IMPORTANCE_WEIGHT_MEAN_RATIO = "sluice_trainer_importance_weight_mean_ratio", Gauge, [], NONE,
        "Mean importance weight of the last step.";
    TRAINER_IMPORTANCE_WEIGHT_MAX_RATIO = "sluice_trainer_importance_weight_max_ratio", Gauge, [], NONE,
        "Largest importance weight of the last step.";
    TRAINER_EFFECTIVE_SAMPLE_SIZE_RATIO = "sluice_trainer_effective_sample_size_ratio", Gauge, [], NONE,
        "Effective sample size of the importance weights, as a fraction of the tokens.";
    TRAINER_GRAD_NORM_VALUE = "sluice_trainer_grad_norm_value", Gauge, [], NONE,
        "Global gradient norm before clipping, last step.";
    TRAINER_TOKENS_PER_SECOND = "sluice_trainer_tokens_per_second", Gauge, [], NONE,
        "Training throughput of the last step.";
    TRAINER_SITUATION_SEQUENCES = "sluice_trainer_situation_sequences", Gauge, ["domain", "situation"], NONE,
        "Training texts (model turns) per situation label in the last step that had the situation (`none`: turns without a label); at most MAX_REWARD_COMPONENT_SERIES series.";
    TRAINER_SITUATION_ADVANTAGE_MEAN_VALUE = "sluice_trainer_situation_advantage_mean_value", Gauge, ["domain", "situation"], NONE,
        "Mean advantage the trainer gave the texts of each situation in the last step that had it (about 0 under the situational baseline).";
    TRAINER_SITUATION_ADVANTAGE_ABS_MEAN_VALUE = "sluice_trainer_situation_advantage_abs_mean_value", Gauge, ["domain", "situation"], NONE,
        "Mean absolute advantage of the texts of each situation in the last step that had it: the learning signal the situation carries.";
    TRAINER_CLIP_LOW_RATIO = "sluice_trainer_clip_low_ratio", Gauge, [], NONE,
        "Fraction of tokens clipped below 1 - clip_low (negative advantage) in the last step.";
    TRAINER_CLIP_HIGH_RATIO = "sluice_trainer_clip_high_ratio", Gauge, [], NONE,
        "Fraction of tokens clipped above 1 + clip_high (positive advantage) in the last step.";
    TRAINER_DUAL_CLIP_RATIO = "sluice_trainer_dual_clip_ratio", Gauge, [], NONE,
        "Fraction of tokens whose term the dual clip bounded (negative advantage, ratio above trainer.dual_clip) in the last step; 0 with the dual clip off.";
    TRAINER_LEARNING_RATE_VALUE = "sluice_trainer_learning_rate_value", Gauge, [], NONE,
        "Learning rate of the last optimizer step.";
    TRAINER_PACKING_EFFICIENCY_RATIO = "sluice_trainer_packing_efficiency_ratio", Gauge, [], NONE,
        "Fraction of micro-batch slots holding tokens in the last step.";
    TRAINER_SKIPPED_STEPS = "sluice_trainer_skipped_steps_total", Counter, [], NONE,
        "Training steps that did not update the policy (nothing published): every group had zero advantage, the packing left every text out, or the step was one of `trainer.critic_warmup`'s.";
    TRAINER_MEAN_VERSION_LAG_VERSIONS = "sluice_trainer_mean_version_lag_versions", Gauge, [], NONE,
        "Mean version lag of the tokens trained in the last step.";
    TRAINER_MAX_VERSION_LAG_VERSIONS = "sluice_trainer_max_version_lag_versions", Gauge, [], NONE,
        "Largest version lag of a token trained in the last step (never above max_version_lag).";
    TRAINER_MISMATCH_COMPARED_TOKENS = "sluice_trainer_mismatch_compared_tokens", Gauge, [], NONE,
        "Trained tokens of the last step compared with the engine: those generated by the weights the step started from (lag 0), scored by the trainer on those same weights.";
    TRAINER_MISMATCH_LOGPROB_ABS_MEAN_NATS = "sluice_trainer_mismatch_logprob_abs_mean_nats", Gauge, [], NONE,
        "Train/inference mismatch: mean |behaviour log-prob - trainer log-prob| over the compared tokens of the last step that had some.";
    TRAINER_MISMATCH_LOGPROB_ABS_MAX_NATS = "sluice_trainer_mismatch_logprob_abs_max_nats", Gauge, [], NONE,
        "Train/inference mismatch: largest |behaviour log-prob - trainer log-prob| of a compared token in the last step that had some.";
    TRAINER_MISMATCH_KL_NATS = "sluice_trainer_mismatch_kl_nats", Gauge, [], NONE,
        "Train/inference mismatch: k3 estimate of KL(engine || trainer), mean of exp(r) - 1 - r with r = trainer - behaviour log-prob, over the compared tokens of the last step that had some.";
    TRAINER_KL_IN_REWARD_COEF_VALUE = "sluice_trainer_kl_in_reward_coef_value", Gauge, [], NONE,
        "trainer.kl_in_reward: the coefficient beta the last step applied to its rollouts' KL (it moves with trainer.kl_in_reward_target set).";
    TRAINER_KL_IN_REWARD_NATS = "sluice_trainer_kl_in_reward_nats", Gauge, [], NONE,
        "trainer.kl_in_reward: the last step's KL to the reference, the mean over rollouts of each one's mean log pi_behaviour - log pi_ref per token (what the adaptive coefficient steers to its target).";
    TRAINER_CRITIC_LOSS_VALUE = "sluice_trainer_critic_loss_value", Gauge, [], NONE,
        "advantage = gae: the critic's clipped value loss (the mean over tokens of 1/2 max((v - R)^2, (v_clip - R)^2)) in the last step, the mean of its updates'.";
    TRAINER_CRITIC_VALUE_CLIP_RATIO = "sluice_trainer_critic_value_clip_ratio", Gauge, [], NONE,
        "advantage = gae: fraction of the last step's tokens whose clipped value term was the larger (value moved more than trainer.value_clip from the step's start, away from the return).";
    TRAINER_CRITIC_VALUES_MEAN_VALUE = "sluice_trainer_critic_values_mean_value", Gauge, [], NONE,
        "advantage = gae: mean value the critic gave the last step's tokens before its update.";
    TRAINER_CRITIC_RETURNS_MEAN_VALUE = "sluice_trainer_critic_returns_mean_value", Gauge, [], NONE,
        "advantage = gae: mean GAE return (the critic's target) of the last step's tokens.";
    TRAINER_CRITIC_EXPLAINED_VARIANCE_RATIO = "sluice_trainer_critic_explained_variance_ratio", Gauge, [], NONE,
        "advantage = gae: 1 - Var(R - v)/Var(R) over the last step's tokens, v the critic's values before its update and R the returns (1: exact, 0: no better than the mean, negative: worse); absent when the returns do not vary.";
    TRAINER_CRITIC_GRAD_NORM_VALUE = "sluice_trainer_critic_grad_norm_value", Gauge, [], NONE,
        "advantage = gae: the critic's global gradient norm before clipping, last update.";
    ACTOR_RESTART_BACKOFF_SECONDS = "sluice_actor_restart_backoff_seconds", Gauge, ["actor"], NONE,
        "Delay before the supervisor's next restart of an actor (0 when healthy).";
    NODE_CHECKPOINT_SECONDS = "sluice_node_checkpoint_seconds", Histogram, [], SECONDS_BUCKETS,
        "Time to write a checkpoint (trainer state, replay commit, manifest), without the wait for the run log to record the checkpoint's step.";
    NODE_CHECKPOINT_VERSION = "sluice_node_checkpoint_version", Gauge, [], NONE,
        "Policy version of the newest checkpoint on disk.";
    NODE_CHECKPOINT_FAILURES = "sluice_node_checkpoint_failures_total", Counter, [], NONE,
        "Checkpoints that could not be written (periodic, requested, final or at a stop; the log names each cause). Three periodic ones in a row end the run.";
    NODE_INJECTED_FAILURES = "sluice_node_injected_failures_total", Counter, [], NONE,
        "Faults injected by the `[faults]` config (engine crash or hang, trainer error; the log names each).";
}

/// Looks a metric up by name.
pub fn find(name: &str) -> Option<&'static MetricDef> {
    CATALOG.iter().find(|m| m.name == name)
}

/// Registers the help text of every catalog entry with the installed `metrics` recorder.
/// Call once after installing the exporter, before any metric is recorded.
pub fn describe_all() {
    for m in CATALOG {
        match m.kind {
            MetricKind::Counter => metrics::describe_counter!(m.name, m.help),
            MetricKind::Gauge => metrics::describe_gauge!(m.name, m.help),
            MetricKind::Histogram => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

/// Checks one name against the convention; returns what is wrong.
pub fn check_name(def: &MetricDef) -> Result<(), String> {
    let name = def.name;
    let rest = name
        .strip_prefix("sluice_")
        .ok_or_else(|| format!("{name}: must start with `sluice_`"))?;
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(format!("{name}: only [a-z0-9_] allowed"));
    }
    let subsystem = rest.split('_').next().unwrap_or_default();
    if !SUBSYSTEMS.contains(&subsystem) {
        return Err(format!("{name}: unknown subsystem `{subsystem}`"));
    }
    if let Some(suffix) = RESERVED_SUFFIXES.iter().find(|s| name.ends_with(*s)) {
        return Err(format!(
            "{name}: `{suffix}` is reserved for the series of histograms and summaries"
        ));
    }
    let is_total = name.ends_with("_total");
    if (def.kind == MetricKind::Counter) != is_total {
        return Err(format!(
            "{name}: counters and only counters end in `_total`"
        ));
    }
    if FIXED_NAMES.contains(&name) {
        return Ok(());
    }
    let stem = rest.strip_suffix("_total").unwrap_or(rest);
    let after_subsystem = &stem[subsystem.len()..];
    if !UNITS
        .iter()
        .any(|u| after_subsystem.ends_with(&format!("_{u}")))
    {
        return Err(format!("{name}: must end in a unit ({})", UNITS.join(", ")));
    }
    if (def.kind == MetricKind::Histogram) == def.buckets.is_empty() {
        return Err(format!(
            "{name}: histograms and only histograms have buckets"
        ));
    }
    if !def.buckets.windows(2).all(|w| w[0] < w[1]) {
        return Err(format!("{name}: buckets must increase"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_name_follows_the_convention() {
        for m in CATALOG {
            check_name(m).unwrap();
            assert!(!m.help.is_empty(), "{} has no help", m.name);
        }
    }

    #[test]
    fn names_are_unique() {
        let mut seen = HashSet::new();
        for m in CATALOG {
            assert!(seen.insert(m.name), "{} declared twice", m.name);
        }
    }

    #[test]
    fn the_checker_rejects_bad_names() {
        let bad = |name, kind, buckets| MetricDef {
            name,
            kind,
            help: "x",
            labels: &[],
            buckets,
        };
        assert!(check_name(&bad("engine_busy_ratio", MetricKind::Gauge, NONE)).is_err());
        assert!(check_name(&bad("sluice_gpu_busy_ratio", MetricKind::Gauge, NONE)).is_err());
        assert!(check_name(&bad("sluice_engine_busy", MetricKind::Gauge, NONE)).is_err());
        // What promtool rejected in `sluice_domain_mix_count` (a gauge).
        assert!(check_name(&bad("sluice_domain_mix_count", MetricKind::Gauge, NONE)).is_err());
        assert!(check_name(&bad("sluice_engine_x_sum", MetricKind::Gauge, NONE)).is_err());
        assert!(check_name(&bad("sluice_engine_tokens", MetricKind::Counter, NONE)).is_err());
        assert!(
            check_name(&bad(
                "sluice_engine_x_tokens_total",
                MetricKind::Gauge,
                NONE
            ))
            .is_err()
        );
        assert!(check_name(&bad("sluice_engine_x_seconds", MetricKind::Histogram, NONE)).is_err());
        assert!(
            check_name(&bad(
                "sluice_engine_x_seconds",
                MetricKind::Histogram,
                &[2.0, 1.0]
            ))
            .is_err()
        );
    }

    #[test]
    fn design_mandated_names_exist() {
        for name in [
            "sluice_replay_transitions_total",
            "sluice_actor_restarts_total",
            "sluice_domain_mix_actual",
            "sluice_domain_mix_target",
            "sluice_domain_mix_rollouts_total",
        ] {
            assert!(find(name).is_some(), "{name}");
        }
    }

    #[test]
    fn component_series_are_capped() {
        let mut series = ComponentSeries::default();
        for i in 0..MAX_REWARD_COMPONENT_SERIES {
            assert!(series.admit("math", &format!("c{i}")));
        }
        assert!(!series.admit("math", "one_too_many"));
        assert!(!series.admit("code", "c0"));
        assert!(series.admit("math", "c0"), "admitted series stay admitted");
    }
}
