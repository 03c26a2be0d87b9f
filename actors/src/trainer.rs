//! The Trainer actor: a dedicated thread pulls `groups_per_step` groups from the replay store
//! (holding weights `t`, with the live η), checks the staleness invariant on every token, trains,
//! and publishes version `t + 1`. The actor owns the thread; its handle reads the status.
//!
//! The invariant check is a guard, not the mechanism: the replay store never hands out a group
//! with a token older than `t − η`; a violation here would be a bug, counted and logged.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde::Serialize;
use sluice_core::metrics as m;
use sluice_core::{
    GroupId, KnobsHandle, PolicyVersion, RolloutGroup, TrainerBackend, WeightSnapshot,
};

use crate::replay::ReplayHandle;
use crate::{ActorError, Sink};

/// A point-in-time view of the trainer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TrainerStatus {
    /// Version of the weights the next step starts from.
    pub version: PolicyVersion,
    /// Steps taken.
    pub steps: u64,
    /// Groups trained on.
    pub trained_groups: u64,
    /// Rollouts trained on.
    pub trained_samples: u64,
    /// Completion tokens trained on.
    pub trained_tokens: u64,
    /// Sum of token lags (mean lag = this / tokens).
    pub lag_sum: u64,
    /// Largest token lag trained on.
    pub max_lag: u64,
    /// Tokens trained whose lag exceeded η at training time (must stay 0).
    pub lag_violations: u64,
    /// Groups trained a second time (must stay 0).
    pub duplicate_groups: u64,
    /// Seconds spent waiting for a batch.
    pub idle_seconds: f64,
    /// Seconds since the trainer started.
    pub uptime_seconds: f64,
    /// The step budget is used up.
    pub done: bool,
    /// The last step's error, if training failed.
    pub error: Option<String>,
}

impl TrainerStatus {
    /// Mean version lag of trained tokens.
    pub fn mean_lag(&self) -> f64 {
        if self.trained_tokens == 0 {
            0.0
        } else {
            self.lag_sum as f64 / self.trained_tokens as f64
        }
    }

    /// Fraction of wall time spent waiting for data.
    pub fn idle_ratio(&self) -> f64 {
        if self.uptime_seconds > 0.0 {
            (self.idle_seconds / self.uptime_seconds).min(1.0)
        } else {
            0.0
        }
    }
}

/// How the trainer runs.
#[derive(Debug, Clone)]
pub struct TrainerOptions {
    /// Groups per step.
    pub groups_per_step: usize,
    /// Stop after this many steps (counted from this start).
    pub max_steps: u64,
    /// Record trained group ids to detect duplicates (tests and benchmarks).
    pub track_ids: bool,
}

/// Typed handle; cloning is shallow.
#[derive(Clone)]
pub struct TrainerHandle {
    actor: ActorRef<()>,
    status: Arc<Mutex<TrainerStatus>>,
    ids: Arc<Mutex<Vec<GroupId>>>,
}

impl TrainerHandle {
    /// Starts the trainer thread; new weights go to `publish`.
    pub async fn spawn(
        backend: Box<dyn TrainerBackend>,
        replay: ReplayHandle,
        knobs: KnobsHandle,
        publish: Sink<WeightSnapshot>,
        options: TrainerOptions,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        let status = Arc::new(Mutex::new(TrainerStatus {
            version: backend.version(),
            ..TrainerStatus::default()
        }));
        let ids = Arc::new(Mutex::new(Vec::new()));
        let worker = Worker {
            backend,
            replay: replay.clone(),
            knobs,
            publish,
            options,
            status: Arc::clone(&status),
            ids: Arc::clone(&ids),
            stop: Arc::new(AtomicBool::new(false)),
            rt: tokio::runtime::Handle::current(),
        };
        let (actor, join) = Actor::spawn(None, TrainerActor, (worker, replay))
            .await
            .map_err(|e| ActorError::Spawn {
                actor: "trainer",
                message: e.to_string(),
            })?;
        Ok((Self { actor, status, ids }, join))
    }

    /// The trainer's view.
    pub fn status(&self) -> TrainerStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Ids of the groups trained, in order (when `track_ids` is on).
    pub fn trained_ids(&self) -> Vec<GroupId> {
        self.ids.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Stops the thread (after its current step) and the actor.
    pub async fn stop(&self) {
        let _ = self.actor.stop_and_wait(None, None).await;
    }
}

struct TrainerActor;

/// The actor's state: the thread and how to stop it.
pub struct TrainerState {
    stop: Arc<AtomicBool>,
    replay: ReplayHandle,
    thread: Option<JoinHandle<()>>,
}

impl Actor for TrainerActor {
    type Msg = ();
    type State = TrainerState;
    type Arguments = (Worker, ReplayHandle);

    async fn pre_start(
        &self,
        _me: ActorRef<()>,
        (worker, replay): Self::Arguments,
    ) -> Result<TrainerState, ActorProcessingErr> {
        let stop = Arc::clone(&worker.stop);
        let thread = std::thread::Builder::new()
            .name("trainer".into())
            .spawn(move || worker.run())?;
        Ok(TrainerState {
            stop,
            replay,
            thread: Some(thread),
        })
    }

    async fn post_stop(
        &self,
        _me: ActorRef<()>,
        s: &mut TrainerState,
    ) -> Result<(), ActorProcessingErr> {
        s.stop.store(true, Ordering::SeqCst);
        s.replay.cancel_take();
        if let Some(t) = s.thread.take() {
            tokio::task::spawn_blocking(move || t.join()).await.ok();
        }
        Ok(())
    }
}

/// The thread's state (private; built by [`TrainerHandle::spawn`]).
pub struct Worker {
    backend: Box<dyn TrainerBackend>,
    replay: ReplayHandle,
    knobs: KnobsHandle,
    publish: Sink<WeightSnapshot>,
    options: TrainerOptions,
    status: Arc<Mutex<TrainerStatus>>,
    ids: Arc<Mutex<Vec<GroupId>>>,
    stop: Arc<AtomicBool>,
    rt: tokio::runtime::Handle,
}

impl Worker {
    fn run(mut self) {
        let started = Instant::now();
        let mut trained: HashSet<GroupId> = HashSet::new();
        let mut steps = 0u64;
        while !self.stop.load(Ordering::SeqCst) && steps < self.options.max_steps {
            let version = self.backend.version();
            let eta = self.knobs.current().max_version_lag;
            let wait = Instant::now();
            let batch = self.rt.block_on(self.replay.take_batch(
                self.options.groups_per_step,
                version,
                eta,
            ));
            let idle = wait.elapsed().as_secs_f64();
            let Some(batch) = batch else { break };
            let check = check_batch(&batch, version, eta, &mut trained);
            if check.violations > 0 || check.duplicates > 0 {
                tracing::error!(
                    violations = check.violations,
                    duplicates = check.duplicates,
                    "batch broke an invariant"
                );
            }
            let step_started = Instant::now();
            let outcome = self.backend.train_step(&batch);
            metrics::histogram!(m::TRAINER_STEP_SECONDS)
                .record(step_started.elapsed().as_secs_f64());
            steps += 1;
            let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
            status.idle_seconds += idle;
            status.uptime_seconds = started.elapsed().as_secs_f64();
            status.trained_groups += batch.len() as u64;
            status.trained_samples += batch.iter().map(|g| g.rollouts.len() as u64).sum::<u64>();
            status.trained_tokens += check.tokens;
            status.lag_sum += check.lag_sum;
            status.max_lag = status.max_lag.max(check.max_lag);
            status.lag_violations += check.violations;
            status.duplicate_groups += check.duplicates;
            status.steps = steps;
            if self.options.track_ids
                && let Ok(mut ids) = self.ids.lock()
            {
                ids.extend(batch.iter().map(|g| g.id));
            }
            metrics::counter!(m::TRAINER_STEPS).increment(1);
            metrics::counter!(m::TRAINER_TRAINED_TOKENS).increment(check.tokens);
            metrics::gauge!(m::TRAINER_IDLE_RATIO).set(status.idle_ratio());
            match outcome {
                Ok(out) => {
                    if let Some(w) = out.weights {
                        status.version = w.version;
                        metrics::gauge!(m::TRAINER_POLICY_VERSION).set(w.version.0 as f64);
                        drop(status);
                        (self.publish)(w);
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "training step failed; the trainer stops");
                    metrics::counter!(m::ACTOR_ERRORS, "actor" => "trainer", "kind" => e.kind)
                        .increment(1);
                    status.error = Some(e.to_string());
                    break;
                }
            }
        }
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status.uptime_seconds = started.elapsed().as_secs_f64();
        status.done = steps >= self.options.max_steps;
    }
}

struct BatchCheck {
    tokens: u64,
    lag_sum: u64,
    max_lag: u64,
    violations: u64,
    duplicates: u64,
}

/// Lags of every token against the weights `version` the batch trains from.
fn check_batch(
    batch: &[RolloutGroup],
    version: PolicyVersion,
    eta: u64,
    trained: &mut HashSet<GroupId>,
) -> BatchCheck {
    let mut c = BatchCheck {
        tokens: 0,
        lag_sum: 0,
        max_lag: 0,
        violations: 0,
        duplicates: 0,
    };
    let mut per_lag = [0usize; 64];
    for g in batch {
        if !trained.insert(g.id) {
            c.duplicates += 1;
        }
        for v in g
            .rollouts
            .iter()
            .flat_map(|r| r.turns.iter())
            .flat_map(|t| t.token_versions.iter())
        {
            let lag = v.lag_behind(version);
            c.tokens += 1;
            c.lag_sum += lag;
            c.max_lag = c.max_lag.max(lag);
            if lag > eta {
                c.violations += 1;
            }
            per_lag[(lag as usize).min(63)] += 1;
        }
    }
    for (lag, n) in per_lag.iter().enumerate().filter(|(_, n)| **n > 0) {
        metrics::histogram!(m::TRAINER_TOKEN_VERSION_LAG_VERSIONS).record_many(lag as f64, *n);
    }
    c
}
