//! Admission, over-sending and the tail round: the scheduling decision taken after every
//! event (see the [`super`] module docs), and where aborted groups wait for their resume.

use std::sync::Arc;

use sluice_core::metrics as m;
use sluice_core::{AdmissionMode, DataSample, GroupId, RolloutGroup};
use sluice_replay::{admission_allows, demand_allows, in_flight_target, remaining_for_step};

use super::ControllerState;

impl ControllerState {
    pub(super) fn in_flight(&self) -> u64 {
        (self.work.len() + self.resuming.len() + self.storing.len()) as u64
    }

    /// Groups admitted and not yet trained: ready in the store, in flight, or waiting to resume.
    pub(super) fn pending(&self) -> u64 {
        self.counts.completed
            + self.in_flight()
            + (self.aborted.len() + self.expired.len() + self.tail.len()) as u64
    }

    /// One scheduling decision; see the module docs.
    pub(super) fn schedule(&mut self) {
        let Some(peers) = &self.peers else { return };
        let knobs = self.knobs.current();
        self.status.decisions += 1;
        let b = self.config.groups_per_step;
        let eta = knobs.max_version_lag;
        let mut resumes: Vec<GroupId> = Vec::new();
        let mut fresh: Vec<DataSample> = Vec::new();
        if !knobs.paused && !self.draining {
            self.tail_round.retain(|id| {
                self.work.contains_key(id)
                    || self.resuming.contains(id)
                    || self.storing.contains(id)
            });
            let k = knobs.tail_batch_candidate_steps;
            if k == 0 && !self.tail.is_empty() && !self.tail_active {
                // The tail batch was switched off: candidates are ordinary aborted groups again.
                self.aborted.extend(self.tail.drain(..));
            }
            if !self.tail_active
                && k > 0
                && self.tail.len() >= knobs.tail_batch_trigger_size as usize
            {
                self.tail_active = true;
                self.status.tail_rounds += 1;
                let size = self.tail.len() as u64;
                self.status.tail_round_min_size = if self.status.tail_rounds == 1 {
                    size
                } else {
                    self.status.tail_round_min_size.min(size)
                };
            }
            if self.tail_active && self.tail.is_empty() && self.tail_round.is_empty() {
                self.tail_active = false;
            }
            let remaining = remaining_for_step(b, self.counts.completed);
            let cap = u64::from((knobs.max_concurrent_rollouts / self.config.group_size).max(1));
            let mut active = self.in_flight();
            if self.tail_active {
                // A tail round serves only candidates, without over-sending (s = 0).
                while active < remaining.min(cap) {
                    let Some(id) = self.tail.pop_front() else {
                        break;
                    };
                    self.tail_round.insert(id);
                    resumes.push(id);
                    active += 1;
                }
            } else {
                let target = in_flight_target(knobs.staleness_threshold, remaining).min(cap);
                while active < target {
                    if let Some(id) = self
                        .aborted
                        .pop_front()
                        .or_else(|| self.expired.pop_front())
                    {
                        resumes.push(id);
                    } else {
                        let load =
                            self.admitted_total + fresh.len() as u64 - self.counts.released_total;
                        if !admission_allows(load, self.version.0, eta, b) {
                            break;
                        }
                        let pending = self.pending() + fresh.len() as u64;
                        if knobs.admission == AdmissionMode::Demand
                            && !demand_allows(pending, self.pace.demand(b))
                        {
                            self.status.demand_holds += 1;
                            break;
                        }
                        let Some(sample) = self.samples.pop_front() else {
                            break;
                        };
                        fresh.push(sample);
                    }
                    active += 1;
                }
                // Keep a batch of samples ready beyond what the target needs now.
                let want = (target as usize).max(b as usize) + b as usize;
                if self.samples_requested == 0 && self.samples.len() < want {
                    self.samples_requested = want - self.samples.len();
                    peers.sampler.request(self.samples_requested);
                    self.counters.sent(1);
                }
            }
        }
        for id in resumes {
            self.resuming.insert(id);
            peers
                .replay
                .resume(id, self.version, eta, knobs.enable_partial_rollout);
            self.counters.sent(1);
        }
        for sample in fresh {
            self.admit(sample);
        }
        let in_flight = self.in_flight();
        self.status.max_in_flight = self.status.max_in_flight.max(in_flight);
        metrics::gauge!(m::ROLLOUT_IN_FLIGHT_GROUPS).set(in_flight as f64);
    }

    pub(super) fn admit(&mut self, sample: DataSample) {
        let (Some(ids), Some(peers)) = (&self.ids, &self.peers) else {
            return;
        };
        let id = ids.next_id();
        // Rollouts start without turns: the env renders their first prompts (in `start`).
        let group = RolloutGroup::new(id, sample.clone(), self.config.group_size, self.version);
        peers.replay.admit(group.clone());
        self.counters.sent(1);
        self.admitted_total += 1;
        if self.tail_active {
            self.status.admitted_during_tail += 1;
        }
        metrics::counter!(m::ROLLOUT_ADMITTED_GROUPS).increment(1);
        self.start(group, Arc::new(sample));
    }

    pub(super) fn park_aborted(&mut self, id: GroupId) {
        let k = self.knobs.current().tail_batch_candidate_steps;
        let max_aborts = self.abort_counts.remove(&id).unwrap_or(0);
        if k > 0 && max_aborts > k {
            self.tail.push_back(id);
        } else {
            self.aborted.push_back(id);
        }
        metrics::gauge!(m::ROLLOUT_TAIL_CANDIDATE_ROLLOUTS)
            .set((self.tail.len() as u64 * u64::from(self.config.group_size)) as f64);
    }
}
