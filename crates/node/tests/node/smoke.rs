//! A whole simulated pipeline runs to its step budget and keeps the invariants.

use crate::common;

use std::time::Duration;

use sluice_node::{Node, NodeOptions};

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

/// An actor that ends mid-run wakes the waiting node at once (its join is a run event) and is
/// named in the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_that_ends_mid_run_stops_the_wait_with_its_name() {
    let config = common::config("max_version_lag = 1", "time_scale = 1.0");
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    node.handles.sampler.stop().await;
    let err = node
        .wait_done(Duration::from_secs(30), |_| {})
        .await
        .expect_err("the run cannot finish without its sampler");
    assert!(
        matches!(err, sluice_actors::ActorError::Gone { actor: "sampler" }),
        "{err}"
    );
    assert_eq!(node.failure(), Some("sampler"));
    node.shutdown().await;
}
