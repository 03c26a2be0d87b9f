//! [`TappedTrainer`]: a [`TrainerBackend`] decorator that keeps what a run driver wants to see of
//! each step — the step's metrics, the mean reward and version lag of the batch it trained on,
//! and the newest published weights (for evaluation) — in a shared [`TrainerTap`].

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use sluice_core::{
    BackendError, PolicyVersion, RolloutGroup, TrainStepOutput, TrainerBackend, WeightSnapshot,
};

/// One step as the tap saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct TappedStep {
    /// 1-based step number of this process.
    pub step: u64,
    /// Version the step trained (the weights it started from).
    pub version: PolicyVersion,
    /// Mean final reward of the batch's rollouts.
    pub reward_mean: f64,
    /// Mean version lag of the batch's completion tokens against `version`.
    pub version_lag_mean: f64,
    /// Completion tokens trained.
    pub trained_tokens: u64,
    /// Seconds the step took.
    pub seconds: f64,
    /// The backend's own metrics (loss, clip fraction, entropy, …).
    pub metrics: BTreeMap<String, f64>,
}

/// What the tap holds.
#[derive(Debug, Default)]
pub struct TrainerTap {
    steps: Vec<TappedStep>,
    latest: Option<WeightSnapshot>,
}

impl TrainerTap {
    /// Steps not taken yet by [`TrainerTap::drain_steps`].
    pub fn drain_steps(&mut self) -> Vec<TappedStep> {
        std::mem::take(&mut self.steps)
    }

    /// The newest published weights.
    pub fn latest(&self) -> Option<WeightSnapshot> {
        self.latest.clone()
    }
}

/// Shared handle on a tap.
pub type TapHandle = Arc<Mutex<TrainerTap>>;

/// Locks a tap (a poisoned tap still holds consistent data: every update is one assignment).
pub fn lock_tap(tap: &TapHandle) -> std::sync::MutexGuard<'_, TrainerTap> {
    tap.lock().unwrap_or_else(|p| p.into_inner())
}

/// The decorator.
pub struct TappedTrainer {
    inner: Box<dyn TrainerBackend>,
    tap: TapHandle,
    steps: u64,
}

impl TappedTrainer {
    /// Wraps `inner`; its initial snapshot is the tap's first `latest`.
    pub fn new(inner: Box<dyn TrainerBackend>) -> (Self, TapHandle) {
        let tap = Arc::new(Mutex::new(TrainerTap {
            steps: Vec::new(),
            latest: Some(inner.snapshot()),
        }));
        (
            Self {
                inner,
                tap: Arc::clone(&tap),
                steps: 0,
            },
            tap,
        )
    }
}

/// Mean reward over rollouts and mean version lag over completion tokens of `batch`.
fn batch_means(batch: &[RolloutGroup], version: PolicyVersion) -> (f64, f64) {
    let (mut rewards, mut n) = (0.0, 0usize);
    let (mut lag, mut tokens) = (0u64, 0u64);
    for r in batch.iter().flat_map(|g| &g.rollouts) {
        rewards += r.reward;
        n += 1;
        for t in r.turns.iter().flat_map(|t| &t.token_versions) {
            lag += version.0.saturating_sub(t.0);
            tokens += 1;
        }
    }
    let mean = |sum: f64, count: f64| if count > 0.0 { sum / count } else { 0.0 };
    (mean(rewards, n as f64), mean(lag as f64, tokens as f64))
}

impl TrainerBackend for TappedTrainer {
    fn version(&self) -> PolicyVersion {
        self.inner.version()
    }

    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError> {
        let version = self.inner.version();
        let started = std::time::Instant::now();
        let out = self.inner.train_step(batch)?;
        self.steps += 1;
        let (reward_mean, version_lag_mean) = batch_means(batch, version);
        let mut tap = lock_tap(&self.tap);
        tap.steps.push(TappedStep {
            step: self.steps,
            version,
            reward_mean,
            version_lag_mean,
            trained_tokens: out.trained_tokens,
            seconds: started.elapsed().as_secs_f64(),
            metrics: out.metrics.clone(),
        });
        if let Some(w) = &out.weights {
            tap.latest = Some(w.clone());
        }
        Ok(out)
    }

    fn snapshot(&self) -> WeightSnapshot {
        self.inner.snapshot()
    }

    fn checkpoint(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.inner.checkpoint(dir)
    }

    fn restore(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.inner.restore(dir)?;
        lock_tap(&self.tap).latest = Some(self.inner.snapshot());
        Ok(())
    }

    fn set_version(&mut self, version: PolicyVersion) -> Result<(), BackendError> {
        self.inner.set_version(version)?;
        lock_tap(&self.tap).latest = Some(self.inner.snapshot());
        Ok(())
    }
}
