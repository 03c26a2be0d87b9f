//! A resume after the run's dataset files changed: the node restores the sampler's position
//! only for the domains whose data is the one the checkpoint's position was taken in. A file
//! rewritten with as many rows used to be resumed at the old file's position (rows skipped,
//! others served twice), a file with another row count refused the resume, and so did a
//! domain added to or removed from `data.datasets`.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use sluice_data::config::{BadLinePolicy, DatasetSpec};
use sluice_data::{Dataset, DomainSampler, SamplerConfig};
use sluice_node::{Node, NodeOptions};

use crate::common;

/// Writes `rows` rows of `domain::name` under `data`, each input tagged `tag`.
fn write_jsonl(data: &Path, spec: &str, rows: usize, tag: &str) {
    let spec: DatasetSpec = spec.parse().unwrap();
    let path = sluice_data::dataset_path(data, &spec);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let text: String = (0..rows)
        .map(|i| format!("{{\"id\": \"{i}\", \"input\": {{\"q\": \"{tag} {i}\"}}}}\n"))
        .collect();
    std::fs::write(path, text).unwrap();
}

/// The sampler of `specs`, read from their files under `data` as a run loads them.
fn source(data: &Path, specs: &[&str]) -> Box<DomainSampler> {
    let datasets = specs
        .iter()
        .map(|s| Dataset::load(data, &s.parse().unwrap(), BadLinePolicy::Fail).unwrap())
        .collect();
    Box::new(DomainSampler::new(SamplerConfig::new(3), datasets).unwrap())
}

fn options(dir: &Path, source: Box<DomainSampler>) -> NodeOptions {
    NodeOptions {
        replay_dir: Some(dir.join("replay")),
        checkpoint_dir: Some(dir.join("checkpoint")),
        source: Some(source),
        ..NodeOptions::default()
    }
}

/// `(epoch, cursor)` of `domain` in a sampler state.
fn at(state: &Value, domain: &str) -> (u64, u64) {
    let c = &state["rows"][domain];
    (c["epoch"].as_u64().unwrap(), c["cursor"].as_u64().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_starts_afresh_only_the_domains_whose_data_changed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    for spec in ["math::a", "code::b"] {
        write_jsonl(&data, spec, 40, "v1");
    }
    let mut config = common::config("max_version_lag = 2", "time_scale = 1.0");
    config.run.max_steps = std::num::NonZeroU64::new(1000).unwrap();

    // Run 1 draws from both, and stops with a checkpoint.
    let node = Node::start(
        &config,
        options(dir.path(), source(&data, &["math::a", "code::b"])),
    )
    .await
    .unwrap();
    common::wait_for_status(&node, "progress", Duration::from_secs(60), |s| {
        s.trainer.steps >= 2
    })
    .await;
    let report = node.stop_gracefully().await;
    assert!(report.error.is_none(), "{report:#?}");
    let saved = report.checkpoint.unwrap().sampler.unwrap();
    assert_ne!(at(&saved, "math"), (0, 0));
    assert_ne!(at(&saved, "code"), (0, 0));

    // `math` rewritten with as many rows, `code` as it was, `chat` added; run 2 starts paused
    // so the positions are the restored ones.
    write_jsonl(&data, "math::a", 40, "v2");
    write_jsonl(&data, "chat::c", 5, "v1");
    let mut paused = common::config("max_version_lag = 2\npaused = true", "time_scale = 1.0");
    paused.run.max_steps = config.run.max_steps;
    let specs = ["math::a", "code::b", "chat::c"];
    let node = Node::start(&paused, options(dir.path(), source(&data, &specs)))
        .await
        .expect("a resume with changed datasets starts");
    let state = node.handles.sampler.state().await.unwrap();
    assert_eq!(at(&state, "math"), (0, 0), "changed: afresh");
    assert_eq!(at(&state, "code"), at(&saved, "code"), "unchanged: kept");
    assert_eq!(at(&state, "chat"), (0, 0), "added: afresh");
    node.shutdown().await;

    // Without `chat` again, and `code` with other rows: still starts.
    write_jsonl(&data, "code::b", 41, "v1");
    let node = Node::start(
        &paused,
        options(dir.path(), source(&data, &["math::a", "code::b"])),
    )
    .await
    .expect("a resume with a domain removed starts");
    let state = node.handles.sampler.state().await.unwrap();
    assert_eq!(at(&state, "code"), (0, 0), "another row count: afresh");
    node.shutdown().await;
}
