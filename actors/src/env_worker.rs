//! The EnvWorker pool: environment steps and rewards for rollouts, on a pool of worker actors.
//! An environment that panics fails that rollout (`Error("env_panic")`), never the pipeline.
//! Env calls are async and mostly wait (on a tool, a sandbox, a remote env), so each worker runs
//! up to `rollout.env_calls_per_worker` of them at once and a call that hangs holds one slot,
//! not a worker.
//!
//! The seam, [`RolloutEnv`], lives in `sluice-env` (`sluice_env::rollout_env`, re-exported here):
//! token-level and asynchronous, `start` renders a rollout's first prompt, `step` answers its last
//! turn with the next prompt or the final reward. The simulated task implements it in
//! `sluice_env::simulated`; the native pipeline's `TaskEnv` runs the registered tasks through it.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use sluice_core::metrics as m;
use sluice_core::{
    DataSample, Knobs, KnobsHandle, Rollout, RolloutGroup, RolloutId, RolloutStatus,
};
pub use sluice_env::BoxFuture;
pub use sluice_env::rollout_env::{EnvReply, RolloutEnv, TurnNote};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::counters::ActorCounters;
use crate::{ActorError, Sink};

/// One env answer, as the controller receives it.
#[derive(Debug, Clone)]
pub struct EnvResult {
    /// The rollout.
    pub rollout: RolloutId,
    /// The answer.
    pub step: EnvReply,
    /// What the env noted about the turn it answered (`None` for a start).
    pub note: Option<TurnNote>,
}

/// A worker's message (private: use [`EnvPoolHandle`]).
pub struct EnvMsg(Job);

enum Job {
    Start(Arc<DataSample>, RolloutId),
    ScoreGroup(Arc<DataSample>, RolloutGroup),
    Step(Arc<DataSample>, Rollout, bool),
    Abandon(RolloutId),
}

/// How the pool is sized, and the group shape its environment's session cap follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvPoolConfig {
    /// Worker actors (`rollout.env_workers`).
    pub workers: usize,
    /// Env calls each worker runs at once (`rollout.env_calls_per_worker`).
    pub calls_per_worker: usize,
    /// Rollouts per group.
    pub group_size: u32,
    /// Groups per training step.
    pub groups_per_step: u32,
}

impl EnvPoolConfig {
    /// From `[rollout]`.
    pub fn from_config(config: &sluice_config::Config) -> Self {
        let r = &config.rollout;
        Self {
            workers: r.env_workers.get() as usize,
            calls_per_worker: r.env_calls_per_worker.get() as usize,
            group_size: r.group_size.get(),
            groups_per_step: r.groups_per_step.get(),
        }
    }

    /// The session cap for `knobs`: see [`session_cap`].
    pub fn session_cap(&self, knobs: &Knobs) -> usize {
        session_cap(knobs, self.group_size, self.groups_per_step)
    }
}

/// Environment sessions a node may need open at once under `knobs`, with slack: twice the larger
/// of `max_concurrent_rollouts` and the admission bound `(η + 1) · groups_per_step · group_size`.
/// A session lives from a rollout's start to its end, so generating rollouts, rollouts waiting on
/// their env and aborted rollouts waiting to resume all hold one; admission bounds them all. The
/// factor 2 covers sessions whose close is still queued when their slot is reused.
pub fn session_cap(knobs: &Knobs, group_size: u32, groups_per_step: u32) -> usize {
    let admitted = knobs
        .max_version_lag
        .saturating_add(1)
        .saturating_mul(u64::from(groups_per_step))
        .saturating_mul(u64::from(group_size));
    let need = admitted.max(u64::from(knobs.max_concurrent_rollouts));
    usize::try_from(need.saturating_mul(2)).unwrap_or(usize::MAX)
}

/// One worker as the pool sees it.
struct WorkerSlot {
    actor: ActorRef<EnvMsg>,
    /// Calls sent to it that have not finished (queued in its mailbox or running).
    load: Arc<AtomicUsize>,
}

/// Typed handle over the pool; cloning is shallow.
#[derive(Clone)]
pub struct EnvPoolHandle {
    workers: Arc<Vec<WorkerSlot>>,
    next: Arc<AtomicUsize>,
    /// The pool's counters, shared with its workers: a job for a stopped worker is dropped here.
    counters: ActorCounters,
    /// The env scores settled groups ([`RolloutEnv::scores_groups`]).
    scores_groups: bool,
}

impl EnvPoolHandle {
    /// The workers' cells (for linking them to a supervisor).
    pub fn cells(&self) -> Vec<ractor::ActorCell> {
        self.workers.iter().map(|w| w.actor.get_cell()).collect()
    }

    /// Starts `config.workers` workers over `env`, each running up to `config.calls_per_worker`
    /// calls at once; results go to `out`. The env's session cap follows `knobs`
    /// ([`session_cap`]), so raising `max_concurrent_rollouts` or η at runtime opens room for the
    /// rollouts it admits.
    pub async fn spawn(
        config: EnvPoolConfig,
        env: Arc<dyn RolloutEnv>,
        out: Sink<EnvResult>,
        knobs: &KnobsHandle,
    ) -> Result<(Self, Vec<tokio::task::JoinHandle<()>>), ActorError> {
        let counters = ActorCounters::new("env");
        let scores_groups = env.scores_groups();
        env.set_session_cap(config.session_cap(&knobs.current()));
        let mut workers = Vec::new();
        let mut joins = Vec::new();
        for _ in 0..config.workers.max(1) {
            let load = Arc::new(AtomicUsize::new(0));
            let worker = EnvWorker {
                env: Arc::clone(&env),
                out: out.clone(),
                counters: counters.clone(),
                load: Arc::clone(&load),
                calls: config.calls_per_worker.max(1),
                config,
            };
            let (w, j) = Actor::spawn(None, worker, knobs.subscribe())
                .await
                .map_err(|e| ActorError::Spawn {
                    actor: "env",
                    message: e.to_string(),
                })?;
            workers.push(WorkerSlot { actor: w, load });
            joins.push(j);
        }
        Ok((
            Self {
                workers: Arc::new(workers),
                next: Arc::default(),
                counters,
                scores_groups,
            },
            joins,
        ))
    }

    /// Sends `job` to the least-loaded worker (ties: round robin), so calls that hang pile up
    /// on no worker while others have room.
    fn send(&self, job: Job) {
        let n = self.workers.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let w = (0..n)
            .map(|k| &self.workers[(first + k) % n])
            .min_by_key(|w| w.load.load(Ordering::Relaxed))
            .expect("the pool has at least one worker");
        w.load.fetch_add(1, Ordering::Relaxed);
        if w.actor.cast(EnvMsg(job)).is_err() {
            w.load.fetch_sub(1, Ordering::Relaxed);
            self.counters.dropped(1);
        }
    }

    /// Starts rollout `id` of `sample`.
    pub fn start(&self, sample: Arc<DataSample>, id: RolloutId) {
        self.send(Job::Start(sample, id));
    }

    /// Steps `rollout`'s environment.
    pub fn step(&self, sample: Arc<DataSample>, rollout: Rollout, truncated: bool) {
        self.send(Job::Step(sample, rollout, truncated));
    }

    /// Whether settled groups must be scored by [`EnvPoolHandle::score_group`] before they are
    /// stored.
    pub fn scores_groups(&self) -> bool {
        self.scores_groups
    }

    /// Scores settled `group` as a whole; the answer is an [`EnvReply::Scored`].
    pub fn score_group(&self, sample: Arc<DataSample>, group: RolloutGroup) {
        self.send(Job::ScoreGroup(sample, group));
    }

    /// Tells the environment to forget rollout `id`.
    pub fn abandon(&self, id: RolloutId) {
        self.send(Job::Abandon(id));
    }

    /// Env calls sent and not finished, over all workers.
    pub fn calls_in_progress(&self) -> usize {
        self.workers
            .iter()
            .map(|w| w.load.load(Ordering::Relaxed))
            .sum()
    }

    /// Stops every worker; calls still running are cancelled with it.
    pub async fn stop(&self) {
        for w in self.workers.iter() {
            let _ = w.actor.stop_and_wait(None, None).await;
        }
    }
}

/// A worker, with what stays fixed for its life: the env, where results go, its counters and
/// load gauge (shared with the pool, which routes by it), and its limits.
struct EnvWorker {
    env: Arc<dyn RolloutEnv>,
    out: Sink<EnvResult>,
    counters: ActorCounters,
    load: Arc<AtomicUsize>,
    /// Calls it runs at once.
    calls: usize,
    config: EnvPoolConfig,
}

/// A worker's state: the knobs as it last saw them (the receiver marks what it has seen) and
/// the calls it runs (owned: aborted when it stops).
struct WorkerState {
    knobs: watch::Receiver<Knobs>,
    running: JoinSet<()>,
}

fn panicked() -> EnvReply {
    metrics::counter!(m::ENV_FAILURES, "kind" => "panic").increment(1);
    EnvReply::Failed {
        kind: "env_panic".into(),
    }
}

/// `group` with every finished rollout failed as `kind` and rewarded 0: its scoring panicked.
pub fn failed_group(mut group: RolloutGroup, kind: &str) -> RolloutGroup {
    for r in group.rollouts.iter_mut().filter(|r| r.is_terminal()) {
        r.status = if kind == "timeout" {
            RolloutStatus::Timeout
        } else {
            RolloutStatus::Error(kind.to_owned())
        };
        r.reward = 0.0;
    }
    group
}

/// Closes rollout `id`'s session after its env call panicked; a panic here is swallowed (the
/// rollout already fails as `env_panic`).
async fn close(env: &dyn RolloutEnv, id: RolloutId) {
    let _ = AssertUnwindSafe(env.abandon(id)).catch_unwind().await;
}

/// Runs one call; a panicking env fails its rollout and the worker lives on. `None`: nothing
/// to report (an abandon).
async fn call(env: &dyn RolloutEnv, job: Job) -> Option<EnvResult> {
    match job {
        Job::Start(sample, id) => {
            let step = match AssertUnwindSafe(env.start(&sample, id))
                .catch_unwind()
                .await
            {
                Ok(step) => step,
                Err(_) => {
                    // The start may have opened a session before it panicked.
                    close(env, id).await;
                    panicked()
                }
            };
            Some(EnvResult {
                rollout: id,
                step,
                note: None,
            })
        }
        Job::Step(sample, rollout, truncated) => {
            let (step, note) = match AssertUnwindSafe(env.step(&sample, &rollout, truncated))
                .catch_unwind()
                .await
            {
                Ok(done) => done,
                Err(_) => {
                    // The episode is over: close whatever the env still holds for it.
                    close(env, rollout.id).await;
                    (panicked(), TurnNote::default())
                }
            };
            Some(EnvResult {
                rollout: rollout.id,
                step,
                note: Some(note),
            })
        }
        Job::ScoreGroup(sample, group) => {
            let rollout = group.rollouts.first()?.id;
            let fallback = group.clone();
            let scored = match AssertUnwindSafe(env.score_group(&sample, group))
                .catch_unwind()
                .await
            {
                Ok(scored) => scored,
                Err(_) => {
                    panicked();
                    failed_group(fallback, "env_panic")
                }
            };
            Some(EnvResult {
                rollout,
                step: EnvReply::Scored(Box::new(scored)),
                note: None,
            })
        }
        Job::Abandon(id) => {
            if AssertUnwindSafe(env.abandon(id))
                .catch_unwind()
                .await
                .is_err()
            {
                metrics::counter!(m::ENV_FAILURES, "kind" => "panic").increment(1);
            }
            None
        }
    }
}

impl Actor for EnvWorker {
    type Msg = EnvMsg;
    type State = WorkerState;
    type Arguments = watch::Receiver<Knobs>;

    async fn pre_start(
        &self,
        _me: ActorRef<EnvMsg>,
        knobs: watch::Receiver<Knobs>,
    ) -> Result<WorkerState, ActorProcessingErr> {
        Ok(WorkerState {
            knobs,
            running: JoinSet::new(),
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<EnvMsg>,
        EnvMsg(job): EnvMsg,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        let WorkerState { knobs, running } = state;
        self.counters.received(1);
        while running.try_join_next().is_some() {}
        if matches!(job, Job::Start(..)) && knobs.has_changed().unwrap_or(false) {
            // The knobs changed before the controller admitted this rollout: the cap follows
            // them before the session opens.
            let cap = self.config.session_cap(&knobs.borrow_and_update());
            self.env.set_session_cap(cap);
        }
        // At its limit the worker waits for a call to end; later jobs queue in its mailbox,
        // and the pool sends new ones to less-loaded workers.
        while running.len() >= self.calls {
            running.join_next().await;
        }
        let env = Arc::clone(&self.env);
        let out = self.out.clone();
        let counters = self.counters.clone();
        let load = Arc::clone(&self.load);
        running.spawn(async move {
            let result = call(env.as_ref(), job).await;
            // The call is over before its result is out: whoever reads the result then sees
            // the load without it (the pool's routing, and `calls_in_progress`).
            load.fetch_sub(1, Ordering::Relaxed);
            if let Some(result) = result {
                out(result);
                counters.sent(1);
            }
        });
        Ok(())
    }
}
