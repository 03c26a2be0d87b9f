//! The node's handles (cheap clones of every actor's, what the admin API and the supervision
//! code hold) and the `/v1/status` view they gather. A module of its own, below the node, the
//! admin API and supervision, so none of them imports another in a circle; the checkpoint
//! request lives with the checkpoint logic in [`crate::checkpoints`].

use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use serde::Serialize;
use sluice_core::{Knobs, KnobsHandle};
use sluice_engine::EngineStats;
use sluice_replay::StoreSnapshot;

use sluice_actors::ActorError;
use sluice_actors::checkpoint::{CheckpointDir, Manifest};
use sluice_actors::controller::{ControllerHandle, ControllerStatus};
use sluice_actors::engine::{EngineHandle, ReplicaHealth};
use sluice_actors::events::RunEvents;
use sluice_actors::replay::{ReplayHandle, ReplayStatus};
use sluice_actors::sampler::SamplerHandle;
use sluice_actors::trainer::{TrainerHandle, TrainerStatus};

/// Everything `/v1/status` shows.
#[derive(Debug, Clone, Serialize)]
pub struct NodeStatus {
    /// Seconds since the node started.
    pub uptime_seconds: f64,
    /// Live knobs.
    pub knobs: Knobs,
    /// Controller view.
    pub controller: ControllerStatus,
    /// Trainer view.
    pub trainer: TrainerStatus,
    /// Replay buckets and counters.
    pub replay: StoreSnapshot,
    /// Engine replicas.
    pub engines: Vec<EngineStats>,
    /// Supervision record of each engine replica (restarts, failures by cause).
    pub engine_health: Vec<ReplicaHealth>,
    /// Why the engine gave up serving (the run stops); `None` while it serves.
    pub engine_failure: Option<String>,
    /// The newest checkpoint written or restored by this process.
    pub checkpoint: Option<Manifest>,
    /// Why checkpoints stopped the run ([`crate::checkpoints::MAX_FAILED_IN_A_ROW`] periodic
    /// ones failed in a row); `None` while they are written.
    pub checkpoint_failure: Option<String>,
}

impl NodeStatus {
    /// Busy fraction of the engine replicas since start (mean over replicas).
    pub fn engine_busy_ratio(&self) -> f64 {
        let n = self.engines.len().max(1) as f64;
        self.engines
            .iter()
            .map(|e| {
                if e.uptime_seconds > 0.0 {
                    e.busy_seconds / e.uptime_seconds
                } else {
                    0.0
                }
            })
            .sum::<f64>()
            / n
    }
}

/// Cheap clones of the node's handles (what the admin API needs).
#[derive(Clone)]
pub struct NodeHandles {
    /// Live knobs.
    pub knobs: KnobsHandle,
    /// Controller.
    pub controller: ControllerHandle,
    /// Engine.
    pub engine: EngineHandle,
    /// Replay store.
    pub replay: ReplayHandle,
    /// Trainer.
    pub trainer: TrainerHandle,
    /// Sampler (its state goes into checkpoints).
    pub sampler: SamplerHandle,
    /// Where the actors announce steps, failures and their ends.
    pub events: RunEvents,
    pub(crate) started: Instant,
    /// Where checkpoints go (`None`: checkpoints are refused).
    pub(crate) checkpoint_dir: Option<CheckpointDir>,
    /// One checkpoint at a time.
    pub(crate) checkpointing: Arc<tokio::sync::Mutex<()>>,
    /// The newest manifest, read by the status without waiting for a checkpoint being written
    /// (which may itself wait for the run log, whose monitor reads the status).
    pub(crate) last_checkpoint: Arc<std::sync::Mutex<Option<Manifest>>>,
    /// The last step the run's metrics log holds, while a run monitor writes one (`None`
    /// otherwise): a checkpoint waits for the log to hold its steps, so that a
    /// `kill -9` after it never leaves a trained, checkpointed step out of the log.
    pub(crate) logged_steps: Arc<tokio::sync::watch::Sender<Option<u64>>>,
    /// The newest evaluation of the run's weights (held by whoever evaluates: the run monitor).
    pub(crate) evaluation: Arc<std::sync::Mutex<Option<EvalStatus>>>,
    /// Set by the periodic checkpoints when they keep failing ([`NodeStatus::checkpoint_failure`]).
    pub(crate) checkpoint_failure: Arc<std::sync::Mutex<Option<String>>>,
    /// The node's resolved config (secrets redacted), written beside each checkpoint.
    pub(crate) config_toml: Arc<str>,
    /// The config's knob values: each checkpoint records the live knobs against them
    /// ([`sluice_core::KnobState`]), so a resume knows which were tuned at runtime.
    pub(crate) config_knobs: Arc<Knobs>,
    /// The live knobs as the graceful stop found them, before it paused admission: the
    /// stop's own pause is not the operator's, and its checkpoint records these.
    pub(crate) knobs_before_stop: Arc<std::sync::Mutex<Option<Knobs>>>,
}

/// The newest evaluation, as `/v1/status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalStatus {
    /// Training steps of the evaluated weights (0: before RL).
    pub step: u64,
    /// Held-out accuracy, the mean over the evaluated domains.
    pub heldout_accuracy: f64,
    /// Training-probe accuracy, the mean over the evaluated domains.
    pub train_accuracy: f64,
    /// Each domain's (held-out, training-probe) accuracy, when several are evaluated.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub domains: std::collections::BTreeMap<String, DomainEvalStatus>,
}

/// One domain's part of an [`EvalStatus`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DomainEvalStatus {
    /// Held-out accuracy.
    pub heldout_accuracy: f64,
    /// Training-probe accuracy.
    pub train_accuracy: f64,
}

impl NodeHandles {
    /// Records the newest evaluation, for `/v1/status`.
    pub fn record_evaluation(&self, evaluation: EvalStatus) {
        *self.evaluation.lock().unwrap_or_else(|p| p.into_inner()) = Some(evaluation);
    }

    /// A run monitor's log now holds steps up to `step` (`None`: no monitor logs any more).
    pub fn record_logged(&self, step: Option<u64>) {
        self.logged_steps.send_replace(step);
    }

    /// The newest evaluation recorded, if any.
    pub fn evaluation(&self) -> Option<EvalStatus> {
        self.evaluation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Gathers every actor's view. Boxed, like the node's entry points ([`crate::node`]).
    pub fn status(&self) -> BoxFuture<'_, Result<NodeStatus, ActorError>> {
        Box::pin(async move {
            let ReplayStatus { store, .. } = self.replay.status().await?;
            Ok(NodeStatus {
                uptime_seconds: self.started.elapsed().as_secs_f64(),
                knobs: self.knobs.current(),
                controller: self.controller.status().await?,
                trainer: self.trainer.status(),
                replay: store,
                engines: self.engine.stats().await?,
                engine_health: self.engine.health().await?,
                engine_failure: self.engine.failure().await?,
                checkpoint: self
                    .last_checkpoint
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone(),
                checkpoint_failure: self
                    .checkpoint_failure
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone(),
            })
        })
    }
}
