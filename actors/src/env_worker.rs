//! The EnvWorker pool: environment steps and rewards for rollouts, on a pool of worker actors.
//! An environment that panics fails that rollout (`Error("env_panic")`), never the pipeline.
//!
//! [`RolloutEnv`] is token-level: it gets the rollout so far and answers with the next prompt or
//! the final reward. The simulated task implements it here; the renderer-based environments of
//! `sluice-env` plug in through the same trait.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use sluice_core::metrics as m;
use sluice_core::{DataSample, Rollout, RolloutId};
use sluice_engine::simulated::{SimTask, TaskStep};

use crate::{ActorError, Sink};

/// What the environment answers after a model turn.
#[derive(Debug, Clone, PartialEq)]
pub enum EnvStep {
    /// Another model turn with this full prompt.
    Continue {
        /// Prompt token ids of the next turn.
        next_prompt: Vec<u32>,
    },
    /// The episode is over.
    Done {
        /// Final reward.
        reward: f64,
    },
    /// The environment failed; the payload is a short stable kind.
    Failed {
        /// Error kind.
        kind: String,
    },
}

/// An environment at the token level.
pub trait RolloutEnv: Send + Sync + 'static {
    /// The first prompt of rollout `id` for `sample`.
    fn first_prompt(&self, sample: &DataSample, id: RolloutId) -> Vec<u32>;
    /// The answer to the rollout's last turn.
    fn step(&self, sample: &DataSample, rollout: &Rollout) -> EnvStep;
}

impl RolloutEnv for SimTask {
    fn first_prompt(&self, _sample: &DataSample, id: RolloutId) -> Vec<u32> {
        SimTask::first_prompt(self, id)
    }

    fn step(&self, _sample: &DataSample, rollout: &Rollout) -> EnvStep {
        match SimTask::step(self, rollout) {
            TaskStep::Continue { next_prompt } => EnvStep::Continue { next_prompt },
            TaskStep::Done { reward } => EnvStep::Done { reward },
        }
    }
}

/// One step's outcome, as the controller receives it.
#[derive(Debug, Clone)]
pub struct EnvResult {
    /// The rollout.
    pub rollout: RolloutId,
    /// The answer.
    pub step: EnvStep,
}

/// A worker's message (private: use [`EnvPoolHandle`]).
pub struct EnvMsg(Arc<DataSample>, Rollout);

/// Typed handle over the pool; cloning is shallow.
#[derive(Clone)]
pub struct EnvPoolHandle {
    workers: Arc<Vec<ActorRef<EnvMsg>>>,
    next: Arc<AtomicUsize>,
}

impl EnvPoolHandle {
    /// Starts `size` workers over `env`; results go to `out`.
    pub async fn spawn(
        size: usize,
        env: Arc<dyn RolloutEnv>,
        out: Sink<EnvResult>,
    ) -> Result<(Self, Vec<tokio::task::JoinHandle<()>>), ActorError> {
        let mut workers = Vec::new();
        let mut joins = Vec::new();
        for _ in 0..size.max(1) {
            let (w, j) = Actor::spawn(None, EnvWorker, (Arc::clone(&env), out.clone()))
                .await
                .map_err(|e| ActorError::Spawn {
                    actor: "env",
                    message: e.to_string(),
                })?;
            workers.push(w);
            joins.push(j);
        }
        Ok((
            Self {
                workers: Arc::new(workers),
                next: Arc::default(),
            },
            joins,
        ))
    }

    /// Steps `rollout`'s environment on the next worker.
    pub fn step(&self, sample: Arc<DataSample>, rollout: Rollout) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        let _ = self.workers[i].cast(EnvMsg(sample, rollout));
    }

    /// Stops every worker.
    pub async fn stop(&self) {
        for w in self.workers.iter() {
            let _ = w.stop_and_wait(None, None).await;
        }
    }
}

struct EnvWorker;

impl Actor for EnvWorker {
    type Msg = EnvMsg;
    type State = (Arc<dyn RolloutEnv>, Sink<EnvResult>);
    type Arguments = Self::State;

    async fn pre_start(
        &self,
        _me: ActorRef<EnvMsg>,
        args: Self::State,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _me: ActorRef<EnvMsg>,
        EnvMsg(sample, rollout): EnvMsg,
        (env, out): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let step = std::panic::catch_unwind(AssertUnwindSafe(|| env.step(&sample, &rollout)))
            .unwrap_or_else(|_| {
                metrics::counter!(m::ENV_FAILURES, "kind" => "panic").increment(1);
                EnvStep::Failed {
                    kind: "env_panic".into(),
                }
            });
        out(EnvResult {
            rollout: rollout.id,
            step,
        });
        Ok(())
    }
}
