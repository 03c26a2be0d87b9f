//! The ReplayStore actor: the [`sluice_replay::ReplayStore`] state machine, run on a dedicated
//! thread that applies every queued command, commits the resulting writes to redb in one durable
//! transaction, and only then replies. So a group is on disk before anyone hears about it, and a
//! batch is marked consumed on disk before the trainer receives it.
//!
//! The actor is the mailbox and the owner of the thread; the handle hides both. Notices about
//! stored, resumed, expired and consumed groups go to the controller through a [`Sink`].

mod recover;
mod worker;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::thread::JoinHandle;

use crossbeam_channel::{Sender, TrySendError};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;
use sluice_core::{GroupId, PolicyVersion, RolloutGroup};
use sluice_replay::{
    Bucket, ClearOutcome, Counters, Lane, Persister, ReplayStore, StoreSnapshot, Waiting,
};

use crate::counters::ActorCounters;
use crate::{ActorError, Sink};
use recover::{open, recovery_of};
use worker::Worker;

/// Replay counts the controller schedules with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReplayCounts {
    /// Groups waiting in `Completed`.
    pub completed: u64,
    /// Groups given back to admission (filtered, failed, expired-and-dropped).
    pub released_total: u64,
    /// Groups handed to the trainer.
    pub consumed_total: u64,
    /// Groups at rest waiting to be resumed, by lane (the store owns which ones they are).
    pub waiting: Waiting,
    /// The trainer waits for a batch the store cannot fill yet.
    pub trainer_waiting: bool,
}

/// What the replay store tells the controller.
#[derive(Debug, Clone)]
pub enum ReplayNotice {
    /// A finished or aborted group is durably stored in `bucket`.
    Stored {
        /// The group.
        id: GroupId,
        /// Where it went.
        bucket: Bucket,
        /// Counts after the change.
        counts: ReplayCounts,
    },
    /// The answer to one [`ReplayHandle::resume`]: the groups back in flight, ready to submit,
    /// and those too old to resume that the drop policy dropped. Every request gets exactly one
    /// answer, in the order asked, so the controller knows which requests are still on their way.
    Resumed {
        /// The lane asked from.
        lane: Lane,
        /// How many groups were asked for.
        asked: u64,
        /// Groups to submit, oldest first.
        groups: Vec<RolloutGroup>,
        /// Groups dropped instead.
        dropped: Vec<GroupId>,
        /// Counts after the change.
        counts: ReplayCounts,
    },
    /// An operator cleared these groups (completed, aborted or expired) from the store: none
    /// of them is trained or resumed.
    Cleared {
        /// The groups.
        ids: Vec<GroupId>,
        /// Counts after the change.
        counts: ReplayCounts,
    },
    /// Counts changed (a batch was consumed).
    Counts(ReplayCounts),
}

/// What a restarted run found in the database.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    /// Groups ever admitted.
    pub admitted_total: u64,
    /// The next group counter to mint.
    pub next_group_counter: u64,
    /// The last version the store saw published.
    pub policy_version: PolicyVersion,
    /// Counts (the aborted, expired and tail groups waiting among them).
    pub counts: ReplayCounts,
    /// Of the consumed groups, those of skipped steps (given back to admission).
    pub skipped_total: u64,
}

/// How the store is set up.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Database directory; `None` keeps everything in memory (benchmarks of the actor overhead).
    pub dir: Option<PathBuf>,
    /// Expired groups are dropped (else regenerated).
    pub drop_expired: bool,
    /// Zero-advantage groups go to `Filtered`.
    pub filter_zero_advantage: bool,
    /// `tail_batch_candidate_steps` at start (the controller keeps it current after).
    pub tail_batch_candidate_steps: u32,
}

/// A point-in-time view for `/v1/status`, metrics and tests.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayStatus {
    /// Buckets and counters.
    pub store: StoreSnapshot,
    /// Ids of the groups in each live bucket (tests compare them across restarts).
    #[serde(skip)]
    pub live_ids: BTreeMap<Bucket, Vec<GroupId>>,
}

enum Cmd {
    Admit(RolloutGroup),
    Finish(RolloutGroup, PolicyVersion, u64),
    Abort(RolloutGroup),
    Resume {
        lane: Lane,
        n: u64,
        version: PolicyVersion,
        eta: u64,
        partial: bool,
    },
    SetTailSteps(u32),
    Take {
        n: usize,
        version: PolicyVersion,
        eta: u64,
        reply: RpcReplyPort<Vec<RolloutGroup>>,
    },
    CancelTake,
    ReleaseSkipped(u64),
    SetVersion(PolicyVersion),
    Status(RpcReplyPort<ReplayStatus>),
    Clear(Vec<Bucket>, RpcReplyPort<Result<ClearOutcome, String>>),
}

/// The actor's messages (private: use [`ReplayHandle`]).
pub struct ReplayMsg(Cmd);

/// A batch asked for with [`ReplayHandle::begin_take`].
pub struct PendingTake {
    rx: Option<tokio::sync::oneshot::Receiver<Vec<RolloutGroup>>>,
    replay: ReplayHandle,
}

impl PendingTake {
    /// Waits for the batch; `None` if the store stopped (or the take was cancelled).
    pub async fn wait(&mut self) -> Option<Vec<RolloutGroup>> {
        let rx = self.rx.as_mut()?;
        let batch = rx.await.ok();
        self.rx = None;
        batch
    }

    /// Withdraws the request. The store applies commands in order, so after the cancel is
    /// through, the reply is either the batch it had already taken (consumed on disk: the caller
    /// must train it) or nothing. Returns that batch, if any.
    pub async fn cancel(mut self) -> Option<Vec<RolloutGroup>> {
        let rx = self.rx.take()?;
        self.replay.cast(Cmd::CancelTake);
        rx.await.ok()
    }
}

/// Typed handle; cloning is shallow.
#[derive(Clone)]
pub struct ReplayHandle {
    actor: ActorRef<ReplayMsg>,
}

impl ReplayHandle {
    /// The actor's cell (for linking it to a supervisor).
    pub fn cell(&self) -> ractor::ActorCell {
        self.actor.get_cell()
    }

    /// Opens the database (when `options.dir` is set), recovers its groups and starts the actor
    /// and its thread. Notices go to `notices`.
    pub async fn spawn(
        options: ReplayOptions,
        notices: Sink<ReplayNotice>,
    ) -> Result<(Self, Recovery, tokio::task::JoinHandle<()>), ActorError> {
        let opened = tokio::task::spawn_blocking(move || open(options))
            .await
            .map_err(|e| ActorError::Setup(format!("replay open task: {e}")))??;
        let (store, persister) = opened;
        let recovery = recovery_of(&store);
        let (actor, join) = Actor::spawn(None, ReplayActor, (store, persister, notices))
            .await
            .map_err(|e| ActorError::Spawn {
                actor: "replay",
                message: e.to_string(),
            })?;
        Ok((Self { actor }, recovery, join))
    }

    fn cast(&self, cmd: Cmd) {
        // A stopped store means the node is shutting down; the message has nowhere to go.
        let _ = self.actor.cast(ReplayMsg(cmd));
    }

    /// Records a newly admitted group (`Pending → InFlight`).
    pub fn admit(&self, group: RolloutGroup) {
        self.cast(Cmd::Admit(group));
    }

    /// Stores a group whose rollouts all ended; the bucket comes back as a `Stored` notice.
    pub fn finish(&self, group: RolloutGroup, current: PolicyVersion, max_version_lag: u64) {
        self.cast(Cmd::Finish(group, current, max_version_lag));
    }

    /// Stores an aborted group with its partials.
    pub fn abort(&self, group: RolloutGroup) {
        self.cast(Cmd::Abort(group));
    }

    /// Asks for `n` groups from `lane` back, oldest first; they come in one `Resumed` notice
    /// (with fewer groups when fewer wait).
    pub fn resume(
        &self,
        lane: Lane,
        n: u64,
        current: PolicyVersion,
        max_version_lag: u64,
        enable_partial_rollout: bool,
    ) {
        self.cast(Cmd::Resume {
            lane,
            n,
            version: current,
            eta: max_version_lag,
            partial: enable_partial_rollout,
        });
    }

    /// `groups` consumed by a training step that published nothing leave the admission load
    /// (see [`sluice_replay::Counters::skipped_total`]); the controller hears the new counts.
    pub fn release_skipped(&self, groups: u64) {
        self.cast(Cmd::ReleaseSkipped(groups));
    }

    /// Sets `tail_batch_candidate_steps`, which decides which aborted groups are tail
    /// candidates; the controller hears the new counts.
    pub fn set_tail_steps(&self, k: u32) {
        self.cast(Cmd::SetTailSteps(k));
    }

    /// Records a published version.
    pub fn set_version(&self, version: PolicyVersion) {
        self.cast(Cmd::SetVersion(version));
    }

    /// Waits until `n` eligible groups exist, takes the oldest (`Completed → Consumed`, on disk)
    /// and returns them. Returns `None` if the store stopped.
    pub async fn take_batch(
        &self,
        n: usize,
        current: PolicyVersion,
        max_version_lag: u64,
    ) -> Option<Vec<RolloutGroup>> {
        self.begin_take(n, current, max_version_lag).wait().await
    }

    /// Asks for a batch as [`Self::take_batch`] does, returning a ticket that can be waited on or
    /// cancelled without losing a batch the store already handed out.
    pub fn begin_take(
        &self,
        n: usize,
        current: PolicyVersion,
        max_version_lag: u64,
    ) -> PendingTake {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let reply: RpcReplyPort<Vec<RolloutGroup>> = tx.into();
        let sent = self
            .actor
            .cast(ReplayMsg(Cmd::Take {
                n,
                version: current,
                eta: max_version_lag,
                reply,
            }))
            .is_ok();
        PendingTake {
            rx: sent.then_some(rx),
            replay: self.clone(),
        }
    }

    /// Waits until everything sent before is applied and committed to disk; returns the counters
    /// as they are on disk.
    pub async fn flush(&self) -> Result<Counters, ActorError> {
        Ok(self.status().await?.store.counters)
    }

    /// Buckets, counters and live ids.
    pub async fn status(&self) -> Result<ReplayStatus, ActorError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(ReplayMsg(Cmd::Status(tx.into())))
            .map_err(|_| ActorError::Gone { actor: "replay" })?;
        rx.await.map_err(|_| ActorError::Gone { actor: "replay" })
    }

    /// Clears the groups at rest in `buckets` (see [`ReplayStore::clear`]), durably, and tells
    /// the controller with a [`ReplayNotice::Cleared`] so it resumes none of them. A refused
    /// clear (a bucket not at rest) comes back as the store's message.
    pub async fn clear(
        &self,
        buckets: Vec<Bucket>,
    ) -> Result<Result<ClearOutcome, String>, ActorError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(ReplayMsg(Cmd::Clear(buckets, tx.into())))
            .map_err(|_| ActorError::Gone { actor: "replay" })?;
        rx.await.map_err(|_| ActorError::Gone { actor: "replay" })
    }

    /// Stops the actor; its thread commits what is queued and exits.
    pub async fn stop(&self) {
        let _ = self.actor.stop_and_wait(None, None).await;
    }
}
struct ReplayActor;

/// The actor's state: the command channel into the thread, and the thread.
pub struct ReplayState {
    tx: Option<Sender<Cmd>>,
    thread: Option<JoinHandle<()>>,
    /// Shared with the thread, which sends notices and batches and counts store errors.
    counters: ActorCounters,
}

/// Commands are bounded by admission (a handful per group in flight); this bound is a backstop.
const QUEUE: usize = 1 << 16;

impl Actor for ReplayActor {
    type Msg = ReplayMsg;
    type State = ReplayState;
    type Arguments = (ReplayStore, Option<Persister>, Sink<ReplayNotice>);

    async fn pre_start(
        &self,
        _me: ActorRef<ReplayMsg>,
        (store, persister, notices): Self::Arguments,
    ) -> Result<ReplayState, ActorProcessingErr> {
        let (tx, rx) = crossbeam_channel::bounded(QUEUE);
        let counters = ActorCounters::new("replay");
        let worker = Worker {
            store,
            persister,
            notices,
            pending_take: None,
            told_waiting: false,
            counters: counters.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("replay-store".into())
            .spawn(move || worker.run(rx))?;
        Ok(ReplayState {
            tx: Some(tx),
            thread: Some(thread),
            counters,
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<ReplayMsg>,
        ReplayMsg(cmd): ReplayMsg,
        state: &mut ReplayState,
    ) -> Result<(), ActorProcessingErr> {
        state.counters.received(1);
        let Some(tx) = &state.tx else { return Ok(()) };
        let sent = match tx.try_send(cmd) {
            Ok(()) => true,
            Err(TrySendError::Full(cmd)) => {
                // Back-pressure: this actor's mailbox waits while the store thread catches up;
                // the async runtime's worker does not.
                let tx = tx.clone();
                matches!(
                    tokio::task::spawn_blocking(move || tx.send(cmd).is_ok()).await,
                    Ok(true)
                )
            }
            Err(TrySendError::Disconnected(_)) => false,
        };
        if !sent {
            state.counters.dropped(1);
            return Err("replay thread stopped".into());
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<ReplayMsg>,
        state: &mut ReplayState,
    ) -> Result<(), ActorProcessingErr> {
        // Closing the channel lets the thread commit what is queued and exit.
        state.tx = None;
        if let Some(t) = state.thread.take() {
            tokio::task::spawn_blocking(move || t.join()).await.ok();
        }
        Ok(())
    }
}
