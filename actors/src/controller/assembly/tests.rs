//! Property tests of the group assembly: a driver plays engine and env over random
//! interleavings of their answers (stops, truncations, aborts with partial output, errors, env
//! continues and failures), parks aborted groups as the replay store would and resumes them in
//! random order, and replays stale answers. Checked at every action and at the end:
//! - no request id is ever sent twice, and a resume carries exactly the tokens the abort kept;
//! - a rollout served before goes back to the replica that served it;
//! - a group is stored only when nothing of it is outstanding, aborted iff a rollout was
//!   interrupted, finished exactly once, after being scored once when the env scores groups;
//! - stale answers change nothing; at the end every group is finished, and nothing is
//!   remembered about any rollout.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use sluice_core::{DataSample, GroupId, NodeId, PolicyVersion, RequestId, RunId};

use super::*;

/// Turns a rollout may have before the env ends its episode.
const MAX_TURNS: usize = 3;
/// Aborts a rollout may take before the engine stops aborting it (so the play ends).
const MAX_ABORTS: u32 = 3;

/// Something the assembly asked for and the driver has not answered yet.
#[derive(Debug, Clone)]
enum Pending {
    Engine {
        request: RequestId,
        /// Tokens the turn had when submitted (the resume).
        prefix: Vec<u32>,
    },
    Env {
        rollout: RolloutId,
        /// Turns of the rollout when asked (0: a start).
        turns: usize,
    },
    Score(RolloutGroup),
}

impl Pending {
    fn group(&self) -> GroupId {
        match self {
            Pending::Engine { request, .. } => request.rollout.group,
            Pending::Env { rollout, .. } => rollout.group,
            Pending::Score(g) => g.id,
        }
    }
}

/// One step of the script: what to do and which item it picks.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// Answer the `pick`-th outstanding item; `kind` chooses the answer.
    Answer { pick: usize, kind: u8 },
    /// Resume the `pick`-th parked (aborted) group.
    Resume { pick: usize },
    /// Replay an answer already given (must be ignored).
    Stale { pick: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<usize>(), any::<u8>()).prop_map(|(pick, kind)| Op::Answer { pick, kind }),
        2 => any::<usize>().prop_map(|pick| Op::Resume { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Stale { pick }),
    ]
}

struct Driver {
    asm: Assembly<u64>,
    scores_groups: bool,
    pending: Vec<Pending>,
    parked: Vec<RolloutGroup>,
    finished: HashMap<GroupId, RolloutGroup>,
    /// Every request id sent so far.
    sent: HashSet<RequestId>,
    /// Answers already given (to replay as stale ones).
    given: Vec<Completion>,
    /// The replica that last served each rollout, and the tokens its last abort kept.
    served: HashMap<RolloutId, u32>,
    kept: HashMap<RolloutId, Vec<u32>>,
    /// Groups sent to be scored and not yet stored.
    scored: HashSet<GroupId>,
    next_token: u32,
}

impl Driver {
    fn new(groups: u64, size: u32, scores_groups: bool) -> Self {
        let mut d = Self {
            asm: Assembly::default(),
            scores_groups,
            pending: Vec::new(),
            parked: Vec::new(),
            finished: HashMap::new(),
            sent: HashSet::new(),
            given: Vec::new(),
            served: HashMap::new(),
            kept: HashMap::new(),
            scored: HashSet::new(),
            next_token: 1,
        };
        d.asm.set_scores_groups(scores_groups);
        for counter in 0..groups {
            let id = GroupId {
                run: RunId::from_name("assembly"),
                node: NodeId(0),
                counter,
            };
            let sample = DataSample {
                id: counter.to_string(),
                domain: "math".into(),
                dataset: "arith".into(),
                input: serde_json::Value::Null,
                system_prompt: None,
            };
            let actions = d.asm.start(
                RolloutGroup::new(id, sample, size, PolicyVersion(0)),
                counter,
            );
            d.take(actions);
        }
        d
    }

    /// Checks and records the assembly's actions.
    fn take(&mut self, actions: Vec<Action<u64>>) {
        for a in actions {
            match a {
                Action::Generate {
                    request,
                    prompt,
                    resume,
                    replica,
                } => {
                    assert!(self.sent.insert(request), "request {request} sent twice");
                    assert!(!prompt.is_empty(), "a turn without a prompt");
                    assert_eq!(replica, self.served.get(&request.rollout).copied());
                    let prefix = resume.map(|r| r.token_ids).unwrap_or_default();
                    let kept = self.kept.remove(&request.rollout).unwrap_or_default();
                    assert_eq!(prefix, kept, "the resume carries what the abort kept");
                    self.pending.push(Pending::Engine { request, prefix });
                }
                Action::EnvStart(rollout) => self.pending.push(Pending::Env { rollout, turns: 0 }),
                Action::EnvStep { rollout, .. } => {
                    assert!(
                        rollout
                            .turns
                            .last()
                            .is_some_and(|t| t.completion_tokens() > 0)
                    );
                    self.pending.push(Pending::Env {
                        rollout: rollout.id,
                        turns: rollout.turns.len(),
                    });
                }
                Action::ScoreGroup(g) => {
                    assert!(
                        self.scores_groups,
                        "scored without an env that scores groups"
                    );
                    assert!(self.scored.insert(g.id), "scored twice in one trip");
                    self.pending.push(Pending::Score(g));
                }
                Action::Finished { group, meta } => self.stored(group, meta, false),
                Action::Aborted { group } => {
                    let counter = group.id.counter;
                    self.stored(group, counter, true);
                }
            }
        }
    }

    fn stored(&mut self, group: RolloutGroup, meta: u64, aborted: bool) {
        assert_eq!(
            meta, group.id.counter,
            "the caller's data comes back with its group"
        );
        assert!(
            self.pending.iter().all(|p| p.group() != group.id),
            "group {} stored with work outstanding",
            group.id
        );
        let interrupted = group
            .rollouts
            .iter()
            .any(|r| r.status == RolloutStatus::Aborted);
        assert_eq!(
            aborted, interrupted,
            "aborted iff a rollout was interrupted"
        );
        assert!(
            group
                .rollouts
                .iter()
                .all(|r| r.status != RolloutStatus::Ongoing),
            "a stored rollout still ongoing"
        );
        let was_scored = self.scored.remove(&group.id);
        if aborted {
            self.parked.push(group);
        } else {
            assert_eq!(
                was_scored, self.scores_groups,
                "scored once before it finished"
            );
            assert!(
                self.finished.insert(group.id, group).is_none(),
                "finished twice"
            );
        }
    }

    /// Answers the `pick`-th outstanding item; `calm` answers so the play ends (no abort, no
    /// further turn).
    fn answer(&mut self, pick: usize, kind: u8, calm: bool) {
        if self.pending.is_empty() {
            return;
        }
        let item = self.pending.swap_remove(pick % self.pending.len());
        let actions = match item {
            Pending::Engine { request, prefix } => {
                let c = self.completion(request, prefix, if calm { 0 } else { kind });
                self.given.push(c.clone());
                let replica = u32::from(kind % 3);
                if c.finish == FinishReason::Abort {
                    self.kept
                        .insert(request.rollout, c.output.token_ids.clone());
                }
                self.served.insert(request.rollout, replica);
                self.asm.on_completion(c, replica)
            }
            Pending::Env { rollout, turns } => {
                let reply = match if calm { 0 } else { kind % 4 } {
                    1 | 2 if turns < MAX_TURNS => EnvReply::Continue {
                        next_prompt: vec![9; turns + 1],
                    },
                    3 => EnvReply::Failed {
                        kind: "env_down".into(),
                    },
                    _ if turns == 0 => EnvReply::Continue {
                        next_prompt: vec![9],
                    },
                    _ => EnvReply::done(f64::from(kind % 2)),
                };
                self.asm.on_env(rollout, reply, Some(TurnNote::default()))
            }
            Pending::Score(mut g) => {
                for r in &mut g.rollouts {
                    r.reward = 0.5;
                }
                self.asm
                    .on_env(g.id.rollout(0), EnvReply::Scored(Box::new(g)), None)
            }
        };
        self.take(actions.expect("an outstanding item is never stale"));
    }

    /// The engine's answer to `request`: the prefix and 1–3 new tokens.
    fn completion(&mut self, request: RequestId, prefix: Vec<u32>, kind: u8) -> Completion {
        let aborts = request.attempt; // attempts ≥ aborts taken by the rollout
        let finish = match kind % 6 {
            1 | 2 if aborts < MAX_ABORTS => FinishReason::Abort,
            3 => FinishReason::Length,
            4 if kind > 200 => FinishReason::Error("oom".into()),
            _ => FinishReason::Stop,
        };
        let mut token_ids = prefix;
        for _ in 0..(1 + kind % 3) {
            token_ids.push(self.next_token);
            self.next_token += 1;
        }
        let n = token_ids.len();
        Completion {
            id: request,
            output: TokenOutput {
                token_ids,
                logprobs: vec![-0.5; n],
                versions: vec![PolicyVersion(0); n],
            },
            finish,
        }
    }

    fn resume(&mut self, pick: usize) {
        if self.parked.is_empty() {
            return;
        }
        let g = self.parked.swap_remove(pick % self.parked.len());
        let counter = g.id.counter;
        let actions = self.asm.start(g, counter);
        self.take(actions);
    }

    /// Replays an answer already given: it must be ignored.
    fn stale(&mut self, pick: usize) {
        if self.given.is_empty() {
            return;
        }
        let c = self.given[pick % self.given.len()].clone();
        let before = (self.asm.len(), self.asm.remembered_rollouts());
        assert!(
            self.asm.on_completion(c, 0).is_none(),
            "a stale answer acted on"
        );
        assert_eq!(before, (self.asm.len(), self.asm.remembered_rollouts()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_group_finishes_once_whatever_the_interleaving(
        groups in 1u64..5,
        size in 1u32..4,
        scores_groups in any::<bool>(),
        script in proptest::collection::vec(op(), 0..200),
    ) {
        let mut d = Driver::new(groups, size, scores_groups);
        for op in script {
            match op {
                Op::Answer { pick, kind } => d.answer(pick, kind, false),
                Op::Resume { pick } => d.resume(pick),
                Op::Stale { pick } => d.stale(pick),
            }
        }
        // Then calmly: every outstanding item answered, every parked group resumed.
        let mut rounds = 0;
        while !d.pending.is_empty() || !d.parked.is_empty() {
            rounds += 1;
            prop_assert!(rounds < 10_000, "the play does not end");
            if d.pending.is_empty() {
                d.resume(0);
            } else {
                d.answer(0, 0, true);
            }
        }
        prop_assert_eq!(d.finished.len() as u64, groups);
        prop_assert!(d.asm.is_empty());
        prop_assert_eq!(d.asm.remembered_rollouts(), 0, "finished rollouts are forgotten");
        for g in d.finished.values() {
            prop_assert!(g.rollouts.iter().all(|r| r.abort_count <= MAX_ABORTS));
        }
    }
}

/// An env answer for a rollout waiting on the engine, and one for a group not assembling, are
/// stale: nothing changes and nothing is sent.
#[test]
fn env_answers_out_of_turn_are_stale() {
    let mut d = Driver::new(1, 1, false);
    d.answer(0, 0, true); // the first prompt: the rollout now waits on the engine
    let Some(Pending::Engine { request, .. }) = d.pending.first().cloned() else {
        panic!("expected an engine request, got {:?}", d.pending);
    };
    let reply = EnvReply::done(1.0);
    assert!(d.asm.on_env(request.rollout, reply.clone(), None).is_none());
    let other = GroupId {
        counter: 99,
        ..request.rollout.group
    };
    assert!(d.asm.on_env(other.rollout(0), reply, None).is_none());
    assert_eq!(d.asm.len(), 1);
}
