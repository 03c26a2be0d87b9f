//! Shared helpers of the pipeline tests: a fast simulated config, invariant checks, a wait on the
//! node's status that wakes on its run events, and [`Recorded`] callbacks to wait on.

#![allow(dead_code)]

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sluice_config::Config;
use sluice_config::SimTrainerConfig;
use sluice_core::{
    BackendError, PolicyVersion, RolloutGroup, TrainStepOutput, TrainerBackend, WeightSnapshot,
};
use sluice_node::{Node, NodeStatus};
use sluice_trainer::SimTrainer;
use tokio::sync::watch;

/// Every batch a [`RecordingTrainer`] trained on, with the version it trained from.
pub type Batches = Arc<Mutex<Vec<(PolicyVersion, Vec<RolloutGroup>)>>>;

/// A simulated trainer that keeps every batch it trained on, with the version it trained from.
pub struct RecordingTrainer {
    inner: SimTrainer,
    /// (weights version the batch trained from, the batch).
    pub batches: Batches,
}

impl RecordingTrainer {
    /// A recording trainer with a 2 ms step.
    pub fn new() -> (Self, Batches) {
        let cfg = SimTrainerConfig {
            enabled: true,
            step_base_seconds: 0.002,
            step_seconds_per_token: 0.0,
        };
        let batches = Arc::default();
        (
            Self {
                inner: SimTrainer::new(&cfg, 1.0),
                batches: Arc::clone(&batches),
            },
            batches,
        )
    }
}

impl TrainerBackend for RecordingTrainer {
    fn version(&self) -> PolicyVersion {
        self.inner.version()
    }
    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError> {
        self.batches
            .lock()
            .unwrap()
            .push((self.inner.version(), batch.to_vec()));
        self.inner.train_step(batch)
    }
    fn snapshot(&self) -> WeightSnapshot {
        self.inner.snapshot()
    }
    fn checkpoint(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.inner.checkpoint(dir)
    }
    fn restore(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.inner.restore(dir)
    }
}

/// A small, fast simulated pipeline; `extra` is appended (later keys win via sections given once).
pub fn config(rollout_extra: &str, sim_extra: &str) -> Config {
    let text = format!(
        r#"
[run]
name = "test"
max_steps = 6
seed = 7

[engine]
backend = "simulated"
max_running_sequences = 16
replicas = 2

[engine.simulated]
prompt_tokens = 8
env_reply_tokens = 2
decode_step_base_seconds = 0.0005
decode_step_per_sequence_seconds = 0.0
prefill_seconds_per_token = 0.0
{sim_extra}

[engine.simulated.lengths.default]
distribution = "uniform"
min = 20
max = 240

[trainer.simulated]
step_base_seconds = 0.002
step_seconds_per_token = 0.0

[rollout]
group_size = 3
groups_per_step = 4
max_new_tokens = 64
{rollout_extra}

[replay]
filter_zero_advantage = false
"#
    );
    sluice_config::parse(&text, "test.toml", &[], &|_| None).expect("test config is valid")
}

/// The invariants every run must keep.
pub fn check_invariants(status: &NodeStatus) {
    let t = &status.trainer;
    assert_eq!(
        t.lag_violations, 0,
        "trained tokens older than η: {status:#?}"
    );
    assert_eq!(t.duplicate_groups, 0, "a group was trained twice");
    let c = &status.replay.counters;
    let buckets: u64 = status.replay.buckets.values().sum();
    assert_eq!(
        buckets, c.admitted_total,
        "every admitted group is in exactly one bucket: {:?}",
        status.replay
    );
    assert_eq!(
        status.replay.buckets[&sluice_replay::Bucket::Consumed],
        t.trained_groups,
        "consumed = trained"
    );
}

/// How often [`wait_for_status`] reads the status again when no run event came: admissions and
/// bucket moves announce nothing (only steps, the trainer's end and actors ending do).
const RECHECK: Duration = Duration::from_millis(20);

/// Waits until `ok` holds for the node's status and returns that status: it reads the status
/// again at each run event (a step trained, the trainer finished or failed, an actor ended) and,
/// for changes no event announces, at least every [`RECHECK`]. Panics naming `what`, with the
/// last status, when `timeout` passes first.
pub async fn wait_for_status(
    node: &Node,
    what: &str,
    timeout: Duration,
    mut ok: impl FnMut(&NodeStatus) -> bool,
) -> NodeStatus {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut events = node.handles.events.subscribe();
    loop {
        events.borrow_and_update();
        let status = node.status().await.expect("the node answers its status");
        if ok(&status) {
            return status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}: {status:#?}"
        );
        // A run event wakes it at once; the recheck covers what no event announces.
        let _ = tokio::time::timeout(RECHECK, events.changed()).await;
    }
}

/// What an actor's callbacks recorded (reports, submissions, builds), with a watch bumped at
/// every record, so a test waits for a condition on it instead of polling.
pub struct Recorded<T> {
    items: Mutex<Vec<T>>,
    pushed: watch::Sender<usize>,
}

impl<T> Default for Recorded<T> {
    fn default() -> Self {
        Self {
            items: Mutex::default(),
            pushed: watch::Sender::new(0),
        }
    }
}

impl<T> Recorded<T> {
    /// Records `item` and wakes the waiters.
    pub fn push(&self, item: T) {
        self.items.lock().unwrap().push(item);
        self.pushed.send_modify(|n| *n += 1);
    }

    /// What was recorded so far.
    pub fn lock(&self) -> MutexGuard<'_, Vec<T>> {
        self.items.lock().unwrap()
    }

    /// Waits (at most 30 s of the runtime's clock; panics naming `what` past them) until `ok`
    /// holds for what is recorded.
    pub async fn until(&self, what: &str, mut ok: impl FnMut(&[T]) -> bool) {
        let mut pushed = self.pushed.subscribe();
        let waited = tokio::time::timeout(Duration::from_secs(30), async {
            while !ok(&self.lock()) {
                pushed.changed().await.expect("the sender lives in `self`");
            }
        })
        .await;
        assert!(waited.is_ok(), "timed out waiting for {what}");
    }
}
