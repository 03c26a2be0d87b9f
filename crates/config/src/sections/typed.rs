//! Phase two of the node-level sections: validated, with types that say what was checked
//! (`NonZeroU32`, `SocketAddr`, `Duration`), so consumers never re-validate.
//!
//! `Serialize` writes the resolved config back in the file's own shape: `sluice check` prints it,
//! and what it prints loads again to the same config.

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize, Serializer};
use sluice_core::config::{Device, Secret};
use sluice_core::knobs::Knobs;

mod node;

pub use node::*;

/// `[run]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunConfig {
    /// Run name (`[A-Za-z0-9._-]+`).
    pub name: String,
    /// Output directory.
    pub output_dir: PathBuf,
    /// Master seed.
    pub seed: u64,
    /// Training steps to run.
    pub max_steps: NonZeroU64,
}

fn as_seconds<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// `[rollout]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolloutConfig {
    /// Rollouts per sample.
    pub group_size: NonZeroU32,
    /// Groups per training step.
    pub groups_per_step: NonZeroU32,
    /// Model turns per episode.
    pub max_turns: NonZeroU32,
    /// Turns a prompt keeps after the opening messages (`None`: all of them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_history_turns: Option<NonZeroU32>,
    /// Tokens per turn.
    pub max_new_tokens: NonZeroU32,
    /// Longest prompt sent to the engine (`None`: the model's context minus `max_new_tokens`;
    /// set, it is still capped by that).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_prompt_tokens: Option<NonZeroU32>,
    /// Sampling temperature (≥ 0).
    pub temperature: f64,
    /// Nucleus mass in (0, 1].
    pub top_p: f64,
    /// Top-k (0 = off).
    pub top_k: u32,
    /// Group mean reward below / above which a group counts as too hard / too easy.
    pub balance_threshold: f64,
    /// The last tokens of a turn budget that cost reward (DAPO's overlong buffer; 0 = off).
    pub overlong_buffer_tokens: u32,
    /// Reward a reply cut at its turn budget loses (≥ 0).
    pub overlong_penalty: f64,
    /// Environment worker actors.
    pub env_workers: NonZeroU32,
    /// Environment calls each worker runs at once.
    pub env_calls_per_worker: NonZeroU32,
    /// Initial runtime knobs (resolved: no zeros meaning "default").
    #[serde(flatten)]
    pub knobs: Knobs,
}

/// `[metrics]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricsConfig {
    /// Serve `/metrics`.
    pub enabled: bool,
    /// Listen address.
    pub listen: SocketAddr,
    /// Also write every `metrics.jsonl` scalar to `<output_dir>/tensorboard/` as TensorBoard
    /// event files.
    pub tensorboard: bool,
}

/// `[admin]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdminConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// Bearer token for mutating calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<Secret>,
}

/// What the warm-start's probe plays (`warmup.probe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WarmupProbeSet {
    /// A fixed draw of `probe_samples` training problems: the held-out set decides nothing.
    Train,
    /// Each domain's held-out set, the one `[eval]` scores: RL starts from the same held-out
    /// accuracy whatever the warm-start's trajectory, at the price of choosing the stopping
    /// point on the held-out set.
    Heldout,
}

impl WarmupProbeSet {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        sluice_core::choice::Choice::name(self)
    }
}

sluice_core::impl_choice!(WarmupProbeSet);

/// `[warmup]`: supervised warm-start before RL.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WarmupConfig {
    /// Run the warm-start when the run starts fresh.
    pub enabled: bool,
    /// Most supervised steps.
    pub max_steps: NonZeroU64,
    /// Demonstrations per step.
    pub batch_size: NonZeroU32,
    /// Learning rate (constant).
    pub learning_rate: f64,
    /// Stop once probe accuracy reaches this.
    pub target_accuracy: f64,
    /// What the probe plays.
    pub probe: WarmupProbeSet,
    /// Probe every this many steps.
    pub check_every: NonZeroU64,
    /// Training problems in the probe (`probe = "train"`).
    pub probe_samples: NonZeroU32,
}

/// `[eval]`: periodic held-out evaluation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalConfig {
    /// Evaluate every this many steps (0: only before and after training).
    pub every_steps: u64,
    /// Held-out samples.
    pub samples: NonZeroU32,
    /// Sampling temperature (0: greedy).
    pub temperature: f64,
    /// Sampled replies per held-out problem, k, for pass@k and mean@k (1: none).
    pub samples_per_problem: NonZeroU32,
    /// Sampling temperature of the k replies (> 0).
    pub sample_temperature: f64,
    /// Stop training once held-out accuracy reaches this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_at_accuracy: Option<f64>,
    /// Task to evaluate (default: the first dataset's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// Device of the evaluation engine (`engine.device` unless set).
    pub device: Device,
}

fn as_seconds_or_zero<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.map_or(0.0, |d| d.as_secs_f64()))
}

/// `[supervision]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SupervisionConfig {
    /// First restart delay; doubles per consecutive failure.
    #[serde(rename = "restart_backoff_initial_s", serialize_with = "as_seconds")]
    pub restart_backoff_initial: Duration,
    /// Longest restart delay (and the uptime after which an actor counts as healthy again).
    #[serde(rename = "restart_backoff_max_s", serialize_with = "as_seconds")]
    pub restart_backoff_max: Duration,
    /// Engine replica watchdog (`None` = off).
    #[serde(rename = "engine_watchdog_s", serialize_with = "as_seconds_or_zero")]
    pub engine_watchdog: Option<Duration>,
    /// Checkpoint every this many training steps (0 = only on stop and on request).
    pub checkpoint_every_steps: u64,
    /// Bound on a graceful stop.
    #[serde(rename = "shutdown_timeout_s", serialize_with = "as_seconds")]
    pub shutdown_timeout: Duration,
    /// Bound on one environment call; a call past it ends the rollout as `Timeout`.
    #[serde(rename = "env_step_timeout_s", serialize_with = "as_seconds")]
    pub env_step_timeout: Duration,
    /// Failures in a row (no request served in between) after which a replica stops the run
    /// (0 = restart forever).
    pub engine_max_restarts: u64,
    /// How long the run waits with no replica able to serve before it stops (`None` = forever).
    #[serde(
        rename = "engine_unavailable_timeout_s",
        serialize_with = "as_seconds_or_zero"
    )]
    pub engine_unavailable_timeout: Option<Duration>,
    /// Untrainable groups in a row (failed or filtered) that stop the run (0 = never).
    pub no_progress_groups: u64,
}

/// `[faults]`: injection periods, 0 = off.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FaultsConfig {
    /// Engine replica crash period, in requests per replica.
    pub engine_crash_every_requests: u64,
    /// Engine replica hang period, in requests per replica.
    pub engine_hang_every_requests: u64,
    /// The training step (1-based, of this process) that fails.
    pub trainer_error_at_step: u64,
    /// The training step (1-based, of this process) that panics.
    pub trainer_panic_at_step: u64,
    /// Skipped-step period, in training steps of the process (the batch is consumed, nothing is
    /// published, as when every advantage is zero).
    pub trainer_skip_every_steps: u64,
    /// Environment step panic period, in steps of the node.
    pub env_panic_every_steps: u64,
    /// Environment step hang period, in steps of the node.
    pub env_hang_every_steps: u64,
    /// Reward panic period, in finished episodes of the node.
    pub reward_panic_every_episodes: u64,
}

impl FaultsConfig {
    /// Any fault is switched on.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}
