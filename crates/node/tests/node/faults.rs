//! Injected faults (`[faults]`): the run goes on (or, for the trainer, stops cleanly with a
//! checkpoint) and the sample counts reconcile: every admitted group is in exactly one bucket,
//! consumed = trained (+ the batch of a failed step), no token past η, nothing trained twice.
//! The reconciled numbers are printed (`cargo test -- --nocapture`).

use crate::common;

use std::time::Duration;

use sluice_actors::checkpoint::CheckpointDir;
use sluice_config::Config;
use sluice_node::{Node, NodeOptions, NodeStatus};

fn config(max_steps: u64) -> Config {
    let rollout = "weight_update_mode = \"abort_resume\"\nenable_partial_rollout = true\nmax_version_lag = 2\nstaleness_threshold = 1.0";
    let mut config = common::config(rollout, "time_scale = 1.0");
    config.run.max_steps = std::num::NonZeroU64::new(max_steps).unwrap();
    config.supervision.restart_backoff_initial = Duration::from_millis(5);
    config.supervision.restart_backoff_max = Duration::from_millis(100);
    config
}

/// Admitted = sum of the buckets; consumed = trained + failed-step groups; prints the numbers.
fn reconcile(name: &str, s: &NodeStatus) {
    let c = &s.replay.counters;
    let b = &s.replay.buckets;
    let in_buckets: u64 = b.values().sum();
    println!(
        "{name}: admitted {} = {} in buckets {:?}; consumed {} = trained {} + failed step {}; restarts {:?}",
        c.admitted_total,
        in_buckets,
        b,
        c.consumed_total,
        s.trainer.trained_groups,
        s.trainer.failed_groups,
        s.engine_health
            .iter()
            .map(|h| (h.restarts, h.failures.clone(), h.last_restart_seconds))
            .collect::<Vec<_>>(),
    );
    assert_eq!(in_buckets, c.admitted_total, "{name}: {s:#?}");
    assert_eq!(
        c.consumed_total,
        s.trainer.trained_groups + s.trainer.failed_groups,
        "{name}"
    );
    assert_eq!(s.trainer.lag_violations, 0, "{name}");
    assert_eq!(s.trainer.duplicate_groups, 0, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashing_engine_replicas_are_restarted_and_the_run_finishes() {
    let mut config = config(8);
    config.faults.engine_crash_every_requests = 40;
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    let s = node
        .wait_done(Duration::from_secs(120), |_| {})
        .await
        .unwrap();
    assert!(s.trainer.done && s.trainer.error.is_none(), "{s:#?}");
    reconcile("engine crash", &s);
    let restarts: u64 = s.engine_health.iter().map(|h| h.restarts).sum();
    // A crash shows as `crash` when the engine hears of it first, or as `error` when a call
    // into the dead replica fails first.
    let crashes: u64 = s
        .engine_health
        .iter()
        .flat_map(|h| h.failures.values())
        .sum();
    assert!(crashes > 0 && restarts > 0, "{:?}", s.engine_health);
    let returned: u64 = s.engine_health.iter().map(|h| h.requests_returned).sum();
    assert!(returned > 0, "a crash hands its requests back");
    assert!(
        s.replay
            .counters
            .transitions
            .get(&"in_flight->aborted".parse().unwrap())
            .copied()
            > Some(0),
        "their groups went to the aborted bucket"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_restarts_a_hung_replica() {
    let mut config = config(6);
    config.faults.engine_hang_every_requests = 25;
    config.supervision.engine_watchdog = Some(Duration::from_millis(300));
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    let s = node
        .wait_done(Duration::from_secs(120), |_| {})
        .await
        .unwrap();
    assert!(s.trainer.done, "{s:#?}");
    reconcile("engine hang", &s);
    let watchdog: u64 = s
        .engine_health
        .iter()
        .filter_map(|h| h.failures.get("watchdog"))
        .sum();
    assert!(watchdog > 0, "{:?}", s.engine_health);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_trainer_step_stops_the_run_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(100);
    config.faults.trainer_error_at_step = 3;
    let options = || NodeOptions {
        replay_dir: Some(dir.path().join("replay")),
        checkpoint_dir: Some(dir.path().join("checkpoint")),
        ..NodeOptions::default()
    };
    let node = Node::start(&config, options()).await.unwrap();
    let s = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .unwrap();
    let error = s.trainer.error.clone().expect("the step failed");
    assert!(error.contains("injected_trainer_error"), "{error}");
    assert_eq!(s.trainer.steps, 2, "the trainer stopped instead of looping");
    assert_eq!(s.trainer.failed_groups, 4);
    let m = s.checkpoint.clone().expect("a checkpoint on the way out");
    assert_eq!(
        (m.reason.as_str(), m.steps, m.version),
        ("trainer_error", 2, 2)
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let later = node.status().await.unwrap();
    assert_eq!(later.trainer.steps, 2, "no step after the failure");
    let last = node.shutdown().await.unwrap();
    let mut s = s;
    s.replay = last.store;
    reconcile("trainer error", &s);

    // A restart resumes from that checkpoint (the fault is still configured, but counts steps
    // of this process: the 3rd step of the new process fails again, after two good ones).
    let node = Node::start(&config, options()).await.unwrap();
    let s = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .unwrap();
    assert_eq!(s.trainer.steps, 4);
    assert_eq!(s.trainer.version.0, 4);
    node.shutdown().await;
    let (_, m) = CheckpointDir::new(dir.path().join("checkpoint"))
        .load()
        .unwrap()
        .unwrap();
    assert_eq!((m.steps, m.version), (4, 4));
}

/// Runs `config` to its step budget and returns the final status with the rollouts that ended
/// with `status`, after checking the counts reconcile.
async fn run_env_fault(name: &str, config: &Config, status: &str) -> (NodeStatus, u64) {
    let node = Node::start(config, NodeOptions::default()).await.unwrap();
    let s = node
        .wait_done(Duration::from_secs(120), |_| {})
        .await
        .unwrap();
    assert!(
        s.trainer.done && s.trainer.error.is_none(),
        "{name}: {s:#?}"
    );
    let last = node.shutdown().await.unwrap();
    let mut s = s;
    s.replay = last.store;
    reconcile(name, &s);
    assert_eq!(s.trainer.steps, config.run.max_steps.get(), "{name}");
    let by_status = &s.controller.finished_by_status;
    println!(
        "{name}: finished rollouts {} by status {by_status:?}",
        s.controller.finished_rollouts
    );
    assert_eq!(
        by_status.values().sum::<u64>(),
        s.controller.finished_rollouts,
        "{name}: every finished rollout is counted under one status"
    );
    let n = by_status.get(status).copied().unwrap_or(0);
    (s, n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_env_step_fails_its_rollout_and_the_run_goes_on() {
    let mut config = config(6);
    config.faults.env_panic_every_steps = 7;
    let (s, errors) = run_env_fault("env panic", &config, "error").await;
    assert!(errors > 0, "{:?}", s.controller.finished_by_status);
    let finished: u64 = s.controller.finished_by_status.values().sum();
    assert!(errors < finished, "the other rollouts finish normally");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_env_step_times_out_and_the_run_goes_on() {
    let mut config = config(6);
    config.faults.env_hang_every_steps = 9;
    config.supervision.env_step_timeout = Duration::from_millis(200);
    let (s, timeouts) = run_env_fault("env hang", &config, "timeout").await;
    assert!(timeouts > 0, "{:?}", s.controller.finished_by_status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_reward_fails_its_rollout_and_the_run_goes_on() {
    let mut config = config(6);
    config.faults.reward_panic_every_episodes = 5;
    let (s, errors) = run_env_fault("reward panic", &config, "error").await;
    assert!(errors > 0, "{:?}", s.controller.finished_by_status);
}
