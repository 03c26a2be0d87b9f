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

use sluice_config::FaultsConfig;
use sluice_core::metrics as m;
use sluice_core::{DataSample, Rollout, RolloutGroup, RolloutId, RolloutStatus};

use crate::env_worker::{BoxFuture, EnvReply, RolloutEnv, TurnNote, failed_group};
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
    sluice_env::forward_env!(inner => start, abandon, scores_groups, score_group, set_session_cap);

    fn step<'a>(
        &'a self,
        sample: &'a DataSample,
        rollout: &'a Rollout,
        truncated: bool,
    ) -> BoxFuture<'a, (EnvReply, TurnNote)> {
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
            if matches!(step, EnvReply::Done { .. }) {
                let e = self.episodes.fetch_add(1, Ordering::Relaxed) + 1;
                if hits(self.faults.reward_panic_every_episodes, e) {
                    injected("reward_panic");
                    panic!("reward {e} panics on purpose ([faults] reward_panic_every_episodes)");
                }
            }
            (step, note)
        })
    }
}

/// Ends an environment call that takes longer than its limit: the rollout ends as `Timeout` and
/// its session is closed, and the worker moves on. Closing a session is bounded by the same limit.
pub struct TimeoutEnv {
    inner: Arc<dyn RolloutEnv>,
    limit: Duration,
}

impl TimeoutEnv {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn RolloutEnv>, limit: Duration) -> Self {
        Self { inner, limit }
    }

    /// Abandons rollout `id` within the limit as well: an env that hangs while closing a session
    /// must not hold its worker forever.
    async fn close(&self, id: RolloutId) {
        if tokio::time::timeout(self.limit, self.inner.abandon(id))
            .await
            .is_err()
        {
            tracing::warn!(rollout = %id, limit = ?self.limit, "closing an environment session timed out");
        }
    }

    async fn timed_out(&self, id: RolloutId) -> EnvReply {
        tracing::warn!(rollout = %id, limit = ?self.limit, "environment call timed out");
        metrics::counter!(m::ENV_FAILURES, "kind" => "timeout").increment(1);
        self.close(id).await;
        EnvReply::Done {
            reward: 0.0,
            status: RolloutStatus::Timeout,
            components: BTreeMap::new(),
        }
    }
}

impl RolloutEnv for TimeoutEnv {
    sluice_env::forward_env!(inner => scores_groups, set_session_cap);

    fn start<'a>(&'a self, sample: &'a DataSample, id: RolloutId) -> BoxFuture<'a, EnvReply> {
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
    ) -> BoxFuture<'a, (EnvReply, TurnNote)> {
        Box::pin(async move {
            let call = self.inner.step(sample, rollout, truncated);
            match tokio::time::timeout(self.limit, call).await {
                Ok(done) => done,
                Err(_) => (self.timed_out(rollout.id).await, TurnNote::default()),
            }
        })
    }

    fn abandon(&self, id: RolloutId) -> BoxFuture<'_, ()> {
        Box::pin(self.close(id))
    }

    /// Group scoring is bounded by the same limit; past it the group's rollouts end as `Timeout`.
    fn score_group<'a>(
        &'a self,
        sample: &'a DataSample,
        group: RolloutGroup,
    ) -> BoxFuture<'a, RolloutGroup> {
        Box::pin(async move {
            let fallback = group.clone();
            match tokio::time::timeout(self.limit, self.inner.score_group(sample, group)).await {
                Ok(scored) => scored,
                Err(_) => {
                    tracing::warn!(group = %fallback.id, limit = ?self.limit, "group scoring timed out");
                    metrics::counter!(m::ENV_FAILURES, "kind" => "timeout").increment(1);
                    failed_group(fallback, "timeout")
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use sluice_core::{GroupId, NodeId, RunId};

    use super::*;

    /// An env whose calls never answer (closing too, when `close_hangs`), recording what it was
    /// told to abandon.
    #[derive(Default)]
    struct Stuck {
        close_hangs: bool,
        abandoned: Mutex<Vec<RolloutId>>,
    }

    impl RolloutEnv for Stuck {
        sluice_env::no_env_state!(scores_groups, score_group, set_session_cap);

        fn start<'a>(&'a self, _: &'a DataSample, _: RolloutId) -> BoxFuture<'a, EnvReply> {
            Box::pin(std::future::pending())
        }

        fn step<'a>(
            &'a self,
            _: &'a DataSample,
            _: &'a Rollout,
            _: bool,
        ) -> BoxFuture<'a, (EnvReply, TurnNote)> {
            Box::pin(std::future::pending())
        }

        fn abandon(&self, id: RolloutId) -> BoxFuture<'_, ()> {
            self.abandoned.lock().unwrap().push(id);
            if self.close_hangs {
                Box::pin(std::future::pending())
            } else {
                Box::pin(async {})
            }
        }
    }

    fn sample() -> DataSample {
        DataSample {
            id: "1".into(),
            domain: "math".into(),
            dataset: "toy".into(),
            input: serde_json::Value::Null,
            system_prompt: None,
        }
    }

    fn id() -> RolloutId {
        GroupId {
            run: RunId::from_name("t"),
            node: NodeId(0),
            counter: 1,
        }
        .rollout(2)
    }

    /// Short, so the tests run on real time.
    const LIMIT: Duration = Duration::from_millis(50);

    fn is_timeout(step: &EnvReply) -> bool {
        matches!(
            step,
            EnvReply::Done {
                status: RolloutStatus::Timeout,
                ..
            }
        )
    }

    #[tokio::test]
    async fn a_call_past_the_limit_ends_as_timeout_and_closes_its_session() {
        let inner = Arc::new(Stuck::default());
        let env = TimeoutEnv::new(inner.clone(), LIMIT);
        let t0 = tokio::time::Instant::now();
        let step = env.start(&sample(), id()).await;
        assert!(is_timeout(&step), "{step:?}");
        let (step, _) = env.step(&sample(), &Rollout::new(id()), false).await;
        assert!(is_timeout(&step), "{step:?}");
        assert!(t0.elapsed() >= 2 * LIMIT);
        let abandoned = inner.abandoned.lock().unwrap().clone();
        assert_eq!(abandoned, vec![id(), id()]);
    }

    #[tokio::test]
    async fn closing_a_session_is_bounded_too() {
        let inner = Arc::new(Stuck {
            close_hangs: true,
            ..Stuck::default()
        });
        let env = TimeoutEnv::new(inner.clone(), LIMIT);
        let t0 = tokio::time::Instant::now();
        let (step, _) = env.step(&sample(), &Rollout::new(id()), false).await;
        assert!(is_timeout(&step), "{step:?}");
        env.abandon(id()).await;
        // The hung call, its hung close, and the hung abandon: each ends at the limit.
        assert!(t0.elapsed() >= 3 * LIMIT);
        let abandoned = inner.abandoned.lock().unwrap().len();
        assert_eq!(abandoned, 2);
    }

    /// The calls (1-based) out of `calls` steps of a truncated episode that panic.
    async fn panicking_calls(faults: EnvFaults, calls: u64) -> Vec<u64> {
        let sim = sluice_env::SimTask {
            prompt_tokens: 4,
            env_reply_tokens: 2,
            turns: 1,
            seed: 1,
        };
        let env = FaultyEnv::new(Arc::new(sim), faults);
        let (sample, rollout) = (sample(), Rollout::new(id()));
        let mut panicked = Vec::new();
        for n in 1..=calls {
            // Truncated: every step ends its episode, so steps and episodes count alike.
            let call = std::panic::AssertUnwindSafe(env.step(&sample, &rollout, true));
            if futures::FutureExt::catch_unwind(call).await.is_err() {
                panicked.push(n);
            }
        }
        panicked
    }

    #[tokio::test]
    async fn faults_fire_on_schedule() {
        let steps = EnvFaults {
            panic_every_steps: 3,
            ..EnvFaults::default()
        };
        assert_eq!(panicking_calls(steps, 7).await, vec![3, 6]);
        let rewards = EnvFaults {
            reward_panic_every_episodes: 2,
            ..EnvFaults::default()
        };
        assert_eq!(panicking_calls(rewards, 5).await, vec![2, 4]);
        assert!(panicking_calls(EnvFaults::default(), 5).await.is_empty());
    }
}
