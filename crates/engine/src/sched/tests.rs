//! The scheduler core against a fake backend: one token a step tagged with the installed
//! version, a plain cap on running sequences.

use std::collections::HashMap;
use std::time::Instant;

use proptest::prelude::*;
use sluice_core::{GroupId, NodeId, PolicyVersion, RequestId, RunId, WeightUpdateMode};

use super::{Command, Queued, Queues, Scheduler, Stepper, WeightUpdate};
use crate::backend::{EngineEvent, FinishReason};

struct Seq {
    id: RequestId,
    target: usize,
    versions: Vec<u64>,
}

impl Queued for Seq {
    fn request_id(&self) -> RequestId {
        self.id
    }
}

#[derive(Default)]
struct Fake {
    cap: usize,
    version: u64,
    steps: usize,
    finished: Vec<(RequestId, FinishReason, Vec<u64>)>,
    /// (version, mode, steps taken before the report)
    reports: Vec<(u64, WeightUpdateMode, usize)>,
}

impl Stepper for Fake {
    type Request = (RequestId, usize);
    type Seq = Seq;
    type Weights = u64;

    fn accept(&mut self, (id, target): (RequestId, usize)) -> Option<Seq> {
        Some(Seq {
            id,
            target,
            versions: Vec::new(),
        })
    }

    fn finish(&mut self, seq: Seq, finish: FinishReason) {
        self.finished.push((seq.id, finish, seq.versions));
    }

    fn install(&mut self, weights: u64, _mode: WeightUpdateMode) -> Option<PolicyVersion> {
        self.version = weights;
        Some(PolicyVersion(weights))
    }

    fn admit(&mut self, q: &mut Queues<Seq>) {
        while q.running.len() < self.cap {
            match q.waiting.pop_front() {
                Some(s) => q.running.push(s),
                None => break,
            }
        }
    }

    fn step(&mut self, q: &mut Queues<Seq>) {
        self.steps += 1;
        for s in &mut q.running {
            s.versions.push(self.version);
        }
        let (done, kept): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut q.running)
            .into_iter()
            .partition(|s| s.versions.len() >= s.target);
        q.running = kept;
        for s in done {
            self.finish(s, FinishReason::Stop);
        }
    }

    fn report(&mut self, event: EngineEvent) {
        if let EngineEvent::WeightsUpdated { version, mode, .. } = event {
            self.reports.push((version.0, mode, self.steps));
        }
    }

    fn publish(&mut self, _: &Queues<Seq>) {}
}

type Cmd = Command<(RequestId, usize), u64>;

fn id(n: u64) -> RequestId {
    GroupId {
        run: RunId(1),
        node: NodeId(0),
        counter: n,
    }
    .rollout(0)
    .request(0, 0)
}

fn update(version: u64, mode: WeightUpdateMode) -> Cmd {
    Command::Update(WeightUpdate {
        weights: version,
        mode,
        asked: Instant::now(),
    })
}

fn fake(cap: usize) -> (Scheduler<Seq, u64>, Fake) {
    (
        Scheduler::new(),
        Fake {
            cap,
            ..Fake::default()
        },
    )
}

fn versions_of(f: &Fake, n: u64) -> Vec<u64> {
    f.finished
        .iter()
        .find(|(i, ..)| *i == id(n))
        .unwrap()
        .2
        .clone()
}

#[test]
fn in_flight_keeps_running_sequences_and_reports_before_the_next_step() {
    let (mut s, mut f) = fake(4);
    s.iterate(&mut f, vec![Command::Submit((id(1), 4))]);
    s.iterate(&mut f, vec![update(1, WeightUpdateMode::InFlight)]);
    assert_eq!(f.reports, vec![(1, WeightUpdateMode::InFlight, 1)]);
    while !s.idle() {
        s.iterate(&mut f, vec![]);
    }
    assert_eq!(versions_of(&f, 1), vec![0, 1, 1, 1]);
    assert_eq!(f.finished[0].1, FinishReason::Stop);
}

#[test]
fn drain_stops_admission_and_swaps_once_nothing_runs() {
    let (mut s, mut f) = fake(4);
    s.iterate(&mut f, vec![Command::Submit((id(1), 3))]);
    s.iterate(
        &mut f,
        vec![
            update(1, WeightUpdateMode::Drain),
            Command::Submit((id(2), 1)),
        ],
    );
    // Request 2 waits; request 1 finishes on the old weights, then the swap, then request 2.
    while !s.idle() {
        s.iterate(&mut f, vec![]);
    }
    assert_eq!(versions_of(&f, 1), vec![0, 0, 0]);
    assert_eq!(versions_of(&f, 2), vec![1]);
    assert_eq!(f.reports, vec![(1, WeightUpdateMode::Drain, 3)]);
}

#[test]
fn a_newer_update_supersedes_a_held_drain() {
    let (mut s, mut f) = fake(4);
    s.iterate(&mut f, vec![Command::Submit((id(1), 3))]);
    s.iterate(&mut f, vec![update(1, WeightUpdateMode::Drain)]);
    s.iterate(&mut f, vec![update(2, WeightUpdateMode::InFlight)]);
    while !s.idle() {
        s.iterate(&mut f, vec![]);
    }
    // The old cores installed the held v1 drain once the batch emptied: back a version.
    assert_eq!(f.version, 2);
    assert_eq!(f.reports.len(), 1);
    assert_eq!(f.reports[0].0, 2);
}

#[test]
fn abort_resume_returns_partials_then_swaps_and_an_idle_engine_reports_at_once() {
    let (mut s, mut f) = fake(1);
    s.iterate(
        &mut f,
        vec![Command::Submit((id(1), 5)), Command::Submit((id(2), 5))],
    );
    s.iterate(&mut f, vec![update(1, WeightUpdateMode::AbortResume)]);
    let aborted: Vec<_> = f
        .finished
        .iter()
        .map(|(i, r, v)| (*i, r.clone(), v.len()))
        .collect();
    assert_eq!(
        aborted,
        vec![
            (id(1), FinishReason::Abort, 1),
            (id(2), FinishReason::Abort, 0)
        ]
    );
    assert_eq!(f.reports, vec![(1, WeightUpdateMode::AbortResume, 1)]);
    assert!(s.idle());
}

#[test]
fn pause_holds_everything_and_pause_with_abort_returns_the_partials() {
    let (mut s, mut f) = fake(2);
    s.iterate(&mut f, vec![Command::Submit((id(1), 3))]);
    s.iterate(
        &mut f,
        vec![
            Command::Pause { abort: false },
            Command::Submit((id(2), 1)),
            update(1, WeightUpdateMode::InFlight),
        ],
    );
    assert!(s.idle(), "a paused engine waits for a command");
    assert_eq!(f.steps, 1);
    assert!(f.finished.is_empty());
    // The swap made while paused is reported at once: no step is coming.
    assert_eq!(f.reports, vec![(1, WeightUpdateMode::InFlight, 1)]);
    s.iterate(&mut f, vec![Command::Continue]);
    while !s.idle() {
        s.iterate(&mut f, vec![]);
    }
    assert_eq!(versions_of(&f, 1), vec![0, 1, 1]);
    assert_eq!(versions_of(&f, 2), vec![1]);
    s.iterate(
        &mut f,
        vec![Command::Submit((id(3), 9)), Command::Submit((id(4), 9))],
    );
    s.iterate(&mut f, vec![Command::Pause { abort: true }]);
    let last: Vec<_> = f.finished[2..]
        .iter()
        .map(|(i, r, v)| (*i, r.clone(), v.len()))
        .collect();
    assert_eq!(
        last,
        vec![
            (id(3), FinishReason::Abort, 1),
            (id(4), FinishReason::Abort, 1)
        ]
    );
}

#[derive(Debug, Clone)]
enum Op {
    Submit(usize),
    Abort(u64),
    AbortAll,
    Update(WeightUpdateMode),
    Pause(bool),
    Continue,
}

fn op() -> impl Strategy<Value = Op> {
    let mode = prop_oneof![
        Just(WeightUpdateMode::AbortResume),
        Just(WeightUpdateMode::InFlight),
        Just(WeightUpdateMode::Drain),
    ];
    prop_oneof![
        4 => (1usize..6).prop_map(Op::Submit),
        1 => (0u64..24).prop_map(Op::Abort),
        1 => Just(Op::AbortAll),
        2 => mode.prop_map(Op::Update),
        1 => any::<bool>().prop_map(Op::Pause),
        1 => Just(Op::Continue),
    ]
}

proptest! {
    /// Random command batches between steps: every request is answered exactly once, a paused
    /// engine never steps, reported versions only rise and end at the last update, and with
    /// drain updates only no request spans two versions.
    #[test]
    fn every_request_is_answered_once(
        batches in prop::collection::vec(prop::collection::vec(op(), 0..4), 1..40),
        cap in 1usize..4,
    ) {
        let (mut s, mut f) = fake(cap);
        let mut submitted = 0u64;
        let mut version = 0u64;
        let mut paused = false;
        let mut drain_only = true;
        for batch in batches {
            let mut commands = Vec::new();
            for op in batch {
                commands.push(match op {
                    Op::Submit(target) => {
                        submitted += 1;
                        Command::Submit((id(submitted), target))
                    }
                    Op::Abort(n) => Command::Abort(id(n)),
                    Op::AbortAll => Command::AbortAll,
                    Op::Update(mode) => {
                        version += 1;
                        drain_only &= mode == WeightUpdateMode::Drain;
                        update(version, mode)
                    }
                    Op::Pause(abort) => {
                        paused = true;
                        Command::Pause { abort }
                    }
                    Op::Continue => {
                        paused = false;
                        Command::Continue
                    }
                });
            }
            let steps = f.steps;
            prop_assert!(s.iterate(&mut f, commands));
            if paused {
                prop_assert_eq!(f.steps, steps, "a paused engine stepped");
            }
        }
        s.iterate(&mut f, vec![Command::Continue]);
        for _ in 0..1000 {
            if s.idle() {
                break;
            }
            s.iterate(&mut f, vec![]);
        }
        prop_assert!(s.idle());
        let mut answers: HashMap<RequestId, usize> = HashMap::new();
        for (i, ..) in &f.finished {
            *answers.entry(*i).or_default() += 1;
        }
        prop_assert_eq!(answers.len() as u64, submitted);
        prop_assert!(answers.values().all(|&n| n == 1), "answered twice: {:?}", answers);
        prop_assert!(f.reports.windows(2).all(|w| w[0].0 <= w[1].0), "{:?}", f.reports);
        if version > 0 {
            prop_assert_eq!(f.reports.last().map(|r| r.0), Some(version));
            prop_assert_eq!(f.version, version);
        }
        if drain_only {
            for (i, _, v) in &f.finished {
                prop_assert!(v.windows(2).all(|w| w[0] == w[1]), "{} spans versions: {:?}", i, v);
            }
        }
    }
}
