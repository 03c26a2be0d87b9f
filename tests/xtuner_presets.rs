//! The five rows of the XTuner strategy table (seed 004), shipped as `configs/xtuner_*.toml`,
//! each run through the simulated pipeline (shrunk with overrides so it takes about a second) and
//! checked for the features its row lists.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_config::{Override, SimTrainerConfig};
use sluice_core::{
    BackendError, PolicyVersion, RolloutGroup, TrainStepOutput, TrainerBackend, WeightSnapshot,
};
use sluice_node::{Node, NodeOptions, NodeStatus};
use sluice_trainer::SimTrainer;

type Batches = Arc<Mutex<Vec<RolloutGroup>>>;

struct Recording(SimTrainer, Batches);

impl TrainerBackend for Recording {
    fn version(&self) -> PolicyVersion {
        self.0.version()
    }
    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError> {
        self.1.lock().unwrap().extend_from_slice(batch);
        self.0.train_step(batch)
    }
    fn snapshot(&self) -> WeightSnapshot {
        self.0.snapshot()
    }
    fn checkpoint(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.0.checkpoint(dir)
    }
    fn restore(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.0.restore(dir)
    }
}

struct Outcome {
    status: NodeStatus,
    groups: Vec<RolloutGroup>,
}

const B: u64 = 2;

/// Steps for the tail-batch presets: a tail round needs `trigger_size` rollouts aborted
/// `candidate_steps + 1` times, which on a loaded machine can take more than 40 simulated steps.
const TAIL_STEPS: u64 = 120;

async fn run_preset(name: &str, steps: u64) -> Outcome {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs")
        .join(format!("{name}.toml"));
    let overrides: Vec<Override> = [
        format!("run.max_steps={steps}"),
        format!("rollout.groups_per_step={B}"),
        "rollout.group_size=4".into(),
        "engine.max_running_sequences=8".into(),
        "engine.simulated.time_scale=0.02".into(),
        "metrics.enabled=false".into(),
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let config = sluice_config::load(&path, &overrides).unwrap();
    let batches: Batches = Arc::default();
    let cfg = SimTrainerConfig {
        enabled: true,
        step_base_seconds: 0.5,
        step_seconds_per_token: 0.0,
    };
    let trainer = Recording(SimTrainer::new(&cfg, 0.02), Arc::clone(&batches));
    let options = NodeOptions {
        trainer: Some(Box::new(trainer)),
        track_ids: true,
        ..NodeOptions::default()
    };
    let node = Node::start(&config, options).await.unwrap();
    let status = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .unwrap();
    node.shutdown().await;
    assert_eq!(status.trainer.lag_violations, 0, "{name}: trained past η");
    assert_eq!(
        status.trainer.duplicate_groups, 0,
        "{name}: trained a group twice"
    );
    let groups = batches.lock().unwrap().clone();
    Outcome { status, groups }
}

fn turns(
    groups: &[RolloutGroup],
) -> impl Iterator<Item = (&sluice_core::Rollout, &sluice_core::RolloutTurn)> {
    groups
        .iter()
        .flat_map(|g| g.rollouts.iter())
        .flat_map(|r| r.turns.iter().map(move |t| (r, t)))
}

fn transitions(s: &NodeStatus, key: &str) -> u64 {
    let key = key.parse().expect("a transition written from->to");
    s.replay
        .counters
        .transitions
        .get(&key)
        .copied()
        .unwrap_or(0)
}

/// Over-sending: never more than `ceil(1.2 · B)` groups in flight, and that bound is reached.
fn check_over_sending(s: &NodeStatus) {
    let bound = (1.2 * B as f64).ceil() as u64;
    assert!(
        s.controller.max_in_flight <= bound,
        "{} groups in flight > {bound}",
        s.controller.max_in_flight
    );
    assert_eq!(
        s.controller.max_in_flight, bound,
        "20% over-sending was never used"
    );
}

/// Aborted samples are scheduled again (before fresh data: the controller's queue order).
fn check_aborted_resumed(s: &NodeStatus) {
    assert!(
        transitions(s, "in_flight->aborted") > 0,
        "nothing was aborted: {:?}",
        s.replay.counters.transitions
    );
    assert!(
        transitions(s, "aborted->in_flight") > 0,
        "aborted groups were never resumed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_strategy_never_over_sends() {
    let o = run_preset("xtuner_sync", 4).await;
    assert!(
        o.status.controller.max_in_flight <= B,
        "sync over-sent: {}",
        o.status.controller.max_in_flight
    );
    assert_eq!(
        o.status.trainer.max_lag, 0,
        "sync trains only on-policy tokens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_1_over_sends_and_discards_partials() {
    let o = run_preset("xtuner_async1", 8).await;
    check_over_sending(&o.status);
    check_aborted_resumed(&o.status);
    for (r, t) in turns(&o.groups) {
        assert_eq!(
            t.min_version(),
            t.max_version(),
            "{}: a partial was kept",
            r.id
        );
    }
    assert_eq!(o.status.controller.tail_rounds, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_2_adds_the_tail_batch() {
    let o = run_preset("xtuner_async2", TAIL_STEPS).await;
    check_over_sending(&o.status);
    check_aborted_resumed(&o.status);
    let c = &o.status.controller;
    assert!(c.tail_rounds > 0, "no tail round: {c:?}");
    assert!(
        c.tail_round_min_size >= B,
        "tail rounds start at the trigger size (= groups_per_step)"
    );
    assert_eq!(c.admitted_during_tail, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_3_keeps_and_concatenates_partials() {
    let o = run_preset("xtuner_async3", 8).await;
    check_over_sending(&o.status);
    check_aborted_resumed(&o.status);
    let spanning = turns(&o.groups)
        .filter(|(r, t)| r.abort_count > 0 && t.min_version() != t.max_version())
        .count();
    assert!(spanning > 0, "no trained turn was resumed across an update");
    assert_eq!(o.status.controller.tail_rounds, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_4_keeps_partials_and_runs_the_tail_batch() {
    let o = run_preset("xtuner_async4", TAIL_STEPS).await;
    check_over_sending(&o.status);
    check_aborted_resumed(&o.status);
    let spanning = turns(&o.groups)
        .filter(|(r, t)| r.abort_count > 0 && t.min_version() != t.max_version())
        .count();
    assert!(spanning > 0, "no trained turn was resumed across an update");
    assert!(
        o.status.controller.tail_rounds > 0,
        "no tail round: {:#?}",
        o.status
    );
    assert_eq!(o.status.controller.admitted_during_tail, 0);
}
