//! Restarting on the same replay directory after the actor system was dropped mid-run loses no
//! completed or aborted group, and nothing is trained twice across the two runs; a start that
//! fails half-way leaves nothing running to restart over ([`start_failures`]).

use crate::common;
mod datasets;
mod knobs;
mod start_failures;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use sluice_actors::replay::{ReplayHandle, ReplayOptions};
use sluice_node::{Node, NodeOptions};
use sluice_replay::Bucket;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_recovers_every_completed_and_aborted_group() {
    let dir = tempfile::tempdir().unwrap();
    let rollout = "weight_update_mode = \"abort_resume\"\nenable_partial_rollout = true\nmax_version_lag = 2\nstaleness_threshold = 1.5";
    let mut config = common::config(rollout, "time_scale = 1.0");
    config.run.max_steps = std::num::NonZeroU64::new(1000).unwrap();
    let options = || NodeOptions {
        replay_dir: Some(dir.path().to_owned()),
        track_ids: true,
        ..NodeOptions::default()
    };

    // Run 1: stop in the middle of the run.
    let node = Node::start(&config, options()).await.unwrap();
    common::wait_for_status(
        &node,
        "run 1 to make progress",
        Duration::from_secs(20),
        |s| {
            s.trainer.steps >= 3
                && s.replay.buckets[&Bucket::Aborted] + s.replay.buckets[&Bucket::Completed] > 0
        },
    )
    .await;
    let trained_1: HashSet<_> = node.handles.trainer.trained_ids().into_iter().collect();
    let last = node.shutdown().await.expect("final replay state");

    // Reopen the store alone and compare.
    let options_replay = ReplayOptions {
        dir: Some(dir.path().to_owned()),
        drop_expired: false,
        filter_zero_advantage: false,
        tail_batch_candidate_steps: 0,
    };
    let (replay, recovery, join) = ReplayHandle::spawn(options_replay, Arc::new(|_| {}))
        .await
        .unwrap();
    let now = replay.status().await.unwrap();
    let ids = |s: &sluice_actors::replay::ReplayStatus, b: Bucket| -> HashSet<_> {
        s.live_ids.get(&b).into_iter().flatten().copied().collect()
    };
    assert_eq!(
        ids(&now, Bucket::Completed),
        ids(&last, Bucket::Completed),
        "completed groups survive"
    );
    let was_resumable: HashSet<_> = [Bucket::Aborted, Bucket::InFlight, Bucket::Pending]
        .iter()
        .flat_map(|b| ids(&last, *b))
        .collect();
    assert_eq!(
        ids(&now, Bucket::Aborted),
        was_resumable,
        "aborted and in-flight groups come back resumable"
    );
    assert_eq!(
        now.store.counters.admitted_total,
        last.store.counters.admitted_total
    );
    assert_eq!(
        now.store.counters.consumed_total,
        last.store.counters.consumed_total
    );
    assert_eq!(
        recovery.counts.waiting.total(),
        was_resumable.len() as u64,
        "the store counts every resumable group as waiting"
    );
    replay.stop().await;
    join.await.unwrap();

    // Run 2 on the same directory: it finishes, and never trains a group of run 1 again.
    config.run.max_steps = std::num::NonZeroU64::new(4).unwrap();
    let node = Node::start(&config, options()).await.unwrap();
    let status = node
        .wait_done(Duration::from_secs(20), |_| {})
        .await
        .unwrap();
    assert_eq!(status.trainer.lag_violations, 0);
    assert!(
        status.trainer.version.0 >= 4 + trained_1.len() as u64 / 4,
        "versions continue after a restart"
    );
    let trained_2: HashSet<_> = node.handles.trainer.trained_ids().into_iter().collect();
    assert!(
        trained_1.is_disjoint(&trained_2),
        "a group was trained in both runs"
    );
    node.shutdown().await;
}
