//! Weight-update modes and partial rollouts through the whole pipeline, observed in what the
//! trainer received: resumed completions are their partial followed by the continuation, with
//! versions spanning the update; `in_flight` tags later tokens with the new version without
//! aborting; `drain` never lets a request span two versions; the tail batch runs at its trigger
//! size without admitting anything new.

use crate::common;

use std::time::Duration;

use sluice_core::{RolloutGroup, RolloutTurn};
use sluice_engine::simulated::mix;
use sluice_node::{Node, NodeOptions, NodeStatus};

async fn run(rollout: &str) -> (NodeStatus, Vec<RolloutGroup>) {
    let config = common::config(rollout, "time_scale = 1.0");
    let (trainer, batches) = common::RecordingTrainer::new();
    let options = NodeOptions {
        trainer: Some(Box::new(trainer)),
        track_ids: true,
        ..NodeOptions::default()
    };
    let node = Node::start(&config, options).await.unwrap();
    let status = node
        .wait_done(Duration::from_secs(30), |_| {})
        .await
        .unwrap();
    common::check_invariants(&status);
    node.shutdown().await;
    let groups = batches
        .lock()
        .unwrap()
        .iter()
        .flat_map(|(_, b)| b.clone())
        .collect();
    (status, groups)
}

fn turns(groups: &[RolloutGroup]) -> impl Iterator<Item = (&sluice_core::Rollout, &RolloutTurn)> {
    groups
        .iter()
        .flat_map(|g| g.rollouts.iter())
        .flat_map(|r| r.turns.iter().map(move |t| (r, t)))
}

fn spans_versions(t: &RolloutTurn) -> bool {
    t.min_version() != t.max_version()
}

fn nondecreasing(t: &RolloutTurn) -> bool {
    t.token_versions.windows(2).all(|w| w[0] <= w[1])
}

/// The simulated engine's token at position `pos` of a rollout: a resumed completion must match
/// the uninterrupted one token for token.
fn expected_token(r: &sluice_core::Rollout, pos: usize) -> u32 {
    (mix(&[u64::from(r.id.index), r.id.group.counter, pos as u64]) % 32_000) as u32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_resume_with_partials_resumes_exactly_where_it_stopped() {
    let (status, groups) =
        run("weight_update_mode = \"abort_resume\"\nenable_partial_rollout = true\nmax_version_lag = 3\nstaleness_threshold = 1.5").await;
    assert!(status.trainer.steps > 0);
    let mut resumed = 0;
    for (r, t) in turns(&groups) {
        assert!(nondecreasing(t), "versions go backwards in {}", r.id);
        for (pos, tok) in t.completion_token_ids.iter().enumerate() {
            assert_eq!(
                *tok,
                expected_token(r, pos),
                "{}: resumed completion differs at {pos}",
                r.id
            );
        }
        if r.abort_count > 0 && spans_versions(t) {
            resumed += 1;
        }
    }
    assert!(
        resumed > 0,
        "no trained rollout was resumed across an update; status {status:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_resume_without_partials_regenerates_from_the_prompt() {
    let (status, groups) =
        run("weight_update_mode = \"abort_resume\"\nenable_partial_rollout = false\nmax_version_lag = 3\nstaleness_threshold = 1.5").await;
    let mut aborted = 0;
    for (r, t) in turns(&groups) {
        assert!(
            !spans_versions(t),
            "{}: a regenerated turn mixes versions",
            r.id
        );
        aborted += usize::from(r.abort_count > 0);
    }
    assert!(aborted > 0, "nothing was aborted; status {status:#?}");
    assert!(
        status.replay.counters.discarded_tokens > 0,
        "partials were discarded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_updates_tag_later_tokens_with_the_new_version() {
    let (_, groups) =
        run("weight_update_mode = \"in_flight\"\nmax_version_lag = 3\nstaleness_threshold = 1.5")
            .await;
    let mut spanning = 0;
    for (r, t) in turns(&groups) {
        assert_eq!(r.abort_count, 0, "in_flight never aborts");
        assert!(nondecreasing(t), "{}: versions go backwards", r.id);
        spanning += usize::from(spans_versions(t));
    }
    assert!(spanning > 0, "no request saw a swap");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_never_lets_a_request_span_two_versions() {
    let (_, groups) =
        run("weight_update_mode = \"drain\"\nmax_version_lag = 2\nstaleness_threshold = 1.5").await;
    assert!(!groups.is_empty());
    for (r, t) in turns(&groups) {
        assert_eq!(r.abort_count, 0);
        assert!(!spans_versions(t), "{} spans versions under drain", r.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tail_batch_triggers_at_its_size_without_over_sending() {
    let (status, _) = run(
        "weight_update_mode = \"abort_resume\"\nenable_partial_rollout = true\nmax_version_lag = 4\nstaleness_threshold = 2.0\ntail_batch_candidate_steps = 1\ntail_batch_trigger_size = 2",
    )
    .await;
    let c = &status.controller;
    assert!(c.tail_rounds > 0, "no tail round: {status:#?}");
    assert!(
        c.tail_round_min_size >= 2,
        "a tail round started below its trigger size"
    );
    assert_eq!(
        c.admitted_during_tail, 0,
        "fresh groups were admitted during a tail round"
    );
}

/// The long-tail workload of `configs/sim_longtail.toml` (lognormal lengths, median 64, σ 1.2)
/// for `steps` steps at a fast time scale, with the staleness knobs of `rollout`.
async fn long_tail(steps: u64, rollout: sluice_core::Knobs) -> NodeStatus {
    let text = include_str!("../../../../configs/sim_longtail.toml");
    let mut config = sluice_config::parse(text, "configs/sim_longtail.toml", &[], &|_| None)
        .expect("the recipe is valid");
    config.run.max_steps = std::num::NonZeroU64::new(steps).unwrap();
    config.engine.simulated.time_scale = 0.02;
    config.metrics.enabled = false;
    config.rollout.knobs = rollout;
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    let status = node
        .wait_done(Duration::from_secs(120), |_| {})
        .await
        .unwrap();
    common::check_invariants(&status);
    node.shutdown().await;
    status
}

/// Groups that entered the expired bucket.
fn expired(s: &NodeStatus) -> u64 {
    let t = &s.replay.counters.transitions;
    t.iter()
        .filter(|(t, _)| t.to == sluice_replay::Bucket::Expired)
        .map(|(_, n)| n)
        .sum()
}

/// Length bias on a long tail: with in-flight updates and η = 1, a long rollout's first tokens
/// fall past η before it ends, so its group expires and the trainer sees the others: the
/// trained mean length falls short of the generated one (expired groups count as generated).
/// With η wide enough that nothing expires, both sides have the same mean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_on_a_long_tail_shows_as_length_bias() {
    let base = sluice_config::parse(
        include_str!("../../../../configs/sim_longtail.toml"),
        "sim_longtail.toml",
        &[],
        &|_| None,
    )
    .unwrap()
    .rollout
    .knobs;
    let tight = sluice_core::Knobs {
        max_version_lag: 1,
        staleness_threshold: 1.0,
        ..base.clone()
    };
    let wide = sluice_core::Knobs {
        max_version_lag: 16,
        staleness_threshold: 1.0,
        ..base
    };
    let biased = long_tail(30, tight).await;
    let fair = long_tail(30, wide).await;
    let bias = |s: &NodeStatus| s.controller.length_bias.expect("measured at every step");
    let (b, f) = (bias(&biased), bias(&fair));
    eprintln!("η = 1: {b:?}\nη = 16: {f:?}");
    assert!(expired(&biased) > 0, "nothing expired: {:?}", biased.replay);
    assert_eq!(expired(&fair), 0, "{:?}", fair.replay);
    assert!(b.generated_rollouts > b.trained_rollouts);
    assert!(b.bias_ratio < -0.05, "trained as long as generated: {b:?}");
    assert!(f.bias_ratio.abs() < 0.04, "{f:?}");
    assert!(
        b.bias_ratio < f.bias_ratio - 0.04,
        "η = 1 {b:?}, η = 16 {f:?}"
    );
}

/// A pause admits nothing new, and work a weight update interrupted still finishes and trains:
/// under `abort_resume` a publish after the pause aborts the groups in flight, which used to
/// wait in the store, never resumed, for as long as the pause lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_lets_interrupted_work_finish() {
    use sluice_replay::Bucket;
    let mut config = common::config(
        "weight_update_mode = \"abort_resume\"\nmax_version_lag = 3\nstaleness_threshold = 1.5\nadmission = \"eta\"",
        "time_scale = 1.0",
    );
    config.run.max_steps = std::num::NonZeroU64::new(10_000).unwrap();
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    let at_rest = |s: &NodeStatus, b: Bucket| s.replay.buckets.get(&b).copied().unwrap_or(0);
    common::wait_for_status(&node, "aborts under way", Duration::from_secs(20), |s| {
        s.trainer.steps >= 2 && s.controller.in_flight > 0
    })
    .await;
    node.handles
        .knobs
        .update(&sluice_core::KnobPatch {
            paused: Some(true),
            ..Default::default()
        })
        .unwrap();
    let paused = node.status().await.unwrap();
    let settled = common::wait_for_status(
        &node,
        "the admitted work to finish while paused",
        Duration::from_secs(20),
        |s| {
            s.controller.in_flight == 0
                && at_rest(s, Bucket::Aborted) == 0
                && at_rest(s, Bucket::Expired) == 0
        },
    )
    .await;
    assert!(
        settled.controller.admitted_total <= paused.controller.admitted_total,
        "admitted while paused: {} after {}",
        settled.controller.admitted_total,
        paused.controller.admitted_total
    );
    let aborts = |s: &NodeStatus| {
        let t = &s.replay.counters.transitions;
        t.iter()
            .filter(|(k, _)| k.to == Bucket::Aborted)
            .map(|(_, n)| n)
            .sum::<u64>()
    };
    assert!(
        aborts(&settled) > aborts(&paused) && settled.trainer.steps > paused.trainer.steps,
        "no group was interrupted after the pause, or nothing trained; status {settled:#?}"
    );
    node.shutdown().await;
}
