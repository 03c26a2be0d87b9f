//! What generates next (§4.1–4.3), as a pure state machine: the rollout controller feeds it
//! what it hears and carries out the [`Decision`] it returns.
//!
//! At every decision the [`RolloutScheduler`]:
//! 1. does nothing new while a `drain` weight update is pending, and admits nothing fresh while
//!    `paused` (groups already admitted still resume, so work a weight update interrupted
//!    finishes and trains);
//! 2. runs a tail round when enough tail candidates wait: only they are resumed (at most
//!    `remaining` in flight: no over-sending), nothing is admitted; the round ends when every
//!    candidate it resumed is stored;
//! 3. otherwise keeps `ceil((1 + s) · remaining)` groups in flight (capped by
//!    [`in_flight_cap`]), resuming aborted and then expired groups first and
//!    admitting fresh samples only while [`admission_allows`], with `admission = "demand"`
//!    [`demand_allows`], and, with a `replay.capacity`, while fewer groups than that are
//!    admitted and not yet trained (nothing is evicted at the bound: admission waits).
//!
//! One liveness rule goes beyond the trigger: when the trainer waits for a batch that nothing in
//! flight can fill, fresh admission is closed (by η, or by demand-aware admission, which counts
//! the waiting tail candidates as the work the trainer needs), and tail candidates are all that
//! is left, a tail round starts with fewer candidates than `tail_batch_trigger_size` (counted in
//! [`SchedulerStats::early_tail_rounds`]). Without it the batch would wait for a candidate that
//! can never come: admission stays closed until the trainer publishes, and the trainer publishes
//! only once the batch is full.
//!
//! The scheduler never sees a group's rollouts, and it keeps no list of waiting groups: the
//! replay store owns bucket membership and reports how many groups wait in each [`Lane`]
//! ([`Waiting`]); a decision asks for a number of groups from a lane and the store picks them,
//! oldest first. Which groups are in flight is the controller's business, reported here as a
//! number. The only ids the scheduler keeps are those of the running tail round's candidates.

use std::collections::HashSet;

use sluice_core::{AdmissionMode, GroupId, Knobs};

use crate::admission::{
    admission_allows, demand_allows, in_flight_cap, in_flight_target, remaining_for_step,
};
use crate::store::{Lane, Waiting};

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
    /// Groups generating, being resumed (requests on their way to the store included), or
    /// being stored.
    pub in_flight: u64,
    /// Groups waiting in the store to be resumed, less those already asked for.
    pub waiting: Waiting,
    /// Tail candidates asked for and not yet back from the store (part of the running round).
    pub tail_requested: u64,
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
    /// Groups to resume from the replay store: how many, and from which lane (a decision asks
    /// from one lane only: the tail lane during a tail round, the resume lane otherwise).
    pub resume: u64,
    /// The lane `resume` asks from.
    pub lane: Lane,
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
    /// Decisions in which `replay.capacity` held back a fresh admission.
    pub capacity_holds: u64,
}

/// The scheduling state: the tail round and what was decided.
#[derive(Debug, Clone)]
pub struct RolloutScheduler {
    group_size: u32,
    groups_per_step: u32,
    /// Candidates the running tail round resumed and the store has not stored yet.
    tail_round: HashSet<GroupId>,
    tail_active: bool,
    /// `replay.capacity`: most groups admitted and not yet trained.
    capacity: Option<u64>,
    stats: SchedulerStats,
}

impl RolloutScheduler {
    /// A scheduler for groups of `group_size` rollouts, `groups_per_step` groups a batch.
    pub fn new(group_size: u32, groups_per_step: u32) -> Self {
        Self {
            group_size: group_size.max(1),
            groups_per_step: groups_per_step.max(1),
            tail_round: HashSet::new(),
            tail_active: false,
            capacity: None,
            stats: SchedulerStats::default(),
        }
    }

    /// Holds fresh admission while `capacity` groups are admitted and not yet trained.
    pub fn with_capacity(mut self, capacity: Option<u64>) -> Self {
        self.capacity = capacity;
        self
    }

    fn at_capacity(&self, view: &SchedulerView, fresh: u64) -> bool {
        self.capacity
            .is_some_and(|c| self.pending(view) + fresh >= c)
    }

    /// The store sent back `id`, asked for from `lane`: a tail candidate belongs to the running
    /// round until it is stored.
    pub fn resumed(&mut self, id: GroupId, lane: Lane) {
        if lane == Lane::Tail {
            self.tail_round.insert(id);
        }
    }

    /// The store stored `id` (in any bucket), dropped it, or an operator cleared it: it is no
    /// longer part of a tail round.
    pub fn settled(&mut self, id: GroupId) {
        self.tail_round.remove(&id);
    }

    /// One scheduling decision.
    pub fn decide(&mut self, knobs: &Knobs, view: &SchedulerView) -> Decision {
        self.stats.decisions += 1;
        let mut decision = Decision::default();
        if view.draining {
            return decision;
        }
        let b = self.groups_per_step;
        // The store counts no tail candidates while k = 0 (the tail batch is off): they are
        // ordinary aborted groups again.
        let tail = view.waiting.tail;
        if !self.tail_active && tail > 0 {
            if tail >= u64::from(knobs.tail_batch_trigger_size) {
                self.start_tail_round(false, tail);
            } else if self.tail_is_all_that_is_left(knobs, view) {
                self.start_tail_round(true, tail);
            }
        }
        if self.tail_active && tail == 0 && view.tail_requested == 0 && self.tail_round.is_empty() {
            self.tail_active = false;
        }
        let remaining = remaining_for_step(b, view.completed);
        let cap = in_flight_cap(
            knobs.max_concurrent_rollouts,
            knobs.max_version_lag,
            b,
            self.group_size,
        );
        let mut active = view.in_flight;
        if self.tail_active {
            // A tail round serves only candidates, without over-sending (s = 0).
            decision.lane = Lane::Tail;
            decision.resume = remaining.min(cap).saturating_sub(active).min(tail);
            return decision;
        }
        let target = in_flight_target(knobs.staleness_threshold, remaining).min(cap);
        let mut resumable = view.waiting.resumable();
        while active < target {
            if resumable > 0 {
                resumable -= 1;
                decision.resume += 1;
            } else {
                if knobs.paused {
                    break;
                }
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
                if self.at_capacity(view, fresh) {
                    self.stats.capacity_holds += 1;
                    break;
                }
                if decision.admit >= view.samples_on_hand {
                    break;
                }
                decision.admit += 1;
            }
            active += 1;
        }
        // Keep a batch of samples ready beyond what the target needs now (none drawn while
        // paused).
        decision.samples_wanted =
            (!knobs.paused).then(|| (target as usize).max(b as usize) + b as usize);
        decision
    }

    /// The trainer waits, nothing in flight or waiting to resume can fill its batch, and fresh
    /// samples are kept out — by η, by demand-aware admission counting the tail candidates as
    /// the pending work the trainer needs, by the store's capacity, or by a pause: only tail
    /// candidates can move the run.
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
            && view.waiting.resumable() == 0
            && view.completed < u64::from(self.groups_per_step)
            && (knobs.paused || eta_holds || demand_holds || self.at_capacity(view, 0))
    }

    fn start_tail_round(&mut self, early: bool, size: u64) {
        self.tail_active = true;
        self.stats.tail_rounds += 1;
        if early {
            self.stats.early_tail_rounds += 1;
        } else {
            self.stats.tail_round_min_size = if self.stats.tail_round_min_size == 0 {
                size
            } else {
                self.stats.tail_round_min_size.min(size)
            };
        }
    }

    /// Groups admitted and not yet trained: ready in the store, in flight, or waiting to resume.
    pub fn pending(&self, view: &SchedulerView) -> u64 {
        view.completed + view.in_flight + view.waiting.total()
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
