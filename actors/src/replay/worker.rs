//! The store's thread: applies every queued command to the [`ReplayStore`] state machine,
//! commits the resulting writes in one durable transaction, and only then sends the replies,
//! notices and batches.

use std::time::Instant;

use crossbeam_channel::Receiver;
use ractor::RpcReplyPort;
use sluice_core::metrics as m;
use sluice_core::{PolicyVersion, RolloutGroup};
use sluice_replay::{Bucket, ClearOutcome, Persister, ReplayStore, TakeOutcome};

use super::recover::counts;
use super::{Cmd, ReplayCounts, ReplayNotice, ReplayStatus};
use crate::Sink;
use crate::counters::ActorCounters;

/// The thread's state: the store, its persister, where notices go, and a take waiting for a full
/// batch.
pub(super) struct Worker {
    pub(super) store: ReplayStore,
    pub(super) persister: Option<Persister>,
    pub(super) notices: Sink<ReplayNotice>,
    pub(super) pending_take: Option<(usize, PolicyVersion, u64, RpcReplyPort<Vec<RolloutGroup>>)>,
    /// Whether the controller last heard that the trainer waits ([`ReplayCounts::trainer_waiting`]).
    pub(super) told_waiting: bool,
    pub(super) counters: ActorCounters,
}

enum Out {
    Notice(ReplayNotice),
    Batch(RpcReplyPort<Vec<RolloutGroup>>, Vec<RolloutGroup>),
    Status(RpcReplyPort<ReplayStatus>),
    Cleared(
        RpcReplyPort<Result<ClearOutcome, String>>,
        Result<ClearOutcome, String>,
    ),
}

impl Worker {
    pub(super) fn run(mut self, rx: Receiver<Cmd>) {
        while let Ok(first) = rx.recv() {
            let mut out = Vec::new();
            for cmd in std::iter::once(first).chain(rx.try_iter()) {
                self.apply(cmd, &mut out);
            }
            self.try_take(&mut out);
            self.mark_waiting(&mut out);
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
                    Out::Cleared(reply, outcome) => {
                        let _ = reply.send(outcome);
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
                lane,
                n,
                version,
                eta,
                partial,
            } => {
                // Answered even when it fails: the controller counts its requests by answers.
                let resumed = store.resume_from(lane, n as usize, version, eta, partial);
                let (got, result) = match resumed {
                    Ok(got) => (got, Ok(())),
                    Err(e) => (Default::default(), Err(e)),
                };
                out.push(Out::Notice(ReplayNotice::Resumed {
                    lane,
                    asked: n,
                    groups: got.groups,
                    dropped: got.dropped,
                    counts: counts(store),
                }));
                result
            }
            Cmd::SetTailSteps(k) => {
                if store.set_tail_steps(k) {
                    out.push(Out::Notice(ReplayNotice::Counts(counts(store))));
                }
                Ok(())
            }
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
            Cmd::Clear(buckets, reply) => {
                let outcome = store.clear(&buckets).map_err(|e| e.to_string());
                if let Ok(o) = &outcome {
                    out.push(Out::Notice(ReplayNotice::Cleared {
                        ids: o.ids.clone(),
                        counts: counts(store),
                    }));
                }
                // Replied after the commit, like every other answer.
                out.push(Out::Cleared(reply, outcome));
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
        match outcome {
            TakeOutcome::Batch(groups) => {
                out.push(Out::Batch(reply, groups));
                out.push(Out::Notice(ReplayNotice::Counts(counts(&self.store))));
            }
            TakeOutcome::NotEnough { .. } => {
                if any_expired {
                    // Groups left `Completed` (to wait for regeneration, or, when expired groups
                    // are dropped, given back to admission): without these counts the controller
                    // would wait for a batch that is gone, with admission closed by groups no
                    // longer there, and never regenerate the expired ones.
                    out.push(Out::Notice(ReplayNotice::Counts(counts(&self.store))));
                }
                self.pending_take = Some((n, version, eta, reply));
            }
        }
    }

    /// Stamps whether the trainer still waits on every count going out, and tells the controller
    /// when that changed with nothing else to carry it: its scheduler starts a tail round early
    /// only for a waiting trainer.
    fn mark_waiting(&mut self, out: &mut Vec<Out>) {
        let waiting = self.pending_take.is_some();
        let mut carried = false;
        for o in out.iter_mut() {
            if let Out::Notice(
                ReplayNotice::Stored { counts, .. }
                | ReplayNotice::Resumed { counts, .. }
                | ReplayNotice::Cleared { counts, .. }
                | ReplayNotice::Counts(counts),
            ) = o
            {
                counts.trainer_waiting = waiting;
                carried = true;
            }
        }
        if waiting != self.told_waiting && !carried {
            out.push(Out::Notice(ReplayNotice::Counts(ReplayCounts {
                trainer_waiting: waiting,
                ..counts(&self.store)
            })));
        }
        self.told_waiting = waiting;
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
        for (t, n) in &self.store.counters().transitions {
            metrics::counter!(m::REPLAY_TRANSITIONS, "from" => t.from.as_label(), "to" => t.to.as_label())
                .absolute(*n);
        }
    }
}
