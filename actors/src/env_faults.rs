//! Decorators around the node's [`RolloutEnv`]: [`TimeoutEnv`] bounds every environment call
//! (`supervision.env_step_timeout_s`; always on), and [`FaultyEnv`] injects the environment part of
//! `[faults]` — a step that panics or hangs, a reward that panics — for tests and drills.
//!
//! A panic unwinds into the env worker, which fails that rollout with `Error("env_panic")` and
//! closes its session; a hang lasts until the timeout ends the rollout as `Timeout`. Neither is
//! trainable, both count in `sluice_env_failures_total{kind}`, and the pipeline goes on.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sluice_core::config::FaultsConfig;
use sluice_core::metrics as m;
use sluice_core::{DataSample, Rollout, RolloutId, RolloutStatus};

use crate::env_worker::{BoxFuture, EnvStep, RolloutEnv, TurnNote};
use crate::faults::injected;

/// The environment part of `[faults]`; every period 0 = off.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvFaults {
    /// Every N-th step of the node panics.
    pub panic_every_steps: u64,
    /// Every N-th step hangs.
    pub hang_every_steps: u64,
    /// The reward of every N-th finished episode panics.
    pub reward_panic_every_episodes: u64,
}

impl EnvFaults {
    /// From the config.
    pub fn from_config(faults: &FaultsConfig) -> Self {
        Self {
            panic_every_steps: faults.env_panic_every_steps,
            hang_every_steps: faults.env_hang_every_steps,
            reward_panic_every_episodes: faults.reward_panic_every_episodes,
        }
    }

    /// Some fault is on.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

fn hits(every: u64, n: u64) -> bool {
    every > 0 && n.is_multiple_of(every)
}

/// An environment whose steps panic or hang, and whose final rewards panic, on schedule.
pub struct FaultyEnv {
    inner: Arc<dyn RolloutEnv>,
    faults: EnvFaults,
    steps: AtomicU64,
    episodes: AtomicU64,
}

impl FaultyEnv {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn RolloutEnv>, faults: EnvFaults) -> Self {
        Self {
            inner,
            faults,
            steps: AtomicU64::new(0),
            episodes: AtomicU64::new(0),
        }
    }
}

impl RolloutEnv for FaultyEnv {
    fn start<'a>(&'a self, sample: &'a DataSample, id: RolloutId) -> BoxFuture<'a, EnvStep> {
        self.inner.start(sample, id)
    }

    fn step<'a>(
        &'a self,
        sample: &'a DataSample,
        rollout: &'a Rollout,
        truncated: bool,
    ) -> BoxFuture<'a, (EnvStep, TurnNote)> {
        Box::pin(async move {
            let n = self.steps.fetch_add(1, Ordering::Relaxed) + 1;
            if hits(self.faults.panic_every_steps, n) {
                injected("env_panic");
                panic!("env step {n} panics on purpose ([faults] env_panic_every_steps)");
            }
            if hits(self.faults.hang_every_steps, n) {
                injected("env_hang");
                std::future::pending::<()>().await;
            }
            let (step, note) = self.inner.step(sample, rollout, truncated).await;
            if matches!(step, EnvStep::Done { .. }) {
                let e = self.episodes.fetch_add(1, Ordering::Relaxed) + 1;
                if hits(self.faults.reward_panic_every_episodes, e) {
                    injected("reward_panic");
                    panic!("reward {e} panics on purpose ([faults] reward_panic_every_episodes)");
                }
            }
            (step, note)
        })
    }

    fn abandon(&self, id: RolloutId) -> BoxFuture<'_, ()> {
        self.inner.abandon(id)
    }
}

/// Ends an environment call that takes longer than its limit: the rollout ends as `Timeout` and
/// its session is closed, and the worker moves on.
pub struct TimeoutEnv {
    inner: Arc<dyn RolloutEnv>,
    limit: Duration,
}

impl TimeoutEnv {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn RolloutEnv>, limit: Duration) -> Self {
        Self { inner, limit }
    }

    async fn timed_out(&self, id: RolloutId) -> EnvStep {
        tracing::warn!(rollout = %id, limit = ?self.limit, "environment call timed out");
        metrics::counter!(m::ENV_FAILURES, "kind" => "timeout").increment(1);
        self.inner.abandon(id).await;
        EnvStep::Done {
            reward: 0.0,
            status: RolloutStatus::Timeout,
            components: BTreeMap::new(),
        }
    }
}

impl RolloutEnv for TimeoutEnv {
    fn start<'a>(&'a self, sample: &'a DataSample, id: RolloutId) -> BoxFuture<'a, EnvStep> {
        Box::pin(async move {
            match tokio::time::timeout(self.limit, self.inner.start(sample, id)).await {
                Ok(step) => step,
                Err(_) => self.timed_out(id).await,
            }
        })
    }

    fn step<'a>(
        &'a self,
        sample: &'a DataSample,
        rollout: &'a Rollout,
        truncated: bool,
    ) -> BoxFuture<'a, (EnvStep, TurnNote)> {
        Box::pin(async move {
            let call = self.inner.step(sample, rollout, truncated);
            match tokio::time::timeout(self.limit, call).await {
                Ok(done) => done,
                Err(_) => (self.timed_out(rollout.id).await, TurnNote::default()),
            }
        })
    }

    fn abandon(&self, id: RolloutId) -> BoxFuture<'_, ()> {
        self.inner.abandon(id)
    }
}
