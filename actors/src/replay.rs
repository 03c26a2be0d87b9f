//! The ReplayStore actor: the [`sluice_replay::ReplayStore`] state machine, run on a dedicated
//! thread that applies every queued command, commits the resulting writes to redb in one durable
//! transaction, and only then replies. So a group is on disk before anyone hears about it, and a
//! batch is marked consumed on disk before the trainer receives it.
//!
//! The actor is the mailbox and the owner of the thread; the handle hides both. Notices about
//! stored, resumed, expired and consumed groups go to the controller through a [`Sink`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;
use sluice_core::metrics as m;
use sluice_core::{GroupId, PolicyVersion, RolloutGroup};
use sluice_replay::{Bucket, Counters, Persister, ReplayStore, StoreSnapshot, TakeOutcome};

use crate::telemetry::ActorCounters;
use crate::{ActorError, Sink};

/// Replay counts the controller schedules with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReplayCounts {
    /// Groups waiting in `Completed`.
    pub completed: u64,
    /// Groups given back to admission (filtered, failed, expired-and-dropped).
    pub released_total: u64,
    /// Groups handed to the trainer.
    pub consumed_total: u64,
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
    /// A group asked for by [`ReplayHandle::resume`], ready to submit.
    Resumed(RolloutGroup),
    /// A group asked for by `resume` was too old and the policy drops expired groups.
    Dropped {
        /// The group.
        id: GroupId,
        /// Counts after the change.
        counts: ReplayCounts,
    },
    /// A completed group fell past η before it was trained; regenerate it with `resume`.
    Expired {
        /// The group.
        id: GroupId,
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
    /// Aborted groups to resume, oldest first, with each group's largest abort count.
    pub aborted: Vec<(GroupId, u32)>,
    /// Expired groups waiting to be regenerated.
    pub expired: Vec<GroupId>,
    /// Counts.
    pub counts: ReplayCounts,
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
        id: GroupId,
        version: PolicyVersion,
        eta: u64,
        partial: bool,
    },
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

    /// Asks for an aborted or expired group back; it comes as a `Resumed` (or `Dropped`) notice.
    pub fn resume(
        &self,
        id: GroupId,
        current: PolicyVersion,
        max_version_lag: u64,
        enable_partial_rollout: bool,
    ) {
        self.cast(Cmd::Resume {
            id,
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

    /// Stops the actor; its thread commits what is queued and exits.
    pub async fn stop(&self) {
        let _ = self.actor.stop_and_wait(None, None).await;
    }
}

fn open(options: ReplayOptions) -> Result<(ReplayStore, Option<Persister>), ActorError> {
    match &options.dir {
        Some(dir) => {
            let (persister, recovered) =
                Persister::open(dir).map_err(|e| ActorError::Setup(e.to_string()))?;
            let mut store = ReplayStore::recover(
                options.drop_expired,
                options.filter_zero_advantage,
                recovered.counters,
                recovered.groups,
            );
            persister
                .apply(&store.drain_outbox())
                .map_err(|e| ActorError::Setup(e.to_string()))?;
            Ok((store, Some(persister)))
        }
        None => Ok((
            ReplayStore::new(options.drop_expired, options.filter_zero_advantage),
            None,
        )),
    }
}

fn counts(store: &ReplayStore) -> ReplayCounts {
    let c = store.counters();
    ReplayCounts {
        completed: store.count(Bucket::Completed),
        released_total: c.released_total,
        consumed_total: c.consumed_total,
    }
}

fn recovery_of(store: &ReplayStore) -> Recovery {
    let c = store.counters();
    let max_aborts = |id: GroupId| {
        store.group(id).map_or(0, |g| {
            g.rollouts.iter().map(|r| r.abort_count).max().unwrap_or(0)
        })
    };
    // A token can carry a version the store never heard published (the process died between
    // the publish and its relay here); the run continues past it, never below.
    let newest_token = Bucket::ALL
        .iter()
        .filter(|b| !store.is_final(**b))
        .flat_map(|b| store.ids(*b))
        .filter_map(|id| store.group(id).and_then(RolloutGroup::max_version))
        .max()
        .unwrap_or_default();
    Recovery {
        admitted_total: c.admitted_total,
        next_group_counter: c.next_group_counter,
        policy_version: PolicyVersion(c.policy_version).max(newest_token),
        aborted: store
            .ids(Bucket::Aborted)
            .map(|id| (id, max_aborts(id)))
            .collect(),
        expired: if store.is_final(Bucket::Expired) {
            Vec::new()
        } else {
            store.ids(Bucket::Expired).collect()
        },
        counts: counts(store),
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
        if let Some(tx) = &state.tx
            && tx.send(cmd).is_err()
        {
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

struct Worker {
    store: ReplayStore,
    persister: Option<Persister>,
    notices: Sink<ReplayNotice>,
    pending_take: Option<(usize, PolicyVersion, u64, RpcReplyPort<Vec<RolloutGroup>>)>,
    counters: ActorCounters,
}

enum Out {
    Notice(ReplayNotice),
    Batch(RpcReplyPort<Vec<RolloutGroup>>, Vec<RolloutGroup>),
    Status(RpcReplyPort<ReplayStatus>),
}

impl Worker {
    fn run(mut self, rx: Receiver<Cmd>) {
        while let Ok(first) = rx.recv() {
            let mut out = Vec::new();
            for cmd in std::iter::once(first).chain(rx.try_iter()) {
                self.apply(cmd, &mut out);
            }
            self.try_take(&mut out);
            let ops = self.store.drain_outbox();
            if let Some(p) = &self.persister {
                let start = Instant::now();
                if let Err(e) = p.apply(&ops) {
                    // Nothing was acknowledged; stopping the node is the only safe answer.
                    tracing::error!(error = %e, "replay store cannot persist; stopping");
                    self.counters.error(e.kind());
                    return;
                }
                metrics::histogram!(m::REPLAY_PERSIST_SECONDS)
                    .record(start.elapsed().as_secs_f64());
            }
            self.export();
            for o in out {
                match o {
                    Out::Notice(n) => {
                        (self.notices)(n);
                        self.counters.sent(1);
                    }
                    Out::Batch(reply, groups) => {
                        // The trainer may have gone away after we checked; the groups are
                        // consumed on disk either way, so they are never trained twice.
                        match reply.send(groups) {
                            Ok(()) => self.counters.sent(1),
                            Err(_) => self.counters.dropped(1),
                        }
                    }
                    Out::Status(reply) => {
                        let _ = reply.send(self.status());
                    }
                }
            }
        }
    }

    fn apply(&mut self, cmd: Cmd, out: &mut Vec<Out>) {
        let store = &mut self.store;
        let result = match cmd {
            Cmd::Admit(g) => store.admit(g),
            Cmd::Finish(g, v, eta) => {
                let id = g.id;
                store.finish(g, v, eta).map(|o| {
                    out.push(Out::Notice(ReplayNotice::Stored {
                        id,
                        bucket: o.bucket,
                        counts: counts(store),
                    }));
                    if o.bucket == Bucket::Expired && !store.is_final(Bucket::Expired) {
                        out.push(Out::Notice(ReplayNotice::Expired { id }));
                    }
                })
            }
            Cmd::Abort(g) => {
                let id = g.id;
                store.abort(g).map(|()| {
                    out.push(Out::Notice(ReplayNotice::Stored {
                        id,
                        bucket: Bucket::Aborted,
                        counts: counts(store),
                    }));
                })
            }
            Cmd::Resume {
                id,
                version,
                eta,
                partial,
            } => store.resume(id, version, eta, partial).map(|g| {
                out.push(Out::Notice(match g {
                    Some(g) => ReplayNotice::Resumed(g),
                    None => ReplayNotice::Dropped {
                        id,
                        counts: counts(store),
                    },
                }))
            }),
            Cmd::Take {
                n,
                version,
                eta,
                reply,
            } => {
                self.pending_take = Some((n, version, eta, reply));
                Ok(())
            }
            Cmd::CancelTake => {
                self.pending_take = None;
                Ok(())
            }
            Cmd::ReleaseSkipped(groups) => {
                store.release_skipped(groups);
                out.push(Out::Notice(ReplayNotice::Counts(counts(store))));
                Ok(())
            }
            Cmd::SetVersion(v) => {
                store.set_policy_version(v);
                Ok(())
            }
            Cmd::Status(reply) => {
                out.push(Out::Status(reply));
                Ok(())
            }
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "replay store refused a command");
            self.counters.error(e.kind());
        }
    }

    fn try_take(&mut self, out: &mut Vec<Out>) {
        let Some((n, version, eta, reply)) = self.pending_take.take() else {
            return;
        };
        if reply.is_closed() {
            // The trainer stopped waiting: its take goes no further.
            self.counters.dropped(1);
            return;
        }
        let (outcome, expired) = self.store.take_batch(n, version, eta);
        let any_expired = !expired.is_empty();
        if !self.store.is_final(Bucket::Expired) {
            out.extend(
                expired
                    .into_iter()
                    .map(|id| Out::Notice(ReplayNotice::Expired { id })),
            );
        }
        match outcome {
            TakeOutcome::Batch(groups) => {
                out.push(Out::Batch(reply, groups));
                out.push(Out::Notice(ReplayNotice::Counts(counts(&self.store))));
            }
            TakeOutcome::NotEnough { .. } => {
                if any_expired {
                    // Groups left `Completed` (and, when expired groups are dropped, were given
                    // back to admission): without these counts the controller would wait for a
                    // batch that is gone, with admission closed by groups no longer there.
                    out.push(Out::Notice(ReplayNotice::Counts(counts(&self.store))));
                }
                self.pending_take = Some((n, version, eta, reply));
            }
        }
    }

    fn status(&self) -> ReplayStatus {
        let live_ids = Bucket::ALL
            .iter()
            .filter(|b| !self.store.is_final(**b))
            .map(|b| (*b, self.store.ids(*b).collect()))
            .collect();
        ReplayStatus {
            store: self.store.snapshot(),
            live_ids,
        }
    }

    fn export(&self) {
        for b in Bucket::ALL {
            metrics::gauge!(m::REPLAY_BUCKET_GROUPS, "bucket" => b.as_label())
                .set(self.store.count(b) as f64);
        }
        metrics::counter!(m::ENGINE_DISCARDED_TOKENS)
            .absolute(self.store.counters().discarded_tokens);
        for (key, n) in &self.store.counters().transitions {
            if let Some((from, to)) = key.split_once("->") {
                metrics::counter!(m::REPLAY_TRANSITIONS, "from" => from.to_owned(), "to" => to.to_owned()).absolute(*n);
            }
        }
    }
}
