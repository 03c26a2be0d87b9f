//! Runs that keep going, or stop loudly: skipped training steps do not shrink admission, an
//! engine that cannot serve stops the run (seed 002: infrastructure errors are not bad
//! rollouts), a panicking trainer step is seen at once, and a resumed rollout goes back to the
//! replica that served it, through the controller.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_actors::ActorError;
use sluice_actors::engine::BackendFactory;
use sluice_config::Config;
use sluice_core::{RequestId, RolloutId, WeightSnapshot, WeightUpdateMode};
use sluice_engine::simulated::SimEngineParams;
use sluice_engine::{EngineError, EngineStats, GenerateRequest, InferenceBackend, SimEngine};
use sluice_node::{Node, NodeOptions};

fn config(max_steps: u64, rollout: &str) -> Config {
    let mut config = common::config(rollout, "time_scale = 1.0");
    config.run.max_steps = std::num::NonZeroU64::new(max_steps).unwrap();
    config.supervision.restart_backoff_initial = Duration::from_millis(5);
    config.supervision.restart_backoff_max = Duration::from_millis(50);
    config
}

/// A node whose replay store and checkpoints live under `dir`.
fn durable(dir: &std::path::Path) -> NodeOptions {
    NodeOptions {
        replay_dir: Some(dir.join("replay")),
        checkpoint_dir: Some(dir.join("checkpoint")),
        ..NodeOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skipped_steps_release_their_groups_and_training_goes_on() {
    // η = 1: two skipped steps in a row would close admission for good if consumed groups
    // still counted against `(v + η + 1) · B`.
    let mut config = config(12, "max_version_lag = 1");
    config.faults.trainer_skip_every_steps = 2;
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    let s = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .expect("the run finishes although every other step is skipped");
    assert!(s.trainer.done, "{s:#?}");
    assert_eq!(s.trainer.steps, 12);
    assert_eq!(s.trainer.skipped_steps, 6);
    assert_eq!(s.trainer.version.0, 6, "skipped steps publish nothing");
    assert_eq!(
        s.trainer.trained_samples,
        6 * 4 * 3,
        "only the steps that trained count their rollouts"
    );
    let c = &s.replay.counters;
    assert_eq!(c.skipped_total, 6 * 4, "{c:?}");
    assert_eq!(c.consumed_total, 12 * 4);
    common::check_invariants(&s);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_keeps_failing_stops_the_run_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(100, "max_version_lag = 1");
    config.faults.engine_crash_every_requests = 1;
    config.supervision.engine_max_restarts = 3;
    let options = durable(dir.path());
    let node = Node::start(&config, options).await.unwrap();
    let err = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .expect_err("the run stops");
    let ActorError::EngineUnavailable(reason) = &err else {
        panic!("expected the engine to give up, got {err}")
    };
    assert!(
        reason.contains("failed 4 times in a row") && reason.contains("engine_max_restarts"),
        "{reason}"
    );
    assert!(
        reason.contains("engine replica "),
        "names the replica: {reason}"
    );
    let s = node.status().await.unwrap();
    assert_eq!(s.engine_failure.as_deref(), Some(reason.as_str()));
    let m = s.checkpoint.expect("a checkpoint on the way out");
    assert_eq!(m.reason, "engine_failure");
    // No rollout was turned into a failure: the requests came back aborted, not errored.
    assert_eq!(
        s.replay.buckets[&sluice_replay::Bucket::Failed],
        0,
        "{:?}",
        s.replay
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_replica_for_the_timeout_stops_the_run() {
    let mut config = config(100, "max_version_lag = 1");
    config.engine.replicas = std::num::NonZeroU32::new(1).unwrap();
    config.faults.engine_crash_every_requests = 1;
    config.supervision.engine_max_restarts = 0;
    // The replica stays down far longer than the run is willing to wait.
    config.supervision.restart_backoff_initial = Duration::from_secs(60);
    config.supervision.restart_backoff_max = Duration::from_secs(60);
    config.supervision.engine_unavailable_timeout = Some(Duration::from_millis(300));
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    let err = node
        .wait_done(Duration::from_secs(30), |_| {})
        .await
        .expect_err("the run stops");
    let ActorError::EngineUnavailable(reason) = &err else {
        panic!("expected the engine to give up, got {err}")
    };
    assert!(
        reason.contains("no engine replica could serve") && reason.contains("replica 0"),
        "{reason}"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_trainer_step_fails_the_run_at_once_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(100, "max_version_lag = 1");
    config.faults.trainer_panic_at_step = 3;
    config.supervision.checkpoint_every_steps = 1;
    let options = durable(dir.path());
    let node = Node::start(&config, options).await.unwrap();
    let s = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .unwrap();
    let error = s
        .trainer
        .error
        .clone()
        .expect("the panic is the trainer's error");
    assert!(
        error.contains("panicked") && error.contains("trainer_panic_at_step"),
        "{error}"
    );
    assert_eq!(s.trainer.steps, 2);
    // The panicked trainer's state is unknown, so it is not checkpointed: the checkpoint a
    // restart uses is a periodic one from before the panic (step 2's, or step 1's when step
    // 2's request reached the trainer only after the panic).
    let m = s.checkpoint.expect("a periodic checkpoint");
    assert!((1..=2).contains(&m.steps) && m.version == m.steps, "{m:?}");
    assert_ne!(m.reason, "trainer_error", "{m:?}");
    node.shutdown().await;
}

/// Request ids each replica received, with whether they resumed a partial.
type Served = Arc<Mutex<Vec<(u32, RequestId, bool)>>>;

/// A simulated replica that records what it is asked to generate.
struct Recording {
    inner: SimEngine,
    replica: u32,
    served: Served,
}

impl InferenceBackend for Recording {
    fn submit(&self, request: GenerateRequest) -> Result<(), EngineError> {
        let resumed = request.resume.is_some();
        self.served
            .lock()
            .unwrap()
            .push((self.replica, request.id, resumed));
        self.inner.submit(request)
    }
    fn abort(&self, id: RequestId) -> Result<(), EngineError> {
        self.inner.abort(id)
    }
    fn abort_all(&self) -> Result<(), EngineError> {
        self.inner.abort_all()
    }
    fn update_weights(&self, w: WeightSnapshot, mode: WeightUpdateMode) -> Result<(), EngineError> {
        self.inner.update_weights(w, mode)
    }
    fn stats(&self) -> EngineStats {
        self.inner.stats()
    }
    fn is_alive(&self) -> bool {
        self.inner.is_alive()
    }
    fn shutdown(&mut self) {
        self.inner.shutdown();
    }
    fn server_gone(&self) -> Option<String> {
        None
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_rollouts_go_back_to_the_replica_that_served_them() {
    let config = config(
        10,
        "weight_update_mode = \"abort_resume\"\nenable_partial_rollout = true\nmax_version_lag = 2\nstaleness_threshold = 1.0",
    );
    let served: Served = Arc::default();
    let factory: BackendFactory = {
        let served = Arc::clone(&served);
        let sim = config.engine.simulated.clone();
        let cap = config.engine.max_running_sequences.get();
        Arc::new(move |replica, version, sink| {
            let params = SimEngineParams {
                replica,
                max_running_sequences: cap,
                sim: sim.clone(),
            };
            Box::new(Recording {
                inner: SimEngine::start(params, version, sink),
                replica,
                served: Arc::clone(&served),
            }) as Box<dyn InferenceBackend>
        })
    };
    let options = NodeOptions {
        backend: Some(factory.into()),
        ..NodeOptions::default()
    };
    let node = Node::start(&config, options).await.unwrap();
    let s = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .unwrap();
    common::check_invariants(&s);
    node.shutdown().await;

    let served = served.lock().unwrap();
    // Each rollout's requests in the order they reached a replica: a resumed one (it carries
    // its partial) must go where the previous attempt ran. A group regenerated from its prompt
    // (expired) starts over and may go anywhere.
    let mut last: BTreeMap<RolloutId, u32> = BTreeMap::new();
    let (mut resumed, mut moved) = (0, Vec::new());
    for (replica, id, is_resume) in served.iter() {
        if *is_resume {
            resumed += 1;
            if last.get(&id.rollout) != Some(replica) {
                moved.push((*id, last.get(&id.rollout).copied(), *replica));
            }
        }
        last.insert(id.rollout, *replica);
    }
    assert!(
        resumed > 10,
        "the run aborted and resumed rollouts: {resumed}"
    );
    let both: BTreeSet<u32> = served.iter().map(|(r, _, _)| *r).collect();
    assert_eq!(both.len(), 2, "both replicas served");
    assert!(
        moved.is_empty(),
        "{} of {resumed} resumed requests went to another replica than their last attempt: {:?}",
        moved.len(),
        moved.iter().take(5).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_every_rollout_fails_stops_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(100, "max_version_lag = 1");
    config.faults.env_panic_every_steps = 1;
    config.supervision.no_progress_groups = 12;
    let options = durable(dir.path());
    let node = Node::start(&config, options).await.unwrap();
    let err = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .expect_err("the run stops instead of looping at step 0");
    let ActorError::NoProgress(reason) = &err else {
        panic!("expected no progress, got {err}")
    };
    assert!(
        reason.contains("no trainable group in the last 12 finished groups (12 failed"),
        "{reason}"
    );
    assert!(reason.contains("a sample error: env_panic"), "{reason}");
    let s = node.status().await.unwrap();
    assert_eq!(s.trainer.steps, 0);
    assert_eq!(
        s.checkpoint.map(|m| m.reason).as_deref(),
        Some("no_progress")
    );
    node.shutdown().await;
}
