//! Phase one of the node-level sections, as serde sees them. Every section denies unknown keys and has defaults,
//! so a minimal file is valid. Numbers are read wide (`i64`, `f64`) and enums as strings, so that
//! phase two can say "expected an integer ≥ 1, got -3" instead of a serde type error.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

mod node;

pub use node::*;

/// `[run]`: identity and length of the run.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRun {
    /// Run name; also seeds the run id and the default output dir.
    pub name: String,
    /// Where checkpoints, the replay store and metrics go (default `runs/<name>`).
    pub output_dir: Option<String>,
    /// Master seed; every component derives its own seed from it.
    pub seed: i64,
    /// Training steps to run.
    pub max_steps: i64,
}

impl Default for RawRun {
    fn default() -> Self {
        Self {
            name: "sluice".into(),
            output_dir: None,
            seed: 0,
            max_steps: 100,
        }
    }
}

/// `[rollout]`: group shape, sampling and the initial runtime knobs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRollout {
    /// Rollouts per data sample.
    pub group_size: i64,
    /// Groups per training step (the global batch, in groups).
    pub groups_per_step: i64,
    /// Model turns per episode, at most.
    pub max_turns: i64,
    /// Turns a prompt keeps after the opening messages (0 = all).
    pub max_history_turns: i64,
    /// Tokens per model turn, at most.
    pub max_new_tokens: i64,
    /// Longest prompt sent to the engine, tokens (0 = the model's context minus `max_new_tokens`).
    pub max_prompt_tokens: i64,
    /// Sampling temperature (0 = greedy).
    pub temperature: f64,
    /// Nucleus sampling mass, in (0, 1].
    pub top_p: f64,
    /// Top-k cut-off (0 = off).
    pub top_k: i64,
    /// Knob: over-sending factor s ≥ 0.
    pub staleness_threshold: f64,
    /// Knob: η, the largest version lag a trained token may have.
    pub max_version_lag: i64,
    /// Knob: `demand` (generate ahead only as far as keeps the trainer busy) or `eta`.
    pub admission: String,
    /// Knob: resume aborted turns from their partial output.
    pub enable_partial_rollout: bool,
    /// Knob: aborts before a rollout becomes a tail candidate, minus one (0 = no tail batch).
    pub tail_batch_candidate_steps: i64,
    /// Knob: candidates that trigger a tail round (0 = `groups_per_step`).
    pub tail_batch_trigger_size: i64,
    /// Knob: `abort_resume`, `in_flight` or `drain`.
    pub weight_update_mode: String,
    /// Knob: cap on concurrently generating rollouts (0 = the admission bound).
    pub max_concurrent_rollouts: i64,
    /// Knob: start paused.
    pub paused: bool,
    /// Knob: target weight per domain.
    pub domain_mix: BTreeMap<String, f64>,
    /// Group mean reward below / above which a group counts as too hard / too easy (seed 001).
    pub balance_threshold: f64,
    /// DAPO's overlong buffer: the last tokens of a turn budget that cost reward (0 = off).
    pub overlong_buffer_tokens: i64,
    /// Reward a reply cut at its turn budget loses under the overlong buffer.
    pub overlong_penalty: f64,
    /// Environment worker actors.
    pub env_workers: i64,
    /// Environment calls (first prompt, step, reward) each worker runs at once.
    pub env_calls_per_worker: i64,
}

impl Default for RawRollout {
    fn default() -> Self {
        Self {
            group_size: 8,
            groups_per_step: 8,
            max_turns: 1,
            max_history_turns: 0,
            max_new_tokens: 512,
            max_prompt_tokens: 0,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            staleness_threshold: 0.0,
            max_version_lag: 1,
            admission: "demand".into(),
            enable_partial_rollout: true,
            tail_batch_candidate_steps: 0,
            tail_batch_trigger_size: 0,
            weight_update_mode: "abort_resume".into(),
            max_concurrent_rollouts: 0,
            paused: false,
            domain_mix: BTreeMap::new(),
            balance_threshold: 0.5,
            overlong_buffer_tokens: 0,
            overlong_penalty: 1.0,
            env_workers: 2,
            env_calls_per_worker: 128,
        }
    }
}

/// `[metrics]`: the Prometheus endpoint, and where else the run's metrics go.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawMetrics {
    /// Serve `/metrics`.
    pub enabled: bool,
    /// Listen address.
    pub listen: String,
    /// Also write every `metrics.jsonl` scalar as TensorBoard events.
    pub tensorboard: bool,
}

impl Default for RawMetrics {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: "127.0.0.1:9400".into(),
            tensorboard: false,
        }
    }
}

/// `[admin]`: the admin HTTP API.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawAdmin {
    /// Listen address.
    pub listen: String,
    /// Bearer token for mutating calls (falls back to `$SLUICE_ADMIN_TOKEN`).
    pub token: Option<String>,
}

impl Default for RawAdmin {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9401".into(),
            token: None,
        }
    }
}

/// `[warmup]`: a supervised warm-start on the task's reference replies before RL (native runs).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawWarmup {
    /// Run the warm-start when the run starts fresh.
    pub enabled: bool,
    /// Most supervised steps.
    pub max_steps: i64,
    /// Demonstrations per step.
    pub batch_size: i64,
    /// Learning rate of the warm-start (its own constant schedule).
    pub learning_rate: f64,
    /// Stop once greedy accuracy on the probe reaches this.
    pub target_accuracy: f64,
    /// What the probe plays: `train` (a draw of training problems) or `heldout` (the held-out
    /// set that `[eval]` scores).
    pub probe: String,
    /// Probe every this many steps.
    pub check_every: i64,
    /// Training problems in the probe (`probe = "train"`).
    pub probe_samples: i64,
}

impl Default for RawWarmup {
    fn default() -> Self {
        Self {
            enabled: false,
            max_steps: 300,
            batch_size: 64,
            learning_rate: 3e-3,
            target_accuracy: 0.3,
            probe: "train".into(),
            check_every: 10,
            probe_samples: 128,
        }
    }
}

/// `[eval]`: periodic held-out evaluation (native runs).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawEval {
    /// Evaluate every this many training steps (0: only before and after training).
    pub every_steps: i64,
    /// Held-out samples (tasks that enumerate their held-out split use all of it).
    pub samples: i64,
    /// Sampling temperature of evaluation (0: greedy).
    pub temperature: f64,
    /// Sampled replies per held-out problem for pass@k and mean@k (1: none beyond the main pass).
    pub samples_per_problem: i64,
    /// Sampling temperature of those k replies.
    pub sample_temperature: f64,
    /// Stop training once held-out accuracy reaches this (absent: run all steps).
    pub stop_at_accuracy: Option<f64>,
    /// Task to evaluate (default: the task of the first dataset).
    pub task: Option<String>,
    /// `cpu` or `cuda:N` of the evaluation engine (default `engine.device`).
    pub device: Option<String>,
}

impl Default for RawEval {
    fn default() -> Self {
        Self {
            every_steps: 10,
            samples: 256,
            temperature: 0.0,
            samples_per_problem: 1,
            sample_temperature: 1.0,
            stop_at_accuracy: None,
            task: None,
            device: None,
        }
    }
}

/// `[supervision]`: actor restarts, the engine watchdog, checkpoints and the graceful stop.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSupervision {
    /// First delay before restarting a failed actor, seconds; doubles per consecutive failure.
    pub restart_backoff_initial_s: f64,
    /// Longest restart delay, seconds; a restarted actor that stays up this long is healthy again.
    pub restart_backoff_max_s: f64,
    /// Restart an engine replica that has requests but made no progress for this long (0 = off).
    pub engine_watchdog_s: f64,
    /// Write a checkpoint every this many training steps (0 = only on stop and on request).
    pub checkpoint_every_steps: i64,
    /// Bound on a graceful stop (abort, store partials, checkpoint), seconds.
    pub shutdown_timeout_s: f64,
    /// Bound on one environment call (first prompt or step, reward included), seconds.
    pub env_step_timeout_s: f64,
    /// Stop the run when an engine replica fails this many times in a row without serving a
    /// request in between (0 = restart forever).
    pub engine_max_restarts: i64,
    /// Stop the run when no engine replica can serve for this long, seconds (0 = wait forever).
    pub engine_unavailable_timeout_s: f64,
    /// Stop the run when this many groups in a row end untrainable (failed or filtered; 0 = never).
    pub no_progress_groups: i64,
}

impl Default for RawSupervision {
    fn default() -> Self {
        Self {
            restart_backoff_initial_s: 0.1,
            restart_backoff_max_s: 30.0,
            engine_watchdog_s: 300.0,
            checkpoint_every_steps: 0,
            shutdown_timeout_s: 60.0,
            env_step_timeout_s: 300.0,
            engine_max_restarts: 10,
            engine_unavailable_timeout_s: 120.0,
            no_progress_groups: 256,
        }
    }
}

/// `[faults]`: fault injection for tests and drills. Every key is a period (0 = off, the default).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawFaults {
    /// Each engine replica crashes at every N-th request it receives.
    pub engine_crash_every_requests: i64,
    /// Each engine replica stops making progress at every N-th request (the watchdog's case).
    pub engine_hang_every_requests: i64,
    /// The N-th training step of the process fails.
    pub trainer_error_at_step: i64,
    /// The N-th training step of the process panics.
    pub trainer_panic_at_step: i64,
    /// Every N-th training step publishes nothing, as when every advantage is zero.
    pub trainer_skip_every_steps: i64,
    /// Every N-th environment step panics.
    pub env_panic_every_steps: i64,
    /// Every N-th environment step hangs (until `supervision.env_step_timeout_s`).
    pub env_hang_every_steps: i64,
    /// The reward of every N-th finished episode panics.
    pub reward_panic_every_episodes: i64,
}
