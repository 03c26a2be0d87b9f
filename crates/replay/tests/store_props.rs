//! Property tests of the replay store: random workloads with η changing mid-run, restarts
//! through the database included. Invariants: no trained token older than `t − η`, no group
//! trained twice, every admitted group in exactly one bucket, counters reconcile, and a restart
//! keeps every completed and aborted group.

use std::collections::{BTreeSet, HashSet};

use proptest::prelude::*;
use sluice_core::{
    DataSample, GroupId, NodeId, PolicyVersion, RolloutGroup, RolloutStatus, RolloutTurn, RunId,
};
use sluice_replay::{Bucket, Lane, Persister, ReplayStore, TakeOutcome};

#[derive(Debug, Clone)]
enum Op {
    Admit,
    Finish {
        pick: usize,
        lag: u64,
        uniform: bool,
        failed: bool,
    },
    Abort {
        pick: usize,
    },
    Resume {
        pick: usize,
        partial: bool,
    },
    /// A step on the oldest batch; `skipped`: it published nothing (every advantage zero).
    TrainStep {
        skipped: bool,
    },
    SetEta(u64),
    Restart,
    /// An operator's clear of the groups at rest (a subset of the clearable buckets).
    Clear(Vec<Bucket>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Admit),
        4 => (any::<usize>(), 0u64..4, proptest::bool::weighted(0.2), proptest::bool::weighted(0.1))
            .prop_map(|(pick, lag, uniform, failed)| Op::Finish { pick, lag, uniform, failed }),
        2 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(pick, partial)| Op::Resume { pick, partial }),
        2 => proptest::bool::weighted(0.25).prop_map(|skipped| Op::TrainStep { skipped }),
        1 => (0u64..4).prop_map(Op::SetEta),
        1 => Just(Op::Restart),
        1 => proptest::sample::subsequence(Bucket::CLEARABLE.to_vec(), 1..=3).prop_map(Op::Clear),
    ]
}

fn sample() -> DataSample {
    DataSample {
        id: "0".into(),
        domain: "sim".into(),
        dataset: "sim".into(),
        input: serde_json::Value::Null,
        system_prompt: None,
    }
}

/// Gives every rollout of `group` tokens generated at `version`, with the given status.
fn generate(
    group: &mut RolloutGroup,
    version: PolicyVersion,
    status: RolloutStatus,
    uniform: bool,
) {
    for (i, r) in group.rollouts.iter_mut().enumerate() {
        if r.status.is_terminal() {
            continue;
        }
        if r.turns.is_empty() {
            r.turns.push(RolloutTurn::new(vec![1, 2, 3]));
        }
        let turn = r.turns.last_mut().unwrap();
        turn.append_tokens(&[7, 8], &[-0.5, -0.5], &[version, version])
            .unwrap();
        r.status = status.clone();
        r.reward = if uniform { 1.0 } else { i as f64 };
    }
}

fn pick(ids: &[GroupId], k: usize) -> Option<GroupId> {
    (!ids.is_empty()).then(|| ids[k % ids.len()])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_workloads_keep_every_invariant(ops in proptest::collection::vec(op(), 1..80), drop_expired: bool) {
        let dir = tempfile::tempdir().unwrap();
        let (mut db, _) = Persister::open(dir.path()).unwrap();
        let mut store = ReplayStore::new(drop_expired, true);
        let run = RunId::from_name("prop");
        let (batch, group_size) = (2usize, 3u32);
        let mut version = PolicyVersion(0);
        let mut eta = 1u64;
        let mut in_flight: Vec<RolloutGroup> = Vec::new();
        let mut trained: HashSet<GroupId> = HashSet::new();
        let mut next = 0u64;

        for op in ops {
            match op {
                Op::Admit => {
                    let id = GroupId { run, node: NodeId(0), counter: next };
                    next += 1;
                    let g = RolloutGroup::new(id, sample(), group_size, version);
                    store.admit(g.clone()).unwrap();
                    in_flight.push(g);
                }
                Op::Finish { pick: k, lag, uniform, failed } => {
                    if in_flight.is_empty() { continue; }
                    let mut g = in_flight.remove(k % in_flight.len());
                    let v = PolicyVersion(version.0.saturating_sub(lag));
                    let status = if failed { RolloutStatus::Error("x".into()) } else { RolloutStatus::Completed };
                    generate(&mut g, v, status, uniform);
                    store.finish(g, version, eta).unwrap();
                }
                Op::Abort { pick: k } => {
                    if in_flight.is_empty() { continue; }
                    let mut g = in_flight.remove(k % in_flight.len());
                    generate(&mut g, version, RolloutStatus::Aborted, false);
                    store.abort(g).unwrap();
                }
                Op::Resume { pick: k, partial } => {
                    let ids: Vec<GroupId> = store.ids(Bucket::Aborted)
                        .chain(if drop_expired { None } else { Some(store.ids(Bucket::Expired)) }.into_iter().flatten())
                        .collect();
                    let Some(id) = pick(&ids, k) else { continue };
                    if let Some(g) = store.resume(id, version, eta, partial).unwrap() {
                        if !partial {
                            // Regenerated turns start from their prompt.
                            for r in &g.rollouts {
                                if r.status == RolloutStatus::Aborted {
                                    prop_assert_eq!(r.turns.last().map_or(0, |t| t.completion_tokens()), 0);
                                }
                            }
                        }
                        prop_assert!(g.min_version().is_none_or(|m| m.lag_to(version).is_ok_and(|l| l <= eta)));
                        in_flight.push(g);
                    }
                }
                Op::TrainStep { skipped } => {
                    let (outcome, _expired) = store.take_batch(batch, version, eta);
                    if let TakeOutcome::Batch(groups) = outcome {
                        prop_assert_eq!(groups.len(), batch);
                        for g in &groups {
                            // The hard invariant: building the batch for version+1 from weights
                            // `version`, every token has version ≥ version − η.
                            for r in &g.rollouts {
                                for t in &r.turns {
                                    for v in &t.token_versions {
                                        prop_assert!(v.lag_to(version).is_ok_and(|l| l <= eta), "token {v} trained at {version} with η={eta}");
                                    }
                                }
                            }
                            prop_assert!(trained.insert(g.id), "group {} trained twice", g.id);
                        }
                        if skipped {
                            // Nothing published: the batch leaves the admission load instead.
                            let load = store.counters().admitted_load();
                            store.release_skipped(batch as u64);
                            prop_assert_eq!(store.counters().admitted_load(), load - batch as u64);
                        } else {
                            version = version.next();
                            store.set_policy_version(version);
                        }
                    }
                }
                Op::SetEta(e) => eta = e,
                Op::Clear(buckets) => {
                    let at_rest: BTreeSet<GroupId> = buckets.iter().flat_map(|b| store.ids(*b)).collect();
                    let load = store.counters().admitted_load();
                    let outcome = store.clear(&buckets).unwrap();
                    let cleared: BTreeSet<GroupId> = outcome.ids.iter().copied().collect();
                    prop_assert_eq!(&cleared, &at_rest, "exactly the groups at rest in the asked buckets");
                    prop_assert_eq!(outcome.cleared.values().sum::<u64>(), at_rest.len() as u64);
                    prop_assert_eq!(store.counters().admitted_load(), load - at_rest.len() as u64);
                    for id in &cleared {
                        prop_assert!(store.bucket_of(*id).is_none(), "cleared group {} still live", id);
                        prop_assert!(!trained.contains(id), "a trained group {} was at rest", id);
                    }
                    for b in &buckets {
                        prop_assert_eq!(store.ids(*b).count(), 0);
                    }
                }
                Op::Restart => {
                    db.apply(&store.drain_outbox()).unwrap();
                    let before: BTreeSet<GroupId> = store.ids(Bucket::Completed)
                        .chain(store.ids(Bucket::Aborted))
                        .chain(store.ids(Bucket::InFlight))
                        .collect();
                    let completed_before: BTreeSet<GroupId> = store.ids(Bucket::Completed).collect();
                    drop(db);
                    let (reopened, recovered) = Persister::open(dir.path()).unwrap();
                    db = reopened;
                    let counters = recovered.counters.clone();
                    let old_counters = store.counters().clone();
                    store = ReplayStore::recover(drop_expired, true, recovered.counters, recovered.groups);
                    prop_assert_eq!(counters.admitted_total, old_counters.admitted_total);
                    prop_assert_eq!(counters.consumed_total, old_counters.consumed_total);
                    prop_assert_eq!(counters.released_total, old_counters.released_total);
                    prop_assert_eq!(counters.skipped_total, old_counters.skipped_total);
                    let after: BTreeSet<GroupId> = store.ids(Bucket::Completed).chain(store.ids(Bucket::Aborted)).collect();
                    prop_assert_eq!(&before, &after, "no completed, aborted or in-flight group lost");
                    let completed_after: BTreeSet<GroupId> = store.ids(Bucket::Completed).collect();
                    prop_assert_eq!(completed_before, completed_after);
                    // In-flight work resumes from the aborted bucket after a restart.
                    in_flight.clear();
                    for id in &trained {
                        prop_assert!(store.bucket_of(*id).is_none(), "trained group {} came back", id);
                    }
                }
            }
            prop_assert_eq!(store.counters().admitted_total, next);
            store.reconcile().map_err(TestCaseError::fail)?;
        }
    }
}

#[test]
fn take_batch_serves_oldest_first_and_refuses_partial_batches() {
    let mut store = ReplayStore::new(false, false);
    let run = RunId::from_name("order");
    let ids: Vec<GroupId> = (0..3)
        .map(|c| GroupId {
            run,
            node: NodeId(0),
            counter: c,
        })
        .collect();
    for id in &ids {
        store
            .admit(RolloutGroup::new(*id, sample(), 2, PolicyVersion(0)))
            .unwrap();
    }
    for id in ids.iter().rev() {
        let mut g = RolloutGroup::new(*id, sample(), 2, PolicyVersion(0));
        generate(&mut g, PolicyVersion(0), RolloutStatus::Completed, false);
        store.finish(g, PolicyVersion(0), 1).unwrap();
    }
    let (out, _) = store.take_batch(4, PolicyVersion(0), 1);
    assert_eq!(out, TakeOutcome::NotEnough { available: 3 });
    let (out, _) = store.take_batch(2, PolicyVersion(0), 1);
    let TakeOutcome::Batch(groups) = out else {
        panic!("expected a batch")
    };
    assert_eq!(groups.iter().map(|g| g.id).collect::<Vec<_>>(), ids[..2]);
    assert_eq!(
        store.counters().transitions[&"completed->consumed".parse().unwrap()],
        2
    );
    // The remaining group is now too old for weights v2 with η = 1: it expires instead.
    let (out, expired) = store.take_batch(1, PolicyVersion(2), 1);
    assert_eq!(out, TakeOutcome::NotEnough { available: 0 });
    assert_eq!(expired, vec![ids[2]]);
    assert_eq!(store.bucket_of(ids[2]), Some(Bucket::Expired));
    store.reconcile().unwrap();
}

#[test]
fn clear_throws_away_groups_at_rest_and_refuses_live_buckets() {
    let mut store = ReplayStore::new(false, false);
    let run = RunId::from_name("clear");
    let id = |counter| GroupId {
        run,
        node: NodeId(0),
        counter,
    };
    for c in 0..3 {
        store
            .admit(RolloutGroup::new(id(c), sample(), 2, PolicyVersion(0)))
            .unwrap();
    }
    let mut done = RolloutGroup::new(id(0), sample(), 2, PolicyVersion(0));
    generate(&mut done, PolicyVersion(0), RolloutStatus::Completed, false);
    store.finish(done, PolicyVersion(0), 1).unwrap();
    let mut cut = RolloutGroup::new(id(1), sample(), 2, PolicyVersion(0));
    generate(&mut cut, PolicyVersion(0), RolloutStatus::Aborted, false);
    store.abort(cut).unwrap();

    let err = store.clear(&[Bucket::InFlight]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "bucket `in_flight` cannot be cleared: only completed, aborted and expired groups are at rest"
    );
    assert_eq!(
        store.count(Bucket::Completed),
        1,
        "a refused clear changes nothing"
    );

    let outcome = store.clear(&Bucket::CLEARABLE).unwrap();
    assert_eq!(outcome.ids, vec![id(0), id(1)]);
    assert_eq!(outcome.cleared[&Bucket::Completed], 1);
    assert_eq!(outcome.cleared[&Bucket::Aborted], 1);
    assert_eq!(outcome.cleared[&Bucket::Expired], 0);
    // Two rollouts of two tokens each, in each of the two groups.
    assert_eq!(outcome.discarded_tokens, 8);
    assert_eq!(store.count(Bucket::Cleared), 2);
    assert_eq!(
        store.counters().admitted_load(),
        1,
        "only the in-flight group still counts"
    );
    assert_eq!(store.bucket_of(id(2)), Some(Bucket::InFlight));
    // A cleared group cannot come back.
    assert_eq!(
        store
            .resume(id(1), PolicyVersion(0), 1, true)
            .unwrap_err()
            .kind(),
        "replay_unknown_group"
    );
    store.reconcile().unwrap();
}

/// Under the drop policy an expired group is thrown away with its tokens, which count as
/// discarded as a regenerated group's do (they counted nothing).
#[test]
fn a_dropped_expired_group_discards_its_tokens() {
    let mut store = ReplayStore::new(true, false);
    let id = |counter| GroupId {
        run: RunId::from_name("drop"),
        node: NodeId(0),
        counter,
    };
    for c in 0..2 {
        store
            .admit(RolloutGroup::new(id(c), sample(), 2, PolicyVersion(0)))
            .unwrap();
    }
    // Finished at version 3 with tokens of version 0, η = 1: expired, and dropped.
    let mut stale = RolloutGroup::new(id(0), sample(), 2, PolicyVersion(0));
    generate(
        &mut stale,
        PolicyVersion(0),
        RolloutStatus::Completed,
        false,
    );
    assert_eq!(
        store.finish(stale, PolicyVersion(3), 1).unwrap().bucket,
        Bucket::Expired
    );
    assert_eq!(store.counters().discarded_tokens, 4);
    // Aborted, then resumed too late: expired on the way back, and dropped.
    let mut cut = RolloutGroup::new(id(1), sample(), 2, PolicyVersion(0));
    generate(&mut cut, PolicyVersion(0), RolloutStatus::Aborted, false);
    store.abort(cut).unwrap();
    assert!(
        store
            .resume(id(1), PolicyVersion(3), 1, true)
            .unwrap()
            .is_none()
    );
    assert_eq!(store.counters().discarded_tokens, 8);
    assert_eq!(store.count(Bucket::Expired), 2);
}

#[test]
fn illegal_transitions_are_refused_and_change_nothing() {
    let mut store = ReplayStore::new(false, false);
    let id = GroupId {
        run: RunId::from_name("x"),
        node: NodeId(0),
        counter: 0,
    };
    store
        .admit(RolloutGroup::new(id, sample(), 1, PolicyVersion(0)))
        .unwrap();
    let err = store.resume(id, PolicyVersion(0), 1, true).unwrap_err();
    assert_eq!(err.kind(), "replay_illegal_transition");
    assert_eq!(store.bucket_of(id), Some(Bucket::InFlight));
    assert!(
        store
            .admit(RolloutGroup::new(id, sample(), 1, PolicyVersion(0)))
            .is_err()
    );
    store.reconcile().unwrap();
}

/// The store owns which groups wait to resume: tail candidacy follows k as it changes, lanes
/// serve oldest first (aborted before expired), a group in flight keeps no data in memory, and
/// an expired group's rollouts say so.
#[test]
fn lanes_serve_the_waiting_groups_oldest_first_and_follow_k() {
    let mut store = ReplayStore::new(false, false);
    let run = RunId::from_name("lanes");
    let id = |counter| GroupId {
        run,
        node: NodeId(0),
        counter,
    };
    for c in 0..4 {
        store
            .admit(RolloutGroup::new(id(c), sample(), 2, PolicyVersion(0)))
            .unwrap();
        assert!(store.group(id(c)).is_none(), "in flight: on disk only");
    }
    // Groups 3 and 1 aborted three times, group 0 once; group 2 completes and then expires.
    for (c, aborts) in [(3, 3), (0, 1), (1, 3)] {
        let mut g = RolloutGroup::new(id(c), sample(), 2, PolicyVersion(0));
        generate(&mut g, PolicyVersion(0), RolloutStatus::Aborted, false);
        g.rollouts[1].abort_count = aborts;
        store.abort(g).unwrap();
    }
    let mut done = RolloutGroup::new(id(2), sample(), 2, PolicyVersion(0));
    generate(&mut done, PolicyVersion(0), RolloutStatus::Completed, false);
    store.finish(done, PolicyVersion(0), 1).unwrap();
    let (_, expired) = store.take_batch(1, PolicyVersion(5), 1);
    assert_eq!(expired, vec![id(2)]);
    let statuses = &store.group(id(2)).unwrap().rollouts;
    assert!(statuses.iter().all(|r| r.status == RolloutStatus::Expired));

    // k = 0: no tail candidates.
    let w = store.waiting();
    assert_eq!((w.aborted, w.expired, w.tail), (3, 1, 0));
    assert_eq!(
        store.lane_ids(Lane::Resume, 9),
        vec![id(0), id(1), id(3), id(2)]
    );
    assert!(store.set_tail_steps(2));
    assert!(!store.set_tail_steps(2), "unchanged");
    let w = store.waiting();
    assert_eq!((w.aborted, w.expired, w.tail), (1, 1, 2));
    assert_eq!(store.lane_ids(Lane::Tail, 9), vec![id(1), id(3)]);
    assert_eq!(store.lane_ids(Lane::Resume, 9), vec![id(0), id(2)]);

    let got = store
        .resume_from(Lane::Tail, 1, PolicyVersion(0), 1, true)
        .unwrap();
    assert_eq!(got.groups.iter().map(|g| g.id).collect::<Vec<_>>(), [id(1)]);
    assert_eq!(
        got.groups[0].rollouts[0].completion_tokens(),
        2,
        "resumed with its partial"
    );
    assert!(store.group(id(1)).is_none(), "back in flight: on disk only");
    let got = store
        .resume_from(Lane::Resume, 5, PolicyVersion(0), 1, true)
        .unwrap();
    assert_eq!(
        got.groups.iter().map(|g| g.id).collect::<Vec<_>>(),
        [id(0), id(2)]
    );
    assert!(
        got.groups[1]
            .rollouts
            .iter()
            .all(|r| r.status == RolloutStatus::Aborted && r.completion_tokens() == 0),
        "an expired group is regenerated from its prompts"
    );
    let w = store.waiting();
    assert_eq!((w.aborted, w.expired, w.tail), (0, 0, 1));
    assert_eq!(w.less(Lane::Tail, 1).total(), 0);
    store.reconcile().unwrap();
}
