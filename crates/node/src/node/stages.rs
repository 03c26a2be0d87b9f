//! The stages of [`Node::start`](super::Node::start) and how they unwind.
//!
//! A node starts in three stages, each returning a guard that owns what it started:
//!
//! | stage | starts | its guard stops |
//! |---|---|---|
//! | [`Stage::Core`] | the supervisor, controller, replay store, engine and env pool | controller, engine, env pool, replay store (which commits what they sent), supervisor |
//! | [`Stage::Feeds`] | the sampler and the trainer, then connects the controller to its peers | trainer, sampler |
//! | [`Stage::Servers`] | periodic checkpoints, the admin API, `/metrics`, the telemetry task | telemetry, checkpoints, admin API, `/metrics` |
//!
//! [`Started`] holds the guards. When a stage fails, the guards of the stages before it stop in
//! reverse order (servers, feeds, core) before the start returns its error; the node's own
//! stop ([`Node::shutdown`](super::Node::shutdown)) is the same unwinding. Inside a stage, a
//! failure half-way stops what that stage had started so far. A guard dropped without being
//! stopped (a start cancelled half-way, a node dropped) tells everything it still holds to stop,
//! without waiting.

use std::fmt;

use sluice_actors::ActorError;
use sluice_actors::replay::ReplayStatus;

use super::core_stage::Core;
use super::feeds_stage::Feeds;
use super::servers_stage::Servers;

/// A stage of the node's start, in start order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The supervisor, controller, replay store, engine and env pool.
    Core,
    /// The sampler and the trainer, and the controller connected to its peers.
    Feeds,
    /// Periodic checkpoints, the admin API, `/metrics` and the telemetry task.
    Servers,
}

impl Stage {
    /// The stage's name in messages (`core`, `feeds`, `servers`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Core => "core",
            Self::Feeds => "feeds",
            Self::Servers => "servers",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The guards of the stages started so far.
#[derive(Default)]
pub(super) struct Started {
    pub core: Option<Core>,
    pub feeds: Option<Feeds>,
    pub servers: Option<Servers>,
}

impl Started {
    /// Stops every stage started, the last one first: servers, feeds, then the core (upstream
    /// first inside each, so nothing new is produced). Returns the replay store's final state,
    /// as it is on disk, when the core was running.
    pub async fn stop(&mut self) -> Option<ReplayStatus> {
        if let Some(servers) = self.servers.take() {
            servers.stop().await;
        }
        if let Some(feeds) = self.feeds.take() {
            feeds.stop().await;
        }
        match self.core.take() {
            Some(core) => core.stop().await,
            None => None,
        }
    }

    /// Unwinds after `stage` failed with `error`: stops what the earlier stages started and
    /// hands the error back, naming the stage.
    pub async fn unwind(&mut self, stage: Stage, error: ActorError) -> ActorError {
        tracing::error!(%stage, error = %error, "node start failed; stopping what was started");
        self.stop().await;
        error
    }
}

/// The failure a test asked for after `stage` ([`NodeOptions::fail_after`](super::NodeOptions::fail_after)).
pub(super) fn fail_point(fail_after: Option<Stage>, stage: Stage) -> Result<(), ActorError> {
    if fail_after == Some(stage) {
        return Err(ActorError::Setup(format!(
            "injected failure after the {stage} stage (NodeOptions::fail_after)"
        )));
    }
    Ok(())
}
