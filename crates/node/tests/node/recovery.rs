//! Graceful stop and resume, in process: the stop stores every in-flight group as aborted and
//! writes a checkpoint; a node started on the same directories continues the step count and the
//! version, resumes the aborted groups, trains every completed one, and trains nothing twice.
//! Also: checkpoints on request (and over the admin API), and a run whose trainer step fails.

use crate::common;

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use sluice_actors::checkpoint::{CheckpointDir, Manifest};
use sluice_actors::replay::ReplayStatus;
use sluice_config::Config;
use sluice_core::GroupId;
use sluice_node::{Node, NodeOptions};
use sluice_replay::Bucket;

fn options(dir: &Path) -> NodeOptions {
    NodeOptions {
        replay_dir: Some(dir.join("replay")),
        checkpoint_dir: Some(dir.join("checkpoint")),
        track_ids: true,
        ..NodeOptions::default()
    }
}

fn config(max_steps: u64) -> Config {
    let rollout = "weight_update_mode = \"abort_resume\"\nenable_partial_rollout = true\nmax_version_lag = 2\nstaleness_threshold = 1.0";
    let mut config = common::config(rollout, "time_scale = 1.0");
    config.run.max_steps = std::num::NonZeroU64::new(max_steps).unwrap();
    config
}

fn ids(s: &ReplayStatus, b: Bucket) -> HashSet<GroupId> {
    s.live_ids.get(&b).into_iter().flatten().copied().collect()
}

async fn wait_for_steps(node: &Node, steps: u64) {
    common::wait_for_status(node, "progress", Duration::from_secs(60), |s| {
        s.trainer.steps >= steps
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_resumes_version_steps_and_every_group() {
    let dir = tempfile::tempdir().unwrap();
    let (manifest, trained_1) = run_1_stops_gracefully_mid_run(dir.path()).await;

    // What run 2 will find.
    let at_stop = replay_at_the_stop(dir.path()).await;
    let waiting: HashSet<GroupId> = [Bucket::Completed, Bucket::Aborted, Bucket::Expired]
        .iter()
        .flat_map(|b| ids(&at_stop, *b))
        .collect();
    assert!(
        !ids(&at_stop, Bucket::Aborted).is_empty(),
        "the stop stored in-flight groups as aborted: {:?}",
        at_stop.store
    );

    // Run 2: same directories, a few more steps.
    let config = self::config(manifest.steps + 4);
    let node = Node::start(&config, options(dir.path())).await.unwrap();
    check_the_sampler_draws_on_from_the_checkpoint(&node, &manifest).await;
    check_the_step_count_and_version_continue(&node, &manifest).await;
    let status = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .unwrap();
    let trained_2: HashSet<GroupId> = node.handles.trainer.trained_ids().into_iter().collect();
    assert_eq!(status.trainer.steps, manifest.steps + 4);
    assert_eq!(status.trainer.version.0, manifest.version + 4);
    common::check_invariants(&status);
    assert!(trained_1.is_disjoint(&trained_2), "a group trained twice");
    // Groups waiting at the stop were trained in run 2 or still wait: none vanished.
    let final_2 = node.shutdown().await.unwrap();
    let live_2: HashSet<GroupId> = final_2.live_ids.values().flatten().copied().collect();
    assert_eq!(final_2.store.counters.released_total, 0);
    for id in &waiting {
        assert!(
            trained_2.contains(id) || live_2.contains(id),
            "group {id} waiting at the stop was lost"
        );
    }
    let resumed = ids(&at_stop, Bucket::Aborted)
        .iter()
        .filter(|id| trained_2.contains(id))
        .count();
    assert!(resumed > 0, "aborted groups resume and get trained");
    let m2 = CheckpointDir::new(dir.path().join("checkpoint"))
        .load()
        .unwrap()
        .unwrap()
        .1;
    assert_eq!(m2.reason, "done");
    assert_eq!(m2.steps, manifest.steps + 4);
    assert_eq!(m2.trained_groups, final_2.store.counters.consumed_total);
}

/// Run 1: stops gracefully after three steps; returns the checkpoint the stop wrote and every
/// group run 1 trained, having checked that the checkpoint holds exactly those and that nothing
/// consumed or in flight was left behind.
async fn run_1_stops_gracefully_mid_run(dir: &Path) -> (Manifest, HashSet<GroupId>) {
    let config = config(1000);
    let node = Node::start(&config, options(dir)).await.unwrap();
    wait_for_steps(&node, 3).await;
    let trained_1: HashSet<GroupId> = node.handles.trainer.trained_ids().into_iter().collect();
    let trainer = node.handles.trainer.clone();
    let replay = node.handles.replay.clone();
    let report = node.stop_gracefully().await;
    assert!(report.error.is_none(), "{report:#?}");
    assert_eq!(report.in_flight_left, 0);
    let manifest = report.checkpoint.clone().expect("a checkpoint");
    let final_1 = report.final_replay.clone().unwrap();
    let t1 = trainer.status();
    // Everything trained in run 1 (including a batch handed out while stopping) is in the
    // checkpoint, and nothing consumed was left untrained.
    let trained_1: HashSet<GroupId> = trained_1.into_iter().chain(trainer.trained_ids()).collect();
    assert_eq!(manifest.steps, t1.steps);
    assert_eq!(manifest.version, t1.version.0);
    assert_eq!(manifest.trained_groups, trained_1.len() as u64);
    assert_eq!(final_1.counters.consumed_total, manifest.trained_groups);
    assert_eq!(
        final_1.buckets[&sluice_replay::Bucket::InFlight],
        0,
        "{final_1:?}"
    );
    assert_eq!(final_1.buckets[&sluice_replay::Bucket::Pending], 0);
    drop(replay);
    (manifest, trained_1)
}

/// The replay store as the stop left it on disk, read by a store of its own.
async fn replay_at_the_stop(dir: &Path) -> ReplayStatus {
    let (handle, _, join) = sluice_actors::replay::ReplayHandle::spawn(
        sluice_actors::replay::ReplayOptions {
            dir: Some(dir.join("replay")),
            drop_expired: false,
            filter_zero_advantage: false,
            tail_batch_candidate_steps: 0,
        },
        std::sync::Arc::new(|_| {}),
    )
    .await
    .unwrap();
    let at_stop = handle.status().await.unwrap();
    handle.stop().await;
    join.await.unwrap();
    at_stop
}

/// The sampler draws on from the checkpoint: its per-domain counts continue, not restart.
async fn check_the_sampler_draws_on_from_the_checkpoint(node: &Node, manifest: &Manifest) {
    let saved = manifest
        .sampler
        .clone()
        .expect("the sampler's state is in the checkpoint");
    let now = node.handles.sampler.state().await.unwrap();
    let count = |state: &serde_json::Value, what: &str| -> u64 {
        state["domains"]
            .as_object()
            .expect("per-domain counts")
            .values()
            .map(|d| d[what].as_u64().unwrap())
            .sum()
    };
    assert!(count(&saved, "sampled") > 0, "{saved}");
    assert!(
        count(&now, "sampled") >= count(&saved, "sampled"),
        "{saved} → {now}"
    );
    assert!(
        count(&now, "completed") >= count(&saved, "completed"),
        "{saved} → {now}"
    );
}

/// Run 2 starts at run 1's step count and version: trainer, controller and checkpoint alike.
async fn check_the_step_count_and_version_continue(node: &Node, manifest: &Manifest) {
    let s = node.status().await.unwrap();
    assert_eq!(s.trainer.steps, manifest.steps, "the step count continues");
    assert_eq!(
        s.trainer.version.0, manifest.version,
        "the version continues"
    );
    assert_eq!(s.controller.version.0, manifest.version);
    assert_eq!(s.checkpoint.as_ref().unwrap().version, manifest.version);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_on_request_over_the_admin_api() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(1000);
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.token = Some(sluice_config::Secret::new("s3cret"));
    let node = Node::start(
        &config,
        NodeOptions {
            serve_admin: true,
            ..options(dir.path())
        },
    )
    .await
    .unwrap();
    wait_for_steps(&node, 2).await;
    let m = node.handles.checkpoint().await.unwrap();
    assert_eq!(m.reason, "request");
    assert!(m.steps >= 2);
    assert_eq!(m.trained_groups, 4 * m.steps);
    assert!(m.replay.consumed_total >= m.trained_groups);
    let base = format!("http://{}", node.admin_addr().unwrap());
    let (denied, ok) = tokio::task::spawn_blocking(move || {
        let c = sluice_node::client::request;
        let denied = c(&base, "POST", "/v1/checkpoint", None, None).unwrap();
        let ok = c(&base, "POST", "/v1/checkpoint", None, Some("s3cret")).unwrap();
        (denied, ok)
    })
    .await
    .unwrap();
    assert_eq!(denied.0, 401, "{denied:?}");
    assert_eq!(ok.0, 200, "{ok:?}");
    let body: serde_json::Value = serde_json::from_str(&ok.1).unwrap();
    assert!(body["checkpoint"]["version"].as_u64().unwrap() >= m.version);
    node.shutdown().await;
    let (_, on_disk) = CheckpointDir::new(dir.path().join("checkpoint"))
        .load()
        .unwrap()
        .unwrap();
    assert!(on_disk.version >= m.version);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_a_checkpoint_dir_refuses_checkpoints() {
    let node = Node::start(&config(1000), NodeOptions::default())
        .await
        .unwrap();
    let err = node.handles.checkpoint().await.unwrap_err();
    assert_eq!(err.kind(), "checkpoint_unavailable");
    node.shutdown().await;
}

/// Periodic checkpoints that keep failing (here a file stands where they stage their files)
/// end the run after three in a row, naming the cause, instead of training on with nothing
/// saved; the status says why, and each failure is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_checkpoints_that_keep_failing_end_the_run() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("checkpoint.partial"), b"in the way").unwrap();
    let mut config = config(1000);
    config.supervision.checkpoint_every_steps = 1;
    let node = Node::start(&config, options(dir.path())).await.unwrap();
    let err = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, sluice_actors::ActorError::Checkpoint(_)),
        "{text}"
    );
    assert!(
        text.contains("3 periodic checkpoints in a row failed")
            && text.contains("checkpoint.partial"),
        "{text}"
    );
    let status = node.status().await.unwrap();
    assert!(
        status
            .checkpoint_failure
            .is_some_and(|w| w.contains("in a row"))
    );
    assert!(
        status.trainer.steps < 20,
        "trained on: {}",
        status.trainer.steps
    );
    node.shutdown().await;
}

/// A run resumed with fewer groups a step goes on: η's admission bound counted the whole run's
/// admissions against the new batch size, found its history over it for good, admitted nothing
/// and left the trainer waiting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_resumed_with_fewer_groups_a_step_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (manifest, _) = run_1_stops_gracefully_mid_run(dir.path()).await;
    let mut config = config(manifest.steps + 12);
    config.rollout.groups_per_step = std::num::NonZeroU32::new(1).unwrap();
    let node = Node::start(&config, options(dir.path())).await.unwrap();
    let status = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .expect("the resumed run trains its steps");
    assert_eq!(status.trainer.steps, manifest.steps + 12);
    common::check_invariants(&status);
    node.shutdown().await;
}

/// A stop whose groups do not all come back in time (here env steps that hang past the stop's
/// bound, as an episode waiting for an env node that left) still writes its checkpoint: the
/// wait for them takes three quarters of the shutdown timeout, and they stay in the store in
/// flight. It used to wait out the whole timeout and then have none left for the checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_with_groups_that_never_come_back_still_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(1000);
    config.faults.env_hang_every_steps = 2;
    config.supervision.env_step_timeout = Duration::from_secs(600);
    config.supervision.shutdown_timeout = Duration::from_secs(2);
    let node = Node::start(&config, options(dir.path())).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = node.stop_gracefully().await;
    assert!(report.error.is_none(), "{report:#?}");
    assert!(report.in_flight_left > 0, "no group hung: {report:#?}");
    assert!(report.checkpoint.is_some(), "{report:#?}");
    assert!(report.seconds < 2.5, "{report:#?}");
}
