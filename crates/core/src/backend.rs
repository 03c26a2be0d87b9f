//! Contracts between the actors and the compute backends that live in other crates: the weight
//! snapshot that travels from trainer to engines, and the trainer backend trait.
//!
//! They sit here, at the bottom of the graph, so that `sluice-trainer` can implement
//! [`TrainerBackend`] and `sluice-engine` can consume a [`WeightSnapshot`] without either
//! depending on the actors that drive them.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::ids::PolicyVersion;
use crate::rollout::RolloutGroup;

/// Published weights: a version plus an opaque, shared payload (the model crate's parameters for
/// the native backends, nothing for the simulated ones). Cloning is shallow, so an engine in the
/// trainer's process swaps to new weights without a copy.
#[derive(Clone)]
pub struct WeightSnapshot {
    /// The version these weights are.
    pub version: PolicyVersion,
    payload: Option<Arc<dyn Any + Send + Sync>>,
}

impl WeightSnapshot {
    /// A snapshot carrying `payload`.
    pub fn new<T: Any + Send + Sync>(version: PolicyVersion, payload: Arc<T>) -> Self {
        Self {
            version,
            payload: Some(payload),
        }
    }

    /// A snapshot that is only a version number (simulated backends).
    pub fn version_only(version: PolicyVersion) -> Self {
        Self {
            version,
            payload: None,
        }
    }

    /// The payload as `T`, when it is one.
    pub fn payload<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.payload.clone()?.downcast::<T>().ok()
    }
}

impl fmt::Debug for WeightSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeightSnapshot")
            .field("version", &self.version)
            .field("has_payload", &self.payload.is_some())
            .finish()
    }
}

/// A backend failed; `kind` is short and stable (a metric label).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct BackendError {
    /// Short stable name.
    pub kind: &'static str,
    /// What happened, with context.
    pub message: String,
}

impl BackendError {
    /// An error of `kind`.
    pub fn new(kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// The advantages of one (domain, situation) in a training batch: how many texts, and the mean
/// and mean absolute advantage the trainer gives them. With the situational baseline each
/// situation is compared only with itself, so its mean is about 0 while its absolute mean shows
/// how much signal the situation carries; with the group baseline the means show which
/// situations the batch's outcomes favour.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SituationAdvantage {
    /// Training texts (turns) in the situation.
    pub texts: u64,
    /// Mean advantage.
    pub mean: f64,
    /// Mean absolute advantage.
    pub abs_mean: f64,
}

/// [`SituationAdvantage`]s of a batch per (domain, situation label).
pub type SituationAdvantages = BTreeMap<(String, String), SituationAdvantage>;

/// What one training step produced.
#[derive(Debug, Clone)]
pub struct TrainStepOutput {
    /// Named scalar metrics (loss, clip fraction, …).
    pub metrics: BTreeMap<String, f64>,
    /// The new weights (`version + 1`), or `None` when the batch was skipped (e.g. every group had
    /// zero advantage): nothing is published then.
    pub weights: Option<WeightSnapshot>,
    /// Completion tokens trained on.
    pub trained_tokens: u64,
    /// The advantages the step gave its texts, per (domain, situation), when the backend
    /// computed them (so the trainer actor reports them without computing them again); `None`
    /// for a backend that computes no advantages.
    pub situations: Option<SituationAdvantages>,
}

/// A trainer the trainer actor drives from its dedicated thread. Calls block; they never run on
/// the async runtime.
pub trait TrainerBackend: Send + 'static {
    /// The version of the weights the next step starts from.
    fn version(&self) -> PolicyVersion;

    /// One optimizer step on `batch`, built by the caller from weights [`Self::version`].
    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError>;

    /// The current weights, for an engine that joins late.
    fn snapshot(&self) -> WeightSnapshot;

    /// Writes everything needed to resume under `dir`.
    fn checkpoint(&mut self, dir: &Path) -> Result<(), BackendError>;

    /// Restores from a checkpoint written by [`Self::checkpoint`].
    fn restore(&mut self, dir: &Path) -> Result<(), BackendError>;

    /// Relabels the current weights as `version` (newer than [`Self::version`]) without changing
    /// them. A run restarted after a crash needs it when the replay store saw versions newer than
    /// the last checkpoint: those weights died with the process, and versions never go backwards,
    /// so training continues from the checkpoint's weights under the next free number. Backends
    /// whose published snapshots carry their version must relabel those too. Default: refused.
    fn set_version(&mut self, version: PolicyVersion) -> Result<(), BackendError> {
        Err(BackendError::new(
            "unsupported",
            format!(
                "this trainer backend cannot relabel its weights {} as {version}",
                self.version()
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_payload_downcasts_only_to_its_type() {
        let s = WeightSnapshot::new(PolicyVersion(3), Arc::new(vec![1.0f32, 2.0]));
        assert_eq!(s.payload::<Vec<f32>>().unwrap().len(), 2);
        assert!(s.payload::<String>().is_none());
        assert!(
            WeightSnapshot::version_only(PolicyVersion(1))
                .payload::<Vec<f32>>()
                .is_none()
        );
    }
}
