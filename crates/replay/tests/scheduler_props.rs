//! Property tests of the scheduler against a small simulated pipeline: groups in flight finish,
//! abort, get filtered or expire in random order, the trainer takes a batch whenever one is ready
//! and publishes a version when its step ends, and the knobs change mid-run.
//!
//! The world keeps the waiting groups as the replay store does (aborted with their abort counts,
//! expired, oldest first by id) and answers the scheduler's lane requests at once.
//!
//! Invariants at every decision: the η bound holds for every admission, nothing fresh is admitted
//! while resumes wait or during a tail round, a tail round never over-sends, and in-flight work
//! never grows past the over-sending target. Liveness: once the random phase ends, a run that
//! only finishes what it starts always reaches more training steps — whatever the knobs left in
//! the tail queue.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use proptest::prelude::*;
use sluice_core::{AdmissionMode, GroupId, Knobs, NodeId, RunId, WeightUpdateMode};
use sluice_replay::{
    Lane, RolloutScheduler, SchedulerView, Waiting, admission_allows, in_flight_cap,
    in_flight_target, remaining_for_step,
};

#[derive(Debug, Clone)]
enum Op {
    Finish(usize),
    Abort(usize),
    Filter(usize),
    Expire(usize),
    TrainerDone,
    Knobs(KnobChange),
    /// An operator clears the groups at rest (completed, aborted, expired).
    Clear,
}

#[derive(Debug, Clone)]
struct KnobChange {
    eta: u64,
    staleness: f64,
    candidate_steps: u32,
    trigger: u32,
    demand: bool,
}

fn knob_change() -> impl Strategy<Value = KnobChange> {
    (0u64..3, 0.0f64..1.5, 0u32..3, 1u32..5, any::<bool>()).prop_map(
        |(eta, staleness, candidate_steps, trigger, demand)| KnobChange {
            eta,
            staleness,
            candidate_steps,
            trigger,
            demand,
        },
    )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => any::<usize>().prop_map(Op::Finish),
        4 => any::<usize>().prop_map(Op::Abort),
        1 => any::<usize>().prop_map(Op::Filter),
        1 => any::<usize>().prop_map(Op::Expire),
        3 => Just(Op::TrainerDone),
        1 => knob_change().prop_map(Op::Knobs),
        1 => Just(Op::Clear),
    ]
}

fn knobs(c: &KnobChange, max_concurrent_rollouts: u32) -> Knobs {
    Knobs {
        staleness_threshold: c.staleness,
        max_version_lag: c.eta,
        admission: if c.demand {
            AdmissionMode::Demand
        } else {
            AdmissionMode::Eta
        },
        enable_partial_rollout: true,
        tail_batch_candidate_steps: c.candidate_steps,
        tail_batch_trigger_size: c.trigger,
        weight_update_mode: WeightUpdateMode::AbortResume,
        domain_mix: BTreeMap::new(),
        max_concurrent_rollouts,
        paused: false,
    }
}

/// The pipeline around the scheduler, reduced to ids and counts.
struct World {
    b: u32,
    group_size: u32,
    knobs: Knobs,
    scheduler: RolloutScheduler,
    version: u64,
    /// In flight, with the largest abort count of the group's rollouts.
    in_flight: Vec<(GroupId, u32)>,
    completed: Vec<GroupId>,
    /// Aborted, with the largest abort count of their rollouts, waiting to be resumed.
    aborted: BTreeMap<GroupId, u32>,
    /// Expired, waiting to be regenerated.
    expired: BTreeSet<GroupId>,
    /// Cleared by an operator: never resumed again.
    cleared: HashSet<GroupId>,
    admitted_total: u64,
    released_total: u64,
    next_id: u64,
    trainer_busy: bool,
    steps: u64,
    /// `replay.capacity`, at least `b` (the config refuses less).
    capacity: Option<u64>,
}

impl World {
    fn new(b: u32, group_size: u32, knobs: Knobs, capacity: Option<u64>) -> Self {
        Self {
            b,
            group_size,
            scheduler: RolloutScheduler::new(group_size, b).with_capacity(capacity),
            capacity,
            knobs,
            version: 0,
            in_flight: Vec::new(),
            completed: Vec::new(),
            aborted: BTreeMap::new(),
            expired: BTreeSet::new(),
            cleared: HashSet::new(),
            admitted_total: 0,
            released_total: 0,
            next_id: 0,
            trainer_busy: false,
            steps: 0,
        }
    }

    fn take_in_flight(&mut self, pick: usize) -> Option<(GroupId, u32)> {
        if self.in_flight.is_empty() {
            return None;
        }
        let i = pick % self.in_flight.len();
        Some(self.in_flight.swap_remove(i))
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Finish(pick) => {
                if let Some((id, _)) = self.take_in_flight(*pick) {
                    self.completed.push(id);
                    self.scheduler.settled(id);
                }
            }
            Op::Abort(pick) => {
                if let Some((id, aborts)) = self.take_in_flight(*pick) {
                    self.aborted.insert(id, aborts + 1);
                    self.scheduler.settled(id);
                }
            }
            Op::Filter(pick) => {
                if let Some((id, _)) = self.take_in_flight(*pick) {
                    self.released_total += 1;
                    self.scheduler.settled(id);
                }
            }
            Op::Expire(pick) => {
                if !self.completed.is_empty() {
                    let id = self.completed.remove(pick % self.completed.len());
                    self.expired.insert(id);
                }
            }
            Op::TrainerDone => {
                if self.trainer_busy {
                    self.trainer_busy = false;
                    self.version += 1;
                    self.steps += 1;
                }
            }
            Op::Knobs(c) => self.knobs = knobs(c, self.knobs.max_concurrent_rollouts),
            Op::Clear => {
                let aborted = std::mem::take(&mut self.aborted).into_keys();
                let expired = std::mem::take(&mut self.expired);
                let at_rest: Vec<GroupId> = self
                    .completed
                    .drain(..)
                    .chain(aborted)
                    .chain(expired)
                    .collect();
                for id in at_rest {
                    self.scheduler.settled(id);
                    self.released_total += 1;
                    self.cleared.insert(id);
                }
            }
        }
        if !self.trainer_busy && self.completed.len() >= self.b as usize {
            self.completed.drain(..self.b as usize);
            self.trainer_busy = true;
        }
        self.decide();
    }

    fn is_tail(&self, aborts: u32) -> bool {
        let k = self.knobs.tail_batch_candidate_steps;
        k > 0 && aborts > k
    }

    /// What the store would count.
    fn waiting(&self) -> Waiting {
        let tail = self.aborted.values().filter(|a| self.is_tail(**a)).count() as u64;
        Waiting {
            aborted: self.aborted.len() as u64 - tail,
            expired: self.expired.len() as u64,
            tail,
        }
    }

    /// What the store answers a request for `n` groups from `lane`: oldest first, aborted
    /// before expired in the resume lane.
    fn take_lane(&mut self, lane: Lane, n: u64) -> Vec<(GroupId, u32)> {
        let aborted: Vec<(GroupId, u32)> = self
            .aborted
            .iter()
            .filter(|(_, a)| self.is_tail(**a) == (lane == Lane::Tail))
            .map(|(id, a)| (*id, *a))
            .collect();
        let expired = self.expired.iter().map(|id| (*id, 0));
        let picked: Vec<(GroupId, u32)> = match lane {
            Lane::Tail => aborted.into_iter().take(n as usize).collect(),
            Lane::Resume => aborted
                .into_iter()
                .chain(expired)
                .take(n as usize)
                .collect(),
        };
        for (id, _) in &picked {
            self.aborted.remove(id);
            self.expired.remove(id);
        }
        picked
    }

    fn view(&self) -> SchedulerView {
        SchedulerView {
            version: self.version,
            completed: self.completed.len() as u64,
            admitted_total: self.admitted_total,
            released_total: self.released_total,
            in_flight: self.in_flight.len() as u64,
            waiting: self.waiting(),
            tail_requested: 0,
            draining: false,
            samples_on_hand: usize::MAX,
            demand: u64::from(self.b) * 2,
            trainer_waiting: !self.trainer_busy,
        }
    }

    fn decide(&mut self) {
        let view = self.view();
        let d = self.scheduler.decide(&self.knobs, &view);
        let remaining = remaining_for_step(self.b, view.completed);
        let cap = in_flight_cap(
            self.knobs.max_concurrent_rollouts,
            self.knobs.max_version_lag,
            self.b,
            self.group_size,
        );
        let after = view.in_flight + d.resume + d.admit as u64;
        if self.scheduler.tail_active() {
            assert_eq!(d.admit, 0, "fresh admission during a tail round");
            assert!(
                d.resume == 0 || d.lane == Lane::Tail,
                "a tail round resumed others"
            );
            if d.resume > 0 {
                assert!(after <= remaining.min(cap), "a tail round over-sent");
            }
        } else {
            let target = in_flight_target(self.knobs.staleness_threshold, remaining).min(cap);
            assert!(
                after <= view.in_flight.max(target),
                "in flight {after} past the target {target}"
            );
        }
        if d.admit > 0 {
            assert_eq!(
                view.waiting.resumable(),
                d.resume,
                "fresh samples admitted while resumes wait"
            );
        }
        let asked = match d.lane {
            Lane::Tail => view.waiting.tail,
            Lane::Resume => view.waiting.resumable(),
        };
        assert!(
            d.resume <= asked,
            "asked for {} of {asked} waiting",
            d.resume
        );
        for (id, aborts) in self.take_lane(d.lane, d.resume) {
            assert!(!self.cleared.contains(&id), "cleared group {id} resumed");
            self.scheduler.resumed(id, d.lane);
            self.in_flight.push((id, aborts));
        }
        let held =
            self.in_flight.len() + self.completed.len() + self.aborted.len() + self.expired.len();
        if let Some(c) = self.capacity {
            assert!(
                d.admit == 0 || held as u64 + d.admit as u64 <= c,
                "admitted past the capacity {c}: {held} held, {} fresh",
                d.admit
            );
        }
        for _ in 0..d.admit {
            let load = self.admitted_total - self.released_total;
            assert!(
                admission_allows(load, self.version, self.knobs.max_version_lag, self.b),
                "admitted past the η bound: load {load}, version {}, η {}",
                self.version,
                self.knobs.max_version_lag
            );
            let id = GroupId {
                run: RunId::from_name("sched"),
                node: NodeId(0),
                counter: self.next_id,
            };
            self.next_id += 1;
            self.admitted_total += 1;
            self.in_flight.push((id, 0));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn scheduler_keeps_its_rules_and_the_run_moving(
        b in 1u32..5,
        group_size in 1u32..4,
        concurrency in 0u32..16,
        extra_capacity in proptest::option::of(0u64..6),
        first in knob_change(),
        ops in proptest::collection::vec(op(), 0..120),
        last in knob_change(),
    ) {
        let capacity = extra_capacity.map(|extra| u64::from(b) + extra);
        let mut w = World::new(b, group_size, knobs(&first, concurrency * group_size), capacity);
        w.decide();
        for op in &ops {
            w.apply(op);
        }
        // From here on every rollout that starts finishes: the run must keep training, whatever
        // the random phase left in the aborted, expired and tail queues.
        w.apply(&Op::Knobs(last));
        let steps = w.steps;
        for i in 0..2_000 {
            if w.steps >= steps + 3 {
                break;
            }
            let op = if w.in_flight.is_empty() { Op::TrainerDone } else { Op::Finish(i) };
            w.apply(&op);
        }
        prop_assert!(
            w.steps >= steps + 3,
            "stalled: version {}, completed {}, in flight {}, aborted {}, expired {}, tail {}, \
             tail round {}, trainer busy {}",
            w.version,
            w.completed.len(),
            w.in_flight.len(),
            w.waiting().aborted,
            w.waiting().expired,
            w.waiting().tail,
            w.scheduler.tail_active(),
            w.trainer_busy,
        );
    }
}

/// The stall the actor-level invariants test found: a tail candidate below the trigger, η
/// lowered to 0, the batch one group short, nothing in flight. The tail round starts early.
#[test]
fn a_waiting_trainer_gets_its_last_group_from_the_tail_queue() {
    let c = KnobChange {
        eta: 0,
        staleness: 0.0,
        candidate_steps: 1,
        trigger: 3,
        demand: false,
    };
    let mut w = World::new(4, 1, knobs(&c, 8), None);
    w.decide();
    assert_eq!(w.in_flight.len(), 4);
    // One group aborts twice (a tail candidate, one short of the trigger); the others finish.
    w.apply(&Op::Abort(0));
    assert_eq!(w.waiting().aborted, 0, "the resume was sent at once");
    let tail_group = w.in_flight.iter().position(|(_, a)| *a == 1).unwrap();
    w.apply(&Op::Abort(tail_group));
    assert_eq!(w.waiting().tail, 1);
    while !w.in_flight.is_empty() {
        w.apply(&Op::Finish(0));
    }
    // The early round resumed the candidate: the batch fills and the trainer steps.
    assert_eq!(w.scheduler.stats().early_tail_rounds, 1);
    assert_eq!(w.steps, 0);
    assert!(w.trainer_busy);
    w.apply(&Op::TrainerDone);
    assert_eq!(w.steps, 1);
    assert_eq!(
        w.scheduler.stats().tail_round_min_size,
        0,
        "early rounds are not trigger rounds"
    );
}

/// With `max_concurrent_rollouts = 0` the in-flight cap is admission's bound at the live η: a
/// run started at η = 0 and raised to η = 4 keeps more groups in flight, where a cap resolved
/// once at the start kept it at one batch.
#[test]
fn no_concurrency_cap_follows_eta_as_it_changes() {
    let c = KnobChange {
        eta: 0,
        staleness: 4.0,
        candidate_steps: 0,
        trigger: 1,
        demand: false,
    };
    let mut w = World::new(2, 2, knobs(&c, 0), None);
    w.decide();
    assert_eq!(w.in_flight.len(), 2, "η = 0: one batch");
    w.apply(&Op::Knobs(KnobChange { eta: 4, ..c }));
    assert_eq!(w.in_flight.len(), 10, "η = 4: (η + 1) · B groups");
    // An explicit cap still holds: 6 rollouts are 3 groups of 2.
    let mut capped = World::new(2, 2, knobs(&KnobChange { eta: 4, ..c }, 6), None);
    capped.decide();
    assert_eq!(capped.in_flight.len(), 3);
}
