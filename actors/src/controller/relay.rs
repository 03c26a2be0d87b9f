//! What the controller hears back and passes on: replay store notices (stored, resumed,
//! dropped and cleared groups, and the store's counts) and published weights, relayed to the
//! engine with the effective update mode and to the replay store.

use sluice_core::metrics as m;
use sluice_core::{WeightSnapshot, WeightUpdateMode};

use super::ControllerState;
use crate::replay::{ReplayCounts, ReplayNotice};

impl ControllerState {
    pub(super) fn on_replay(&mut self, notice: ReplayNotice) {
        match notice {
            ReplayNotice::Stored { id, bucket, counts } => {
                self.storing.remove(&id);
                self.scheduler.settled(id);
                self.set_counts(counts);
                let summary = self.ending.remove(&id);
                if let Some(why) = self.progress.stored(bucket, summary.as_ref()) {
                    tracing::error!(reason = %why, "the run makes no progress; it stops");
                    self.status.no_progress.get_or_insert(why);
                    self.events.announce();
                }
            }
            ReplayNotice::Resumed {
                lane,
                asked,
                groups,
                dropped,
                counts,
            } => {
                let request = self.resume_requests.pop_front();
                debug_assert_eq!(request, Some((lane, asked)), "answers come in order");
                self.set_counts(counts);
                for id in dropped {
                    self.forget(id);
                }
                for group in groups {
                    self.scheduler.resumed(group.id, lane);
                    self.start(group);
                }
            }
            ReplayNotice::Cleared { ids, counts } => {
                for id in ids {
                    self.forget(id);
                    self.scheduler.settled(id);
                }
                self.set_counts(counts);
            }
            ReplayNotice::Counts(counts) => self.set_counts(counts),
        }
    }

    fn set_counts(&mut self, counts: ReplayCounts) {
        self.counts = counts;
        metrics::gauge!(m::ROLLOUT_TAIL_CANDIDATE_ROLLOUTS)
            .set((counts.waiting.tail * u64::from(self.config.group_size)) as f64);
    }

    /// Lets go of every per-rollout record of group `id`, which will never run again.
    fn forget(&mut self, id: sluice_core::GroupId) {
        for i in 0..self.config.group_size {
            let rollout = id.rollout(i);
            if let Some(p) = &self.peers {
                p.env.abandon(rollout);
            }
            self.assembly.forget(rollout);
        }
    }

    pub(super) fn on_published(&mut self, w: WeightSnapshot) {
        let Some(peers) = &self.peers else { return };
        if w.version <= self.version {
            return;
        }
        self.version = w.version;
        peers.replay.set_version(w.version);
        let knobs = self.knobs.current();
        // A tail round runs without aborts: its updates drain instead.
        let mode = if self.scheduler.tail_active() {
            WeightUpdateMode::Drain
        } else {
            knobs.weight_update_mode
        };
        if mode == WeightUpdateMode::Drain {
            self.draining = true;
        }
        peers.engine.update_weights(w, mode);
        self.counters.sent(1);
    }
}
