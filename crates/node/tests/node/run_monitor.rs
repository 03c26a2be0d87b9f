//! The run monitor on a simulated node: it follows the trainer's step feed, logs every step once
//! and in order to `metrics.jsonl`, ends with `RunEnd::Done` at the budget, and `Node::finish`
//! marks the end with a `done` checkpoint; a restart continues the numbering and the log from
//! that checkpoint without repeating a step; a stop abandoned by a second signal still logs the
//! steps already trained.

use crate::common;

use std::num::NonZeroU64;

use sluice_actors::checkpoint::CheckpointDir;
use sluice_actors::trainer::STEP_FEED_CAPACITY;
use sluice_config::Config;
use sluice_node::run::{RunEnd, RunMonitor, Start};
use sluice_node::{Node, NodeOptions};
use sluice_report::keys as k;
use sluice_report::{MetricsLog, read_log};

/// Runs `config` to its end under a monitor; returns how it ended and the step it started at.
async fn run(config: &Config, dir: &std::path::Path) -> (RunEnd, u64) {
    let (feed, steps) = tokio::sync::mpsc::channel(STEP_FEED_CAPACITY);
    let options = NodeOptions {
        replay_dir: Some(dir.join("replay")),
        checkpoint_dir: Some(dir.join("checkpoint")),
        step_feed: Some(feed),
        ..NodeOptions::default()
    };
    let node = Node::start(config, options).await.unwrap();
    let first = node.start_step();
    let log = MetricsLog::resume(dir.join("metrics.jsonl"), first).unwrap();
    let start = Start {
        step: first,
        wall_s: log.last().map_or(0.0, |r| r.wall_s),
        ..Start::default()
    };
    let mut monitor = RunMonitor::new(
        config,
        std::time::Instant::now(),
        start,
        steps,
        Some(log),
        None,
    );
    let mut looks = 0;
    let end = monitor.watch(&node, |_| looks += 1).await.unwrap();
    assert!(looks > 0, "progress is reported");
    node.finish(&end).await;
    node.shutdown().await;
    monitor.record_remaining().unwrap();
    assert_eq!(monitor.summary().steps, config.run.max_steps.get());
    (end, first)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_monitor_logs_every_step_once_and_a_restart_continues_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = common::config("", "time_scale = 0.05");
    config.run.max_steps = NonZeroU64::new(6).unwrap();
    let (end, first) = run(&config, dir.path()).await;
    assert_eq!((end, first), (RunEnd::Done, 0));
    let (_, manifest) = CheckpointDir::new(dir.path().join("checkpoint"))
        .load()
        .unwrap()
        .expect("the end is a checkpoint");
    assert_eq!((manifest.reason.as_str(), manifest.steps), ("done", 6));
    let records = read_log(dir.path().join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = records.iter().map(|r| r.step).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    for r in &records {
        assert_eq!(r.policy_version.map(|v| v.0), Some(r.step), "{r:?}");
        assert!(r.extra.contains_key("trained_reward_mean"), "{r:?}");
    }
    // What the rollouts look like reaches the log once the monitor has seen the controller's
    // figures (from its second look on): lengths, group times and their split, truncation.
    let last = records.last().unwrap();
    for key in [
        k::LENGTH_TRAINED_MEAN,
        k::LENGTH_GENERATED_MEAN,
        k::LENGTH_BIAS,
        k::TIME_GROUP_SECONDS,
        k::TIME_ENGINE_SECONDS,
        k::TIME_ENV_SECONDS,
        k::TRUNCATED_RATIO,
    ] {
        assert!(last.extra.contains_key(key), "{key} missing: {last:?}");
    }
    let (group, engine) = (
        last.extra[k::TIME_GROUP_SECONDS],
        last.extra[k::TIME_ENGINE_SECONDS],
    );
    assert!(
        group > 0.0 && engine <= group,
        "group {group} s, engine {engine} s"
    );

    // The same run with a larger budget resumes at step 6 and logs steps 7..=10 after them.
    config.run.max_steps = NonZeroU64::new(10).unwrap();
    let (end, first) = run(&config, dir.path()).await;
    assert_eq!((end, first), (RunEnd::Done, 6));
    let records = read_log(dir.path().join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = records.iter().map(|r| r.step).collect();
    assert_eq!(steps, (1..=10).collect::<Vec<_>>());
    assert!(
        records.windows(2).all(|w| w[0].wall_s <= w[1].wall_s),
        "wall time continues across the restart"
    );
}

/// A stop abandoned by a second signal still logs every step the trainer sent: the watch stops
/// logging when the stop begins, a periodic checkpoint may then take steps the log has not,
/// and a resume from it would never log them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_stop_logs_the_steps_already_trained() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = common::config("", "time_scale = 0.05");
    config.run.max_steps = NonZeroU64::new(100_000).unwrap();
    config.run.output_dir = dir.path().to_owned();
    config.replay.path = dir.path().join("replay");
    config.metrics.enabled = false;
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    let mut run = sluice_node::run::prepare(&config, |_| {})
        .await
        .unwrap()
        .start(&config)
        .await
        .unwrap();
    let watched = run
        .watch(|_| {}, async {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        })
        .await;
    assert!(matches!(watched, sluice_node::run::Watched::StopAsked));
    let logged = read_log(dir.path().join("metrics.jsonl")).unwrap().len() as u64;
    // The trainer trains on after the watch ended: two more steps reach the feed.
    let trained = common::wait_for_status(
        run.node(),
        "two more steps",
        std::time::Duration::from_secs(30),
        |s| s.trainer.steps >= logged + 3,
    )
    .await
    .trainer
    .steps;
    let finished = run.finish(watched, std::future::ready(())).await.unwrap();
    assert!(matches!(
        finished.ending,
        sluice_node::run::Ending::Abandoned
    ));
    let rows = read_log(dir.path().join("metrics.jsonl")).unwrap();
    let last = rows.last().map_or(0, |r| r.step);
    assert!(
        last + 1 >= trained,
        "the log ends at step {last}, the trainer had trained {trained} (logged {logged} when the watch ended)"
    );
}
