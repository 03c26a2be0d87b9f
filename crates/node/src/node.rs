//! The node: builds a node's pipeline from a [`Config`](sluice_config::Config) ([`Node::start`],
//! in `start`, in the three [`Stage`]s of `stages`, each a guard that stops what it started;
//! what tests inject is in [`NodeOptions`]), supervises it, serves the admin API and
//! `/metrics`, and shuts it down in order.
//!
//! Restart policy, per actor (ractor's default would stop everything on any child exit):
//!
//! | actor | on failure |
//! |---|---|
//! | engine replica | rebuilt by the engine actor after an exponential backoff (`[supervision]`); its requests return aborted with their last partial; a watchdog fails a replica that holds requests without progress; past `engine_max_restarts` failures in a row, or with no replica for `engine_unavailable_timeout_s`, the engine gives up and the node stops the run with a checkpoint |
//! | env worker | a panicking env fails that rollout (`Error("env_panic")`); the worker lives on |
//! | trainer step | a failed (or panicked) step stops training; the run ends with a checkpoint instead of looping (a panicked trainer's state is not checkpointed) |
//! | groups | `no_progress_groups` untrainable groups in a row stop the run with a checkpoint |
//! | sampler, controller, replay, engine actor, trainer, env worker (the actor itself ends) | the node stops with an error; restarting the process recovers from the last checkpoint plus the replay store |
//!
//! The last row is deliberate: those actors hold the run's accounting, and the replay store on
//! disk is the one place it survives. Every actor is linked to the node's supervisor actor
//! (`supervisor`), whose supervision handler applies that row; [`Node::failure`] reports which
//! actor ended first.
//!
//! Checkpoints and restore at start live in [`crate::checkpoints`], the graceful stop in
//! [`crate::graceful_stop`].
//!
//! Boxed futures: [`Node::start`], [`Node::status`], [`Node::stop_gracefully`] and
//! [`Node::shutdown`] (like the checkpoint, the run's lifecycle calls in [`crate::run`] and a
//! member node's calls) return a boxed future instead of being `async fn`s. An `async fn`'s
//! state machine is compiled again in every crate that awaits it, with everything it awaits in
//! turn, in each codegen unit that does: the `sluice` binary and `sluice-bench` each compiled
//! their own copies of most of this crate (the binary's crate, 1.1 MB of the library crates'
//! machine code), in the last two steps of a release build, which run alone. Boxed, a body is
//! compiled once, here; the price is one allocation per call, on calls made once a run or once
//! a status read.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use sluice_core::WeightSnapshot;

use crate::run::RunEnd;
use crate::{checkpoints, graceful_stop};
use sluice_actors::ActorError;
use sluice_actors::checkpoint::CheckpointError;
use sluice_actors::replay::ReplayStatus;

mod build;
mod core_stage;
mod feeds_stage;
mod options;
mod servers_stage;
mod stages;
mod start;
mod supervisor;

use stages::Started;

pub use crate::handles::{NodeHandles, NodeStatus};
pub use options::NodeOptions;
pub use stages::Stage;

/// A running node.
pub struct Node {
    /// Handles to every actor.
    pub handles: NodeHandles,
    /// The guards of the start's stages: what [`Node::shutdown`] stops, in reverse order.
    started: Started,
    /// The weights the engine started on (the trainer's, after a restore).
    start_weights: WeightSnapshot,
    /// The run's steps when the node started (its checkpoint's; 0 for a fresh run).
    start_step: u64,
    pub(crate) shutdown_timeout: Duration,
}

impl Node {
    /// The admin API's bound address.
    pub fn admin_addr(&self) -> Option<std::net::SocketAddr> {
        let servers = self.started.servers.as_ref()?;
        servers.admin.as_ref().map(|s| s.addr)
    }

    /// The metrics endpoint's bound address.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        let servers = self.started.servers.as_ref()?;
        servers.metrics.as_ref().map(|s| s.addr)
    }

    /// Every actor's view.
    pub fn status(&self) -> BoxFuture<'_, Result<NodeStatus, ActorError>> {
        self.handles.status()
    }

    /// The first actor that ended while the node was running, if any.
    pub fn failure(&self) -> Option<&'static str> {
        self.handles.events.ended()
    }

    /// The weights the engine started on: the trainer's, after a restore (a resumed run's
    /// first evaluation scores them).
    pub fn start_weights(&self) -> &WeightSnapshot {
        &self.start_weights
    }

    /// The run's steps when the node started: its checkpoint's, 0 for a fresh run (the
    /// trainer may be past it by the time anyone asks its status).
    pub fn start_step(&self) -> u64 {
        self.start_step
    }

    /// Marks the end of the run with a final checkpoint (when checkpoints are on) whose reason
    /// says how it ended (`done`, `target_reached`, `trainer_error`, `no_progress`,
    /// `engine_failure`): the same config resumes from it. A failed checkpoint is logged and
    /// returned (the run's end stands, but what it trained since the last checkpoint is not
    /// saved: `sluice run` exits non-zero).
    pub async fn finish(&self, end: &RunEnd) -> Option<CheckpointError> {
        let reason = end.checkpoint_reason()?;
        self.handles.checkpoint_dir.as_ref()?;
        let e = checkpoints::checkpoint(&self.handles, reason).await.err()?;
        if e.trainer_poisoned() {
            // On purpose (docs/operations.md): the last good checkpoint stands.
            tracing::warn!(
                reason,
                "no final checkpoint: a training step panicked, so the trainer's state is unknown; the last good checkpoint is kept"
            );
            return None;
        }
        tracing::error!(error = %e, reason, "final checkpoint failed");
        Some(e)
    }

    /// Waits until the run ends ([`RunEnd`]: the step budget used, a training step failed, no
    /// progress, the engine gave up, an actor ended) or `timeout` passes, and marks the end with
    /// [`Node::finish`]. It wakes on the actors' [`RunEvents`](sluice_actors::RunEvents), reads the status and hands it to
    /// `progress`. A trainer that failed is returned as a status with its error (callers read
    /// it); the other failures as errors.
    pub async fn wait_done(
        &self,
        timeout: Duration,
        mut progress: impl FnMut(&NodeStatus),
    ) -> Result<NodeStatus, ActorError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut events = self.handles.events.subscribe();
        loop {
            events.borrow_and_update();
            let status = self.status().await?;
            progress(&status);
            if let Some(end) = RunEnd::observe(&status, self.failure()) {
                self.finish(&end).await;
                return match end {
                    RunEnd::Done | RunEnd::TrainerFailed(_) => self.status().await,
                    failed => Err(failed.error().unwrap_or(ActorError::Gone { actor: "node" })),
                };
            }
            let timed_out = || ActorError::Setup(format!("run did not finish within {timeout:?}"));
            match tokio::time::timeout_at(deadline, events.changed()).await {
                Ok(Ok(())) => {}
                // Every sender is gone: nothing will announce again.
                Ok(Err(_)) => return Err(ActorError::Gone { actor: "node" }),
                Err(_) => return Err(timed_out()),
            }
        }
    }

    /// Graceful stop (SIGTERM/SIGINT, `DESIGN.md` §9): stops admitting, aborts every request in
    /// flight and stores its partial in the aborted bucket, writes a checkpoint, then shuts down,
    /// all within `supervision.shutdown_timeout_s` (past it, the steps left are skipped and the
    /// report says so). A restart with the same config resumes from there.
    pub fn stop_gracefully(self) -> BoxFuture<'static, graceful_stop::StopReport> {
        Box::pin(async move {
            let started = Instant::now();
            let mut report =
                graceful_stop::drain_and_checkpoint(&self.handles, self.shutdown_timeout).await;
            report.final_replay = self.shutdown().await.map(|r| r.store);
            report.seconds = started.elapsed().as_secs_f64();
            report
        })
    }

    /// Stops everything, the stages in reverse order and upstream first inside each, so
    /// nothing new is produced: the servers, then trainer and sampler, then controller, engine,
    /// env workers and the replay store (which commits what is queued). Returns the replay
    /// store's final state, as it is on disk.
    pub fn shutdown(mut self) -> BoxFuture<'static, Option<ReplayStatus>> {
        Box::pin(async move { self.started.stop().await })
    }
}
