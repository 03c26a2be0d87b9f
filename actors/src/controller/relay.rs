//! What the controller hears back and passes on: replay store notices (stored, resumed,
//! dropped, expired, cleared groups) and published weights, relayed to the engine with the effective
//! update mode and to the replay store.

use std::sync::Arc;

use sluice_core::{WeightSnapshot, WeightUpdateMode};

use super::ControllerState;
use crate::replay::ReplayNotice;

impl ControllerState {
    pub(super) fn on_replay(&mut self, notice: ReplayNotice) {
        match notice {
            ReplayNotice::Stored { id, bucket, counts } => {
                self.storing.remove(&id);
                self.counts = counts;
                let summary = self.ending.remove(&id);
                if let Some(why) = self.progress.stored(bucket, summary.as_ref()) {
                    tracing::error!(reason = %why, "the run makes no progress; it stops");
                    self.status.no_progress.get_or_insert(why);
                    self.events.announce();
                }
                self.stored(id, bucket);
            }
            ReplayNotice::Resumed(group) => {
                self.resuming.remove(&group.id);
                let sample = Arc::new(group.sample.clone());
                self.start(group, sample);
            }
            ReplayNotice::Dropped { id, counts } => {
                self.forget(id);
                self.scheduler.dropped(id);
                self.counts = counts;
            }
            ReplayNotice::Cleared { ids, counts } => {
                for id in ids {
                    self.forget(id);
                    self.scheduler.cleared(id);
                }
                self.counts = counts;
            }
            ReplayNotice::Expired { id } => self.scheduler.expired(id),
            ReplayNotice::Counts(counts) => self.counts = counts,
        }
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
        self.resuming.remove(&id);
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
