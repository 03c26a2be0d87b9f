//! Carrying out the scheduling decision taken after every event: the rules themselves live in
//! [`sluice_replay::RolloutScheduler`]; here the controller tells it what it knows and starts what it
//! decides.

use sluice_core::metrics as m;
use sluice_core::{DataSample, RolloutGroup};
use sluice_replay::{Lane, SchedulerView};

use super::ControllerState;

impl ControllerState {
    pub(super) fn in_flight(&self) -> u64 {
        (self.assembly.len() + self.storing.len()) as u64 + self.requested(None)
    }

    /// Groups asked for from `lane` (from any lane with `None`) and not yet back from the store.
    fn requested(&self, lane: Option<Lane>) -> u64 {
        self.resume_requests
            .iter()
            .filter(|(l, _)| lane.is_none_or(|lane| lane == *l))
            .map(|(_, n)| n)
            .sum()
    }

    /// Groups admitted since the run began, as η's bound counts them: rebased so that the
    /// steps before this start count as steps of this start's `groups_per_step`. The bound
    /// (`admitted < (v + η + 1) · groups_per_step`, DESIGN §4.1) counts every admission of the
    /// run against the current batch size: a run resumed with fewer groups a step found its
    /// history over the bound for good and admitted nothing again (the trainer then waited
    /// for ever), and one resumed with more admitted far ahead. Rebased, the bound holds what
    /// was trained before the start (at any batch size) as trained, and lets η batches more
    /// than that be in the pipeline; with the batch size unchanged the rebase is 0.
    fn admitted_at_this_batch_size(&self) -> u64 {
        let rebased = i128::from(self.admitted_total) - self.admitted_rebase;
        u64::try_from(rebased.max(0)).unwrap_or(u64::MAX)
    }

    fn view(&self) -> SchedulerView {
        // The counts are the store's as of its last notice, which came before it answered the
        // requests still on their way: those groups are no longer waiting.
        let waiting = self
            .resume_requests
            .iter()
            .fold(self.counts.waiting, |w, (lane, n)| w.less(*lane, *n));
        SchedulerView {
            version: self.version.0,
            completed: self.counts.completed,
            admitted_total: self.admitted_at_this_batch_size(),
            released_total: self.counts.released_total,
            in_flight: self.in_flight(),
            waiting,
            tail_requested: self.requested(Some(Lane::Tail)),
            draining: self.draining,
            samples_on_hand: self.samples.len(),
            demand: self.pace.demand(self.config.groups_per_step),
            trainer_waiting: self.counts.trainer_waiting,
        }
    }

    /// Groups admitted and not yet trained: ready in the store, in flight, or waiting to resume.
    pub(super) fn pending(&self) -> u64 {
        self.scheduler.pending(&self.view())
    }

    /// One scheduling decision; see [`sluice_replay::scheduler`].
    pub(super) fn schedule(&mut self) {
        if self.peers.is_none() {
            return;
        }
        let knobs = self.knobs.current();
        if self.tail_steps_sent != Some(knobs.tail_batch_candidate_steps)
            && let Some(peers) = &self.peers
        {
            // The store decides which aborted groups are tail candidates; it reclassifies them
            // and sends new counts, which the next decision uses.
            peers
                .replay
                .set_tail_steps(knobs.tail_batch_candidate_steps);
            self.tail_steps_sent = Some(knobs.tail_batch_candidate_steps);
        }
        let view = self.view();
        let decision = if self.closed {
            sluice_replay::Decision::default()
        } else {
            self.scheduler.decide(&knobs, &view)
        };
        let fresh: Vec<DataSample> = self.samples.drain(..decision.admit).collect();
        if let Some(want) = decision.samples_wanted
            && self.samples_requested == 0
            && self.samples.len() < want
            && let Some(peers) = &self.peers
        {
            self.samples_requested = want - self.samples.len();
            peers.sampler.request(self.samples_requested);
            self.counters.sent(1);
        }
        if decision.resume > 0
            && let Some(peers) = &self.peers
        {
            self.resume_requests
                .push_back((decision.lane, decision.resume));
            peers.replay.resume(
                decision.lane,
                decision.resume,
                self.version,
                knobs.max_version_lag,
                knobs.enable_partial_rollout,
            );
            self.counters.sent(1);
        }
        for sample in fresh {
            self.admit(sample);
        }
        let in_flight = self.in_flight();
        if in_flight == 0 && self.last_in_flight > 0 {
            // A graceful stop waits for exactly this (everything in flight stored).
            self.events.announce();
        }
        self.last_in_flight = in_flight;
        self.status.max_in_flight = self.status.max_in_flight.max(in_flight);
        metrics::gauge!(m::ROLLOUT_IN_FLIGHT_GROUPS).set(in_flight as f64);
    }

    pub(super) fn admit(&mut self, sample: DataSample) {
        let (Some(ids), Some(peers)) = (&self.ids, &self.peers) else {
            return;
        };
        let id = ids.next_id();
        // Rollouts start without turns: the env renders their first prompts (in `start`). The
        // store's copy shares the sample and has no tokens yet: it is written to disk and
        // dropped (the store keeps no data of a group in flight).
        let group = RolloutGroup::new(id, sample, self.config.group_size, self.version);
        peers.replay.admit(group.clone());
        self.counters.sent(1);
        self.admitted_total += 1;
        if self.scheduler.tail_active() {
            self.status.admitted_during_tail += 1;
        }
        metrics::counter!(m::ROLLOUT_ADMITTED_GROUPS).increment(1);
        self.start(group);
    }
}
