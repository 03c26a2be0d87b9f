//! How a run ends, read from the node's status (every way has its checkpoint reason), and when a
//! run's checkpoint says it has ended already.

use std::path::Path;

use sluice_config::Config;

use crate::handles::NodeStatus;
use sluice_actors::ActorError;
use sluice_actors::checkpoint::Manifest;

/// Why a run stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEnd {
    /// The trainer used `run.max_steps`.
    Done,
    /// The held-out accuracy reached `eval.stop_at_accuracy`.
    TargetReached {
        /// The run's step that reached it.
        step: u64,
        /// The run's wall time then, seconds.
        wall_s: f64,
    },
    /// A training step failed; the trainer stopped (DESIGN §3: a failed step ends the run).
    TrainerFailed(String),
    /// Too many groups in a row ended untrainable.
    NoProgress(String),
    /// The inference engine gave up serving.
    EngineFailure(String),
    /// An actor ended while the run was going.
    ActorGone(&'static str),
    /// Periodic checkpoints kept failing (a full disk, say): training on would save nothing.
    CheckpointFailed(String),
}

impl RunEnd {
    /// The end `status` shows, if the run is over; `gone` is the first actor that ended.
    pub fn observe(status: &NodeStatus, gone: Option<&'static str>) -> Option<Self> {
        if let Some(reason) = &status.checkpoint_failure {
            return Some(Self::CheckpointFailed(reason.clone()));
        }
        if let Some(reason) = &status.controller.no_progress {
            return Some(Self::NoProgress(reason.clone()));
        }
        if let Some(reason) = &status.engine_failure {
            return Some(Self::EngineFailure(reason.clone()));
        }
        if let Some(e) = &status.trainer.error {
            return Some(Self::TrainerFailed(e.clone()));
        }
        if status.trainer.done {
            return Some(Self::Done);
        }
        gone.map(Self::ActorGone)
    }

    /// The reason the final checkpoint records; `None` when no checkpoint can be written (an
    /// actor that holds the run's state is gone, or checkpoints keep failing).
    pub fn checkpoint_reason(&self) -> Option<&'static str> {
        match self {
            Self::Done => Some("done"),
            Self::TargetReached { .. } => Some("target_reached"),
            Self::TrainerFailed(_) => Some("trainer_error"),
            Self::NoProgress(_) => Some("no_progress"),
            Self::EngineFailure(_) => Some("engine_failure"),
            Self::ActorGone(_) | Self::CheckpointFailed(_) => None,
        }
    }

    /// The run reached its end as planned.
    pub fn is_success(&self) -> bool {
        matches!(self, Self::Done | Self::TargetReached { .. })
    }

    /// A failed end as an error (`None` for a success).
    pub fn error(&self) -> Option<ActorError> {
        match self {
            Self::Done | Self::TargetReached { .. } => None,
            Self::TrainerFailed(e) => Some(ActorError::TrainingFailed(e.clone())),
            Self::NoProgress(r) => Some(ActorError::NoProgress(r.clone())),
            Self::EngineFailure(r) => Some(ActorError::EngineUnavailable(r.clone())),
            Self::ActorGone(actor) => Some(ActorError::Gone { actor }),
            Self::CheckpointFailed(e) => Some(ActorError::Checkpoint(e.clone())),
        }
    }
}

/// Why a run of `config` has nothing left to do when its checkpoint (at `root`) says it ended:
/// it trained its step budget, or it reached its held-out target and the config asks for no
/// higher one. Started again, such a run used to resume and train on (its checkpoint's weights
/// are a step or more past the evaluated ones, and may score below the target).
pub(super) fn already_ended(config: &Config, root: &Path, m: &Manifest) -> Option<String> {
    let max_steps = config.run.max_steps.get();
    if m.steps >= max_steps {
        return Some(format!(
            "the run already trained its {max_steps} steps (run.max_steps; checkpoint {} at step {}): nothing to do; raise run.max_steps to train on",
            root.display(),
            m.steps
        ));
    }
    if m.reason != "target_reached" {
        return None;
    }
    let target = config.eval.stop_at_accuracy?;
    let reached = match crate::checkpoints::saved_target(root) {
        Some(saved) => saved?,
        None => target,
    };
    (target <= reached).then(|| {
        format!(
            "the run already reached its held-out target ({:.1}%, eval.stop_at_accuracy; checkpoint {} at step {}): nothing to do; the weights that met it are in {}; raise eval.stop_at_accuracy to train on",
            100.0 * reached,
            root.display(),
            m.steps,
            config.run.output_dir.join(super::TARGET_MODEL_DIR).display()
        )
    })
}
