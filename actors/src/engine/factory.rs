//! How the engine actor builds a replica. [`ReplicaFactory`] is given the replica's index, the
//! newest weights the actor has seen (the start version until the first update, then each
//! published snapshot) and the replica's event sink, and may fail: a failed build is a replica
//! failure like any other (counted, restarted after the backoff, given up on per the policy).
//! A replica rebuilt after a crash therefore starts on the latest weights without the factory
//! keeping its own copy of them.
//!
//! A factory whose servers come and go (a head's joined engine nodes) carries a *wake* channel
//! ([`ReplicaFactory::with_wake`]): a slot it has no server for (`EngineError::NoServer`) is
//! tried again when the channel changes (a node joined or came back), not on a timer.

use std::sync::Arc;

use sluice_core::WeightSnapshot;
use sluice_engine::{EngineError, EventSink, InferenceBackend};
use tokio::sync::watch;

use super::BackendFactory;

/// The function behind a [`ReplicaFactory`].
type Build = dyn Fn(u32, &WeightSnapshot, EventSink) -> Result<Box<dyn InferenceBackend>, EngineError>
    + Send
    + Sync;

/// Builds replica backends; cloning is shallow. See the module docs.
#[derive(Clone)]
pub struct ReplicaFactory {
    build: Arc<Build>,
    /// Changes of the servers the factory builds on, when they come and go.
    wake: Option<watch::Receiver<u64>>,
}

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
        Self {
            build: Arc::new(build),
            wake: None,
        }
    }

    /// The same factory, whose servers change when `wake` does: a vacant slot is tried again
    /// at the next change.
    pub fn with_wake(mut self, wake: watch::Receiver<u64>) -> Self {
        self.wake = Some(wake);
        self
    }

    /// The wake channel.
    pub(crate) fn wake(&self) -> Option<watch::Receiver<u64>> {
        self.wake.clone()
    }

    /// The wake channel's value now (read before a build, so that a change during the build
    /// is not missed).
    pub(crate) fn wake_seen(&self) -> Option<u64> {
        self.wake.as_ref().map(|w| *w.borrow())
    }

    /// Builds replica `replica` on `weights`, reporting to `sink`.
    pub fn build(
        &self,
        replica: u32,
        weights: &WeightSnapshot,
        sink: EventSink,
    ) -> Result<Box<dyn InferenceBackend>, EngineError> {
        (self.build)(replica, weights, sink)
    }
}

/// A factory that cannot fail and needs only the version (the simulated engine's; the native
/// and remote setups that keep their own copy of the newest weights).
impl From<BackendFactory> for ReplicaFactory {
    fn from(factory: BackendFactory) -> Self {
        Self::new(move |replica, weights, sink| Ok(factory(replica, weights.version, sink)))
    }
}
