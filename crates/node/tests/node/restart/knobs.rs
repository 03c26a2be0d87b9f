//! Runtime knobs across a restart: knobs patched over the admin API come back when the node
//! resumes from its checkpoint with the same config, the config wins for a knob whose value
//! was edited in the file since, the graceful stop's own pause is not taken for the operator's,
//! and a checkpoint written before knobs were recorded resumes on the config's values.

use std::path::Path;
use std::time::Duration;

use sluice_actors::checkpoint::MANIFEST;
use sluice_config::Config;
use sluice_node::client::request;
use sluice_node::{Node, NodeOptions};

use crate::common;

fn options(dir: &Path) -> NodeOptions {
    NodeOptions {
        replay_dir: Some(dir.join("replay")),
        checkpoint_dir: Some(dir.join("checkpoint")),
        serve_admin: true,
        ..NodeOptions::default()
    }
}

/// The run's config, with `staleness_threshold = staleness` in the file.
fn config(staleness: f64) -> Config {
    let rollout = format!(
        "max_version_lag = 2\nstaleness_threshold = {staleness}\nmax_concurrent_rollouts = 64"
    );
    let mut config = common::config(&rollout, "time_scale = 1.0");
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.token = Some(sluice_config::Secret::new("s3cret"));
    config.run.max_steps = std::num::NonZeroU64::new(1000).unwrap();
    config
}

async fn stop(node: Node) {
    let report = node.stop_gracefully().await;
    assert!(report.error.is_none(), "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn knobs_set_at_runtime_survive_a_restart_unless_the_config_was_edited_since() {
    let dir = tempfile::tempdir().unwrap();

    // Run 1: the operator tunes two knobs over HTTP, then the node is stopped.
    let node = Node::start(&config(1.0), options(dir.path()))
        .await
        .unwrap();
    let base = format!("http://{}", node.admin_addr().unwrap());
    let body = r#"{"staleness_threshold": 0.5, "max_concurrent_rollouts": 7}"#;
    let (code, text) = tokio::task::spawn_blocking(move || {
        request(&base, "PATCH", "/v1/knobs", Some(body), Some("s3cret")).unwrap()
    })
    .await
    .unwrap();
    assert_eq!(code, 200, "{text}");
    stop(node).await;

    // Run 2, the same config: both tuned values come back; the stop's pause does not.
    let node = Node::start(&config(1.0), options(dir.path()))
        .await
        .unwrap();
    let knobs = node.handles.knobs.current();
    assert_eq!(knobs.staleness_threshold, 0.5);
    assert_eq!(knobs.max_concurrent_rollouts, 7);
    assert!(
        !knobs.paused,
        "the graceful stop's pause is not the operator's"
    );
    assert_eq!(knobs.max_version_lag, 2);
    stop(node).await;

    // Run 3, `staleness_threshold` edited in the file since: the file wins for it, and the
    // other tuned knob still comes back.
    let node = Node::start(&config(2.0), options(dir.path()))
        .await
        .unwrap();
    let knobs = node.handles.knobs.current();
    assert_eq!(knobs.staleness_threshold, 2.0, "the edited config wins");
    assert_eq!(knobs.max_concurrent_rollouts, 7);
    stop(node).await;

    // A checkpoint written before knobs were recorded resumes on the config's values.
    let path = dir.path().join("checkpoint").join(MANIFEST);
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert!(manifest["knobs"]["runtime"].is_object(), "{manifest:#}");
    manifest.as_object_mut().unwrap().remove("knobs");
    std::fs::write(&path, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
    let node = Node::start(&config(2.0), options(dir.path()))
        .await
        .unwrap();
    let knobs = node.handles.knobs.current();
    assert_eq!(knobs.max_concurrent_rollouts, 64);
    assert_eq!(knobs.staleness_threshold, 2.0);
    tokio::time::timeout(Duration::from_secs(60), stop(node))
        .await
        .unwrap();
}
