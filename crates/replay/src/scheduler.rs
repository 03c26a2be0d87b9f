//! What generates next (§4.1–4.3), as a pure state machine: the rollout controller feeds it
//! what it hears and carries out the [`Decision`] it returns.
//!
//! At every decision the [`RolloutScheduler`]:
//! 1. does nothing new while `paused` or while a `drain` weight update is pending;
//! 2. runs a tail round when enough tail candidates wait: only they are resumed (at most
//!    `remaining` in flight: no over-sending), nothing is admitted; the round ends when every
//!    candidate it resumed is stored;
//! 3. otherwise keeps `ceil((1 + s) · remaining)` groups in flight (capped by
//!    `max_concurrent_rollouts / group_size`), resuming aborted and then expired groups first and
//!    admitting fresh samples only while [`admission_allows`] and, with `admission = "demand"`,
//!    [`demand_allows`].
//!
//! One liveness rule goes beyond the trigger: when the trainer waits for a batch that nothing in
//! flight can fill, fresh admission is closed (by η, or by demand-aware admission, which counts
//! the waiting tail candidates as the work the trainer needs), and tail candidates are all that
//! is left, a tail round starts with fewer candidates than `tail_batch_trigger_size` (counted in
//! [`SchedulerStats::early_tail_rounds`]). Without it the batch would wait for a candidate that
//! can never come: admission stays closed until the trainer publishes, and the trainer publishes
//! only once the batch is full.
//!
//! The scheduler never sees a group's rollouts, only ids and counts; which groups are in flight
//! is the controller's business, reported here as a number.

use std::collections::{HashMap, HashSet, VecDeque};

use sluice_core::{AdmissionMode, GroupId, Knobs};

use crate::Bucket;
use crate::admission::{admission_allows, demand_allows, in_flight_target, remaining_for_step};

/// What the controller knows at a decision, beyond the scheduler's own queues.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SchedulerView {
    /// Newest published policy version.
    pub version: u64,
    /// Groups waiting in `Completed`.
    pub completed: u64,
    /// Groups ever admitted.
    pub admitted_total: u64,
    /// Groups given back to admission (filtered, failed, expired-and-dropped).
    pub released_total: u64,
    /// Groups generating, being resumed, or being stored.
    pub in_flight: u64,
    /// A `drain` weight update is pending.
    pub draining: bool,
    /// Fresh samples on hand.
    pub samples_on_hand: usize,
    /// Groups demand-aware admission wants between admission and training
    /// ([`crate::Pace::demand`]).
    pub demand: u64,
    /// The trainer waits for a batch the store cannot fill yet.
    pub trainer_waiting: bool,
}

/// What to do now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    /// Groups to resume from the replay store, in this order.
    pub resumes: Vec<GroupId>,
    /// Fresh samples to admit (taken from the front of those on hand).
    pub admit: usize,
    /// Samples worth having on hand: ask the sampler for the difference when none are on order.
    /// `None` during a tail round or a pause, when nothing fresh is admitted.
    pub samples_wanted: Option<usize>,
}

/// Counters of what the scheduler decided, for the controller's status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Decisions taken.
    pub decisions: u64,
    /// Tail rounds started (early ones included).
    pub tail_rounds: u64,
    /// Smallest number of candidates a tail round started with at its trigger (0 before the
    /// first); early rounds do not count here.
    pub tail_round_min_size: u64,
    /// Tail rounds started below the trigger size because nothing else could fill the batch the
    /// trainer waits for (see the module docs).
    pub early_tail_rounds: u64,
    /// Decisions in which demand held back a fresh admission that η allowed.
    pub demand_holds: u64,
}

/// The scheduling state: groups waiting to be resumed, and the tail round.
#[derive(Debug, Clone)]
pub struct RolloutScheduler {
    group_size: u32,
    groups_per_step: u32,
    aborted: VecDeque<GroupId>,
    expired: VecDeque<GroupId>,
    tail: VecDeque<GroupId>,
    /// Candidates resumed by the running tail round and not yet stored.
    tail_round: HashSet<GroupId>,
    tail_active: bool,
    /// Largest abort count of each group on its way to the aborted bucket.
    abort_counts: HashMap<GroupId, u32>,
    stats: SchedulerStats,
}

impl RolloutScheduler {
    /// A scheduler for groups of `group_size` rollouts, `groups_per_step` groups a batch.
    pub fn new(group_size: u32, groups_per_step: u32) -> Self {
        Self {
            group_size: group_size.max(1),
            groups_per_step: groups_per_step.max(1),
            aborted: VecDeque::new(),
            expired: VecDeque::new(),
            tail: VecDeque::new(),
            tail_round: HashSet::new(),
            tail_active: false,
            abort_counts: HashMap::new(),
            stats: SchedulerStats::default(),
        }
    }

    /// Takes over the aborted (with their abort counts) and expired groups a restarted run
    /// recovered.
    pub fn recover(
        &mut self,
        aborted: impl IntoIterator<Item = (GroupId, u32)>,
        expired: impl IntoIterator<Item = GroupId>,
        knobs: &Knobs,
    ) {
        for (id, aborts) in aborted {
            self.abort_counts.insert(id, aborts);
            self.park(id, knobs);
        }
        self.expired.extend(expired);
    }

    /// Group `id` goes to the store as aborted; `max_aborts`, the largest abort count of its
    /// rollouts, decides whether it becomes a tail candidate once stored.
    pub fn group_aborted(&mut self, id: GroupId, max_aborts: u32) {
        self.abort_counts.insert(id, max_aborts);
    }

    /// The replay store durably stored `id` in `bucket`.
    pub fn stored(&mut self, id: GroupId, bucket: Bucket, knobs: &Knobs) {
        self.tail_round.remove(&id);
        if bucket == Bucket::Aborted {
            self.park(id, knobs);
        } else {
            self.abort_counts.remove(&id);
        }
    }

    /// The store dropped `id` instead of resuming it (too old, expired groups dropped).
    pub fn dropped(&mut self, id: GroupId) {
        self.tail_round.remove(&id);
        self.abort_counts.remove(&id);
    }

    /// An operator cleared `id` from the store: it is no longer resumable from any queue.
    pub fn cleared(&mut self, id: GroupId) {
        self.aborted.retain(|g| *g != id);
        self.expired.retain(|g| *g != id);
        self.tail.retain(|g| *g != id);
        self.dropped(id);
    }

    /// A completed group fell past η before it was trained: it waits to be regenerated.
    pub fn expired(&mut self, id: GroupId) {
        self.expired.push_back(id);
    }

    fn park(&mut self, id: GroupId, knobs: &Knobs) {
        let k = knobs.tail_batch_candidate_steps;
        let aborts = self.abort_counts.remove(&id).unwrap_or(0);
        if k > 0 && aborts > k {
            self.tail.push_back(id);
        } else {
            self.aborted.push_back(id);
        }
    }

    /// One scheduling decision.
    pub fn decide(&mut self, knobs: &Knobs, view: &SchedulerView) -> Decision {
        self.stats.decisions += 1;
        let mut decision = Decision::default();
        if knobs.paused || view.draining {
            return decision;
        }
        let b = self.groups_per_step;
        let k = knobs.tail_batch_candidate_steps;
        if k == 0 && !self.tail.is_empty() && !self.tail_active {
            // The tail batch was switched off: candidates are ordinary aborted groups again.
            self.aborted.extend(self.tail.drain(..));
        }
        if !self.tail_active && k > 0 && !self.tail.is_empty() {
            if self.tail.len() >= knobs.tail_batch_trigger_size as usize {
                self.start_tail_round(false);
            } else if self.tail_is_all_that_is_left(knobs, view) {
                self.start_tail_round(true);
            }
        }
        if self.tail_active && self.tail.is_empty() && self.tail_round.is_empty() {
            self.tail_active = false;
        }
        let remaining = remaining_for_step(b, view.completed);
        let cap = u64::from((knobs.max_concurrent_rollouts / self.group_size).max(1));
        let mut active = view.in_flight;
        if self.tail_active {
            // A tail round serves only candidates, without over-sending (s = 0).
            while active < remaining.min(cap) {
                let Some(id) = self.tail.pop_front() else {
                    break;
                };
                self.tail_round.insert(id);
                decision.resumes.push(id);
                active += 1;
            }
            return decision;
        }
        let target = in_flight_target(knobs.staleness_threshold, remaining).min(cap);
        while active < target {
            if let Some(id) = self
                .aborted
                .pop_front()
                .or_else(|| self.expired.pop_front())
            {
                decision.resumes.push(id);
            } else {
                let fresh = decision.admit as u64;
                let load = (view.admitted_total + fresh).saturating_sub(view.released_total);
                if !admission_allows(load, view.version, knobs.max_version_lag, b) {
                    break;
                }
                let pending = self.pending(view) + fresh;
                if knobs.admission == AdmissionMode::Demand && !demand_allows(pending, view.demand)
                {
                    self.stats.demand_holds += 1;
                    break;
                }
                if decision.admit >= view.samples_on_hand {
                    break;
                }
                decision.admit += 1;
            }
            active += 1;
        }
        // Keep a batch of samples ready beyond what the target needs now.
        decision.samples_wanted = Some((target as usize).max(b as usize) + b as usize);
        decision
    }

    /// The trainer waits, nothing in flight or waiting to resume can fill its batch, and fresh
    /// samples are kept out — by η, or by demand-aware admission counting the tail candidates
    /// as the pending work the trainer needs: only tail candidates can move the run.
    fn tail_is_all_that_is_left(&self, knobs: &Knobs, view: &SchedulerView) -> bool {
        let load = view.admitted_total.saturating_sub(view.released_total);
        let eta_holds = !admission_allows(
            load,
            view.version,
            knobs.max_version_lag,
            self.groups_per_step,
        );
        let demand_holds = knobs.admission == AdmissionMode::Demand
            && !demand_allows(self.pending(view), view.demand);
        view.trainer_waiting
            && view.in_flight == 0
            && self.aborted.is_empty()
            && self.expired.is_empty()
            && view.completed < u64::from(self.groups_per_step)
            && (eta_holds || demand_holds)
    }

    fn start_tail_round(&mut self, early: bool) {
        self.tail_active = true;
        self.stats.tail_rounds += 1;
        if early {
            self.stats.early_tail_rounds += 1;
        } else {
            let size = self.tail.len() as u64;
            self.stats.tail_round_min_size = if self.stats.tail_round_min_size == 0 {
                size
            } else {
                self.stats.tail_round_min_size.min(size)
            };
        }
    }

    /// Groups admitted and not yet trained: ready in the store, in flight, or waiting to resume.
    pub fn pending(&self, view: &SchedulerView) -> u64 {
        view.completed + view.in_flight + self.waiting()
    }

    /// Groups waiting to be resumed: aborted, expired and tail candidates.
    pub fn waiting(&self) -> u64 {
        (self.aborted.len() + self.expired.len() + self.tail.len()) as u64
    }

    /// Aborted groups waiting (not tail candidates).
    pub fn aborted_waiting(&self) -> u64 {
        self.aborted.len() as u64
    }

    /// Expired groups waiting for regeneration.
    pub fn expired_waiting(&self) -> u64 {
        self.expired.len() as u64
    }

    /// Tail candidates waiting for a round.
    pub fn tail_candidates(&self) -> u64 {
        self.tail.len() as u64
    }

    /// A tail round is running.
    pub fn tail_active(&self) -> bool {
        self.tail_active
    }

    /// What was decided so far.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }
}
