//! A whole simulated pipeline runs to its step budget and keeps the invariants.

mod common;

use std::time::Duration;

use sluice_actors::{Node, NodeOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_run_reaches_its_step_budget() {
    let config = common::config(
        "max_version_lag = 1\nstaleness_threshold = 0.5",
        "time_scale = 1.0",
    );
    let node = Node::start(
        &config,
        NodeOptions {
            track_ids: true,
            ..NodeOptions::default()
        },
    )
    .await
    .unwrap();
    let status = node
        .wait_done(Duration::from_secs(30), |_| {})
        .await
        .unwrap();
    assert_eq!(status.trainer.steps, 6);
    assert_eq!(status.trainer.version.0, 6);
    common::check_invariants(&status);
    node.shutdown().await;
}
