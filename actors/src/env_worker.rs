//! The EnvWorker pool: environment steps and rewards for rollouts, on a pool of worker actors.
//! An environment that panics fails that rollout (`Error("env_panic")`), never the pipeline.
//!
//! [`RolloutEnv`] is token-level and asynchronous: `start` renders a rollout's first prompt,
//! `step` answers its last turn with the next prompt or the final reward. The simulated task
//! implements it here; [`crate::native::TaskEnv`] runs the registered tasks of `sluice-env`
//! through it.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use sluice_core::metrics as m;
use sluice_core::{DataSample, Message, Rollout, RolloutId, RolloutStatus};
use sluice_engine::simulated::{SimTask, TaskStep};
pub use sluice_env::BoxFuture;

use crate::telemetry::ActorCounters;
use crate::{ActorError, Sink};

/// What the environment answers.
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
        /// Final status (`Completed`, `Truncated`, `PromptTooLong`, `Timeout`, …).
        status: RolloutStatus,
        /// The reward's named components (e.g. `correct`, `format`).
        components: BTreeMap<String, f64>,
    },
    /// The environment failed; the payload is a short stable kind.
    Failed {
        /// Error kind.
        kind: String,
    },
}

impl EnvStep {
    /// A completed episode with `reward` and no components.
    pub fn done(reward: f64) -> Self {
        Self::Done {
            reward,
            status: RolloutStatus::Completed,
            components: BTreeMap::new(),
        }
    }
}

/// What the env learned about the turn it just answered (recorded on the rollout's last turn).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnNote {
    /// The completion parsed into a message.
    pub completion_message: Option<Message>,
    /// The env's reply messages.
    pub env_messages: Vec<Message>,
    /// Per-turn reward.
    pub env_reward: Option<f64>,
    /// Situation label of the turn.
    pub situation: Option<String>,
}

/// An environment at the token level.
pub trait RolloutEnv: Send + Sync + 'static {
    /// Starts rollout `id` of `sample`: its first prompt as `Continue`, or why it cannot start.
    fn start<'a>(&'a self, sample: &'a DataSample, id: RolloutId) -> BoxFuture<'a, EnvStep>;

    /// Answers the rollout's last turn. `truncated`: the completion hit `max_tokens`, so the
    /// episode ends as `Truncated` (the env scores it without stepping).
    fn step<'a>(
        &'a self,
        sample: &'a DataSample,
        rollout: &'a Rollout,
        truncated: bool,
    ) -> BoxFuture<'a, (EnvStep, TurnNote)>;

    /// Forgets rollout `id` (its group was dropped). Default: nothing to forget.
    fn abandon(&self, _id: RolloutId) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

impl RolloutEnv for SimTask {
    fn start<'a>(&'a self, _sample: &'a DataSample, id: RolloutId) -> BoxFuture<'a, EnvStep> {
        let next_prompt = SimTask::first_prompt(self, id);
        Box::pin(async move { EnvStep::Continue { next_prompt } })
    }

    fn step<'a>(
        &'a self,
        _sample: &'a DataSample,
        rollout: &'a Rollout,
        truncated: bool,
    ) -> BoxFuture<'a, (EnvStep, TurnNote)> {
        let step = if truncated {
            EnvStep::Done {
                reward: 0.0,
                status: RolloutStatus::Truncated,
                components: BTreeMap::new(),
            }
        } else {
            match SimTask::step(self, rollout) {
                TaskStep::Continue { next_prompt } => EnvStep::Continue { next_prompt },
                TaskStep::Done { reward } => EnvStep::done(reward),
            }
        };
        Box::pin(async move { (step, TurnNote::default()) })
    }
}

/// One env answer, as the controller receives it.
#[derive(Debug, Clone)]
pub struct EnvResult {
    /// The rollout.
    pub rollout: RolloutId,
    /// The answer.
    pub step: EnvStep,
    /// What the env noted about the turn it answered (`None` for a start).
    pub note: Option<TurnNote>,
}

/// A worker's message (private: use [`EnvPoolHandle`]).
pub struct EnvMsg(Job);

enum Job {
    Start(Arc<DataSample>, RolloutId),
    Step(Arc<DataSample>, Rollout, bool),
    Abandon(RolloutId),
}

/// Typed handle over the pool; cloning is shallow.
#[derive(Clone)]
pub struct EnvPoolHandle {
    workers: Arc<Vec<ActorRef<EnvMsg>>>,
    next: Arc<AtomicUsize>,
    /// The pool's counters, shared with its workers: a job for a stopped worker is dropped here.
    counters: ActorCounters,
}

impl EnvPoolHandle {
    /// Starts `size` workers over `env`; results go to `out`.
    pub async fn spawn(
        size: usize,
        env: Arc<dyn RolloutEnv>,
        out: Sink<EnvResult>,
    ) -> Result<(Self, Vec<tokio::task::JoinHandle<()>>), ActorError> {
        let counters = ActorCounters::new("env");
        let mut workers = Vec::new();
        let mut joins = Vec::new();
        for _ in 0..size.max(1) {
            let args = (Arc::clone(&env), out.clone(), counters.clone());
            let (w, j) =
                Actor::spawn(None, EnvWorker, args)
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
                counters,
            },
            joins,
        ))
    }

    fn send(&self, job: Job) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        if self.workers[i].cast(EnvMsg(job)).is_err() {
            self.counters.dropped(1);
        }
    }

    /// Starts rollout `id` of `sample` on the next worker.
    pub fn start(&self, sample: Arc<DataSample>, id: RolloutId) {
        self.send(Job::Start(sample, id));
    }

    /// Steps `rollout`'s environment on the next worker.
    pub fn step(&self, sample: Arc<DataSample>, rollout: Rollout, truncated: bool) {
        self.send(Job::Step(sample, rollout, truncated));
    }

    /// Tells the environment to forget rollout `id`.
    pub fn abandon(&self, id: RolloutId) {
        self.send(Job::Abandon(id));
    }

    /// Stops every worker.
    pub async fn stop(&self) {
        for w in self.workers.iter() {
            let _ = w.stop_and_wait(None, None).await;
        }
    }
}

struct EnvWorker;

fn panicked() -> EnvStep {
    metrics::counter!(m::ENV_FAILURES, "kind" => "panic").increment(1);
    EnvStep::Failed {
        kind: "env_panic".into(),
    }
}

/// Closes rollout `id`'s session after its env call panicked; a panic here is swallowed (the
/// rollout already fails as `env_panic`).
async fn close(env: &dyn RolloutEnv, id: RolloutId) {
    let _ = AssertUnwindSafe(env.abandon(id)).catch_unwind().await;
}

impl Actor for EnvWorker {
    type Msg = EnvMsg;
    type State = (Arc<dyn RolloutEnv>, Sink<EnvResult>, ActorCounters);
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
        EnvMsg(job): EnvMsg,
        (env, out, counters): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        counters.received(1);
        // A panicking env fails its rollout; the worker lives on.
        let result = match job {
            Job::Start(sample, id) => {
                let step = match AssertUnwindSafe(env.start(&sample, id))
                    .catch_unwind()
                    .await
                {
                    Ok(step) => step,
                    Err(_) => {
                        // The start may have opened a session before it panicked.
                        close(env.as_ref(), id).await;
                        panicked()
                    }
                };
                EnvResult {
                    rollout: id,
                    step,
                    note: None,
                }
            }
            Job::Step(sample, rollout, truncated) => {
                let (step, note) = match AssertUnwindSafe(env.step(&sample, &rollout, truncated))
                    .catch_unwind()
                    .await
                {
                    Ok(done) => done,
                    Err(_) => {
                        // The episode is over: close whatever the env still holds for it.
                        close(env.as_ref(), rollout.id).await;
                        (panicked(), TurnNote::default())
                    }
                };
                EnvResult {
                    rollout: rollout.id,
                    step,
                    note: Some(note),
                }
            }
            Job::Abandon(id) => {
                if AssertUnwindSafe(env.abandon(id))
                    .catch_unwind()
                    .await
                    .is_err()
                {
                    metrics::counter!(m::ENV_FAILURES, "kind" => "panic").increment(1);
                }
                return Ok(());
            }
        };
        out(result);
        counters.sent(1);
        Ok(())
    }
}
