//! The actors of a Sluice node (`DESIGN.md` §3), one module each, each behind a typed handle that
//! hides its `ActorRef` and reply ports.
//!
//! | module | actor / part | role |
//! |---|---|---|
//! | [`sampler`] | DatasetSampler | hands data samples to the controller on request (credits) |
//! | [`controller`] | RolloutController | admission, over-sending, resume priority, tail batch |
//! | [`engine`] | InferenceEngine | drives [`sluice_engine::InferenceBackend`] replicas, routes resumes |
//! | [`env_worker`] | EnvWorker pool | environment steps and rewards |
//! | [`replay`] | ReplayStore | the bucket state machine on a dedicated thread, persisted |
//! | [`trainer`] | Trainer | pulls batches, trains on a dedicated thread, publishes weights |
//! | [`restart_policy`] | restart backoff and progress watchdog, as pure policies |
//! | [`checkpoint`] | the checkpoint directory: manifest, atomic swap, load |
//! | [`faults`] | fault injection decorators (`[faults]`, off by default) |
//! | [`env_faults`] | decorators around the env: a deadline on every call (always on) and the env part of `[faults]` |
//! | [`counters`] | counters every actor bumps, without the metrics plumbing |
//! | [`events`] | the run's event feed ([`RunEvent`]) |
//!
//! The node that builds, starts and supervises these actors — its admin API, cluster membership,
//! telemetry and the run's lifecycle — is the `sluice-node` crate, one layer up.
//!
//! Flow control: ractor mailboxes are unbounded, so every producer is bounded by the controller's
//! admission and in-flight target: the engine never holds more requests than rollouts in flight,
//! the env pool never more steps, the sampler never more samples than the controller asked for.

pub mod checkpoint;
pub mod controller;
pub mod counters;
pub mod engine;
pub mod env_faults;
pub mod env_worker;
pub mod events;
pub mod faults;
pub mod replay;
pub mod restart_policy;
pub mod sampler;
pub mod trainer;

use std::sync::Arc;

pub use events::{RunEvent, RunEvents};

/// A callback into another actor's mailbox: calling it casts a message and never blocks.
pub type Sink<T> = Arc<dyn Fn(T) + Send + Sync>;

/// An actor could not be reached or started.
#[derive(Debug, thiserror::Error)]
pub enum ActorError {
    /// The actor is gone (stopped or crashed).
    #[error("actor `{actor}` is not running")]
    Gone {
        /// Which actor.
        actor: &'static str,
    },
    /// Spawning failed.
    #[error("cannot start actor `{actor}`: {message}")]
    Spawn {
        /// Which actor.
        actor: &'static str,
        /// Why.
        message: String,
    },
    /// Setting the node up failed (replay database, listeners, config).
    #[error("node setup: {0}")]
    Setup(String),
    /// The engine gave up serving (see [`crate::engine::EngineHandle::failure`]).
    #[error("inference engine unavailable: {0}")]
    EngineUnavailable(String),
    /// Too many groups in a row ended untrainable (see [`sluice_replay::ProgressWatch`]).
    #[error("the run makes no progress: {0}")]
    NoProgress(String),
    /// A training step failed and the trainer stopped.
    #[error("training failed: {0}")]
    TrainingFailed(String),
    /// Evaluating the policy failed.
    #[error("{0}")]
    Evaluation(String),
    /// Checkpoints kept failing: the run's progress could no longer be saved.
    #[error("checkpoints failed: {0}")]
    Checkpoint(String),
}

impl ActorError {
    /// Short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Gone { .. } => "actor_gone",
            Self::Spawn { .. } => "actor_spawn",
            Self::Setup(_) => "node_setup",
            Self::EngineUnavailable(_) => "engine_unavailable",
            Self::NoProgress(_) => "no_progress",
            Self::TrainingFailed(_) => "training_failed",
            Self::Evaluation(_) => "evaluation",
            Self::Checkpoint(_) => "checkpoint_failed",
        }
    }
}
