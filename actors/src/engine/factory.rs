//! How the engine actor builds a replica. [`ReplicaFactory`] is given the replica's index, the
//! newest weights the actor has seen (the start version until the first update, then each
//! published snapshot) and the replica's event sink, and may fail: a failed build is a replica
//! failure like any other (counted, restarted after the backoff, given up on per the policy).
//! A replica rebuilt after a crash therefore starts on the latest weights without the factory
//! keeping its own copy of them.

use std::sync::Arc;

use sluice_core::WeightSnapshot;
use sluice_engine::{EngineError, EventSink, InferenceBackend};

use super::BackendFactory;

/// The function behind a [`ReplicaFactory`].
type Build = dyn Fn(u32, &WeightSnapshot, EventSink) -> Result<Box<dyn InferenceBackend>, EngineError>
    + Send
    + Sync;

/// Builds replica backends; cloning is shallow. See the module docs.
#[derive(Clone)]
pub struct ReplicaFactory(Arc<Build>);

impl ReplicaFactory {
    /// A factory from `build(replica, latest_weights, sink)`.
    pub fn new(
        build: impl Fn(
            u32,
            &WeightSnapshot,
            EventSink,
        ) -> Result<Box<dyn InferenceBackend>, EngineError>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self(Arc::new(build))
    }

    /// Builds replica `replica` on `weights`, reporting to `sink`.
    pub fn build(
        &self,
        replica: u32,
        weights: &WeightSnapshot,
        sink: EventSink,
    ) -> Result<Box<dyn InferenceBackend>, EngineError> {
        (self.0)(replica, weights, sink)
    }
}

/// A factory that cannot fail and needs only the version (the simulated engine's; the native
/// and remote setups that keep their own copy of the newest weights).
impl From<BackendFactory> for ReplicaFactory {
    fn from(factory: BackendFactory) -> Self {
        Self::new(move |replica, weights, sink| Ok(factory(replica, weights.version, sink)))
    }
}
