//! The Trainer actor: a dedicated thread pulls `groups_per_step` groups from the replay store
//! (holding weights `t`, with the live η), checks the staleness invariant on every token, trains,
//! and publishes version `t + 1`. The actor owns the thread; its handle reads the status and sends
//! control requests (checkpoint, halt) that the thread serves between steps.
//!
//! The invariant check is a guard, not the mechanism: the replay store never hands out a group
//! with a token older than `t − η`; a violation here would be a bug, counted and logged.
//!
//! Control between steps: a request arriving while the thread waits for a batch withdraws the
//! wait ([`crate::replay::PendingTake::cancel`]); a batch the store had already handed out is
//! consumed on disk, so it is trained before the request is served, never dropped. A step that
//! fails leaves the trainer idle (serving checkpoints and halt) with the error in its status: the
//! node then stops the run with a checkpoint instead of looping.
//!
//! Step metrics: every catalog-named scalar of a [`sluice_core::TrainStepOutput`] becomes its
//! gauge (or counter), see [`export_step_metrics`]; the actor itself records step time, the
//! per-token lag histogram, mean and max lag, and tokens/s when the backend does not.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde::Serialize;
use sluice_core::metrics::{self as m, MetricKind};
use sluice_core::{
    BackendError, GroupId, KnobsHandle, PolicyVersion, RolloutGroup, TrainerBackend, WeightSnapshot,
};
use tokio::sync::{mpsc, oneshot, watch};

use crate::checkpoint::CheckpointError;
use crate::replay::ReplayHandle;
use crate::telemetry::ActorCounters;
use crate::{ActorError, Sink};

/// A point-in-time view of the trainer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TrainerStatus {
    /// Version of the weights the next step starts from.
    pub version: PolicyVersion,
    /// Steps the run has taken (restarts included).
    pub steps: u64,
    /// Groups trained on (the run's, restarts included).
    pub trained_groups: u64,
    /// Steps that published nothing (every advantage zero); their groups were released from
    /// admission.
    pub skipped_steps: u64,
    /// Groups consumed by a step that failed (their training is lost; they are never retried).
    pub failed_groups: u64,
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
    /// Stop once the run has this many steps (counted from the start of the run, restarts
    /// included).
    pub max_steps: u64,
    /// Steps the run had already taken (restored from a checkpoint; 0 for a fresh run).
    pub start_step: u64,
    /// Groups the run had already trained on (restored from a checkpoint).
    pub start_trained_groups: u64,
    /// Record trained group ids to detect duplicates (tests and benchmarks).
    pub track_ids: bool,
}

/// Where the trainer stood when it wrote a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainerMark {
    /// Version of the saved weights.
    pub version: PolicyVersion,
    /// Steps of the run.
    pub steps: u64,
    /// Groups trained in the run.
    pub trained_groups: u64,
}

/// What the trainer tells the controller after every step it completes.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Seconds the step computed (the demand-aware admission's trainer pace).
    pub seconds: f64,
    /// The weights it published; `None` when the step was skipped (every advantage zero).
    pub weights: Option<WeightSnapshot>,
}

enum Control {
    Checkpoint {
        dir: PathBuf,
        reply: oneshot::Sender<Result<TrainerMark, BackendError>>,
    },
    /// Take no more batches (a graceful stop, before its checkpoint); answered once no step runs.
    Hold(oneshot::Sender<TrainerMark>),
    Halt,
}

/// Control requests waiting for the thread; it serves one between steps.
const CONTROL_QUEUE: usize = 8;

/// Typed handle; cloning is shallow.
#[derive(Clone)]
pub struct TrainerHandle {
    actor: ActorRef<()>,
    control: mpsc::Sender<Control>,
    status: Arc<Mutex<TrainerStatus>>,
    ids: Arc<Mutex<Vec<GroupId>>>,
    steps: watch::Receiver<u64>,
}

impl TrainerHandle {
    /// Starts the trainer thread; new weights go to `publish`.
    pub async fn spawn(
        backend: Box<dyn TrainerBackend>,
        replay: ReplayHandle,
        knobs: KnobsHandle,
        publish: Sink<StepReport>,
        options: TrainerOptions,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        let status = Arc::new(Mutex::new(TrainerStatus {
            version: backend.version(),
            steps: options.start_step,
            trained_groups: options.start_trained_groups,
            done: options.start_step >= options.max_steps,
            ..TrainerStatus::default()
        }));
        let ids = Arc::new(Mutex::new(Vec::new()));
        let (control, control_rx) = mpsc::channel(CONTROL_QUEUE);
        let (steps_tx, steps) = watch::channel(options.start_step);
        let worker = Worker {
            backend,
            replay,
            knobs,
            publish,
            options,
            status: Arc::clone(&status),
            ids: Arc::clone(&ids),
            control: control_rx,
            steps: steps_tx,
            trained: HashSet::new(),
            started: Instant::now(),
            held: false,
            poisoned: false,
            rt: tokio::runtime::Handle::current(),
            counters: ActorCounters::new("trainer"),
        };
        let (actor, join) = Actor::spawn(None, TrainerActor, (worker, control.clone()))
            .await
            .map_err(|e| ActorError::Spawn {
                actor: "trainer",
                message: e.to_string(),
            })?;
        Ok((
            Self {
                actor,
                control,
                status,
                ids,
                steps,
            },
            join,
        ))
    }

    /// The trainer's view.
    pub fn status(&self) -> TrainerStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Ids of the groups trained, in order (when `track_ids` is on).
    pub fn trained_ids(&self) -> Vec<GroupId> {
        self.ids.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The run's step count, updated after every step.
    pub fn steps(&self) -> watch::Receiver<u64> {
        self.steps.clone()
    }

    /// Has the backend write its state under `dir` between two steps (a batch already taken is
    /// trained first) and says where the trainer stood.
    pub async fn checkpoint(&self, dir: PathBuf) -> Result<TrainerMark, CheckpointError> {
        let gone = || CheckpointError::Unavailable("the trainer is not running".into());
        let (reply, rx) = oneshot::channel();
        self.control
            .send(Control::Checkpoint { dir, reply })
            .await
            .map_err(|_| gone())?;
        Ok(rx.await.map_err(|_| gone())??)
    }

    /// Stops training (after the current step; a batch already taken is trained) while the
    /// thread keeps serving checkpoints: a graceful stop holds the trainer before its checkpoint,
    /// so no step runs after the checkpoint's mark (its weights would be lost). Returns where the
    /// trainer stands.
    pub async fn hold(&self) -> Result<TrainerMark, ActorError> {
        let gone = || ActorError::Gone { actor: "trainer" };
        let (reply, rx) = oneshot::channel();
        self.control
            .send(Control::Hold(reply))
            .await
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// Stops the thread (after its current step; a batch already taken is trained) and the actor.
    pub async fn stop(&self) {
        let _ = self.control.send(Control::Halt).await;
        let _ = self.actor.stop_and_wait(None, None).await;
    }
}

struct TrainerActor;

/// The actor's state: the thread and how to halt it.
pub struct TrainerState {
    control: mpsc::Sender<Control>,
    thread: Option<JoinHandle<()>>,
}

impl Actor for TrainerActor {
    type Msg = ();
    type State = TrainerState;
    type Arguments = (Worker, mpsc::Sender<Control>);

    async fn pre_start(
        &self,
        _me: ActorRef<()>,
        (worker, control): Self::Arguments,
    ) -> Result<TrainerState, ActorProcessingErr> {
        let status = Arc::clone(&worker.status);
        let thread = std::thread::Builder::new()
            .name("trainer".into())
            .spawn(move || {
                // A panic outside a step (a step's own panic is caught in `train`) still ends
                // with the error in the status, so the node sees a dead trainer at once.
                if let Err(panic) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run()))
                {
                    let mut s = status.lock().unwrap_or_else(|e| e.into_inner());
                    s.error = Some(format!(
                        "the trainer thread panicked: {}",
                        panic_message(&*panic)
                    ));
                }
            })?;
        Ok(TrainerState {
            control,
            thread: Some(thread),
        })
    }

    async fn post_stop(
        &self,
        _me: ActorRef<()>,
        s: &mut TrainerState,
    ) -> Result<(), ActorProcessingErr> {
        // A full queue means a halt or checkpoint is already pending; the thread exits either way
        // once every sender is gone or a halt arrives.
        let _ = s.control.try_send(Control::Halt);
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
    publish: Sink<StepReport>,
    options: TrainerOptions,
    status: Arc<Mutex<TrainerStatus>>,
    ids: Arc<Mutex<Vec<GroupId>>>,
    control: mpsc::Receiver<Control>,
    steps: watch::Sender<u64>,
    trained: HashSet<GroupId>,
    started: Instant,
    /// A graceful stop asked for no more steps.
    held: bool,
    /// A step panicked: the backend's state is unknown, so it is never checkpointed (the last
    /// good checkpoint stays the one a restart resumes from).
    poisoned: bool,
    rt: tokio::runtime::Handle,
    /// Batches and control messages handled, weights published, failures by kind.
    counters: ActorCounters,
}

/// What the thread does next.
enum Flow {
    Continue,
    Halt,
}

enum Woke {
    Batch(Option<Vec<RolloutGroup>>),
    Control(Option<Control>),
}

impl Worker {
    fn run(mut self) {
        let rt = self.rt.clone();
        loop {
            match self.control.try_recv() {
                Ok(c) => match self.serve(c) {
                    Flow::Continue => continue,
                    Flow::Halt => break,
                },
                Err(mpsc::error::TryRecvError::Disconnected) => break,
                Err(mpsc::error::TryRecvError::Empty) => {}
            }
            if !self.can_train() {
                // Done or failed: stay around for checkpoints until halted.
                match self.control.blocking_recv() {
                    Some(c) => match self.serve(c) {
                        Flow::Continue => continue,
                        Flow::Halt => break,
                    },
                    None => break,
                }
            }
            let version = self.backend.version();
            let eta = self.knobs.current().max_version_lag;
            let wait = Instant::now();
            let mut take = self
                .replay
                .begin_take(self.options.groups_per_step, version, eta);
            let control = &mut self.control;
            let woke = rt.block_on(async {
                tokio::select! {
                    b = take.wait() => Woke::Batch(b),
                    c = control.recv() => Woke::Control(c),
                }
            });
            let idle = wait.elapsed().as_secs_f64();
            match woke {
                Woke::Batch(Some(batch)) => self.train(batch, version, eta, idle),
                Woke::Batch(None) => break,
                Woke::Control(c) => {
                    // A batch that arrived while the take was cancelled is trained all the same.
                    if let Some(batch) = rt.block_on(take.cancel()) {
                        self.train(batch, version, eta, idle);
                    }
                    let Some(c) = c else { break };
                    if let Flow::Halt = self.serve(c) {
                        break;
                    }
                }
            }
        }
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status.uptime_seconds = self.started.elapsed().as_secs_f64();
    }

    fn can_train(&self) -> bool {
        let s = self.status.lock().unwrap_or_else(|e| e.into_inner());
        !self.held && s.steps < self.options.max_steps && s.error.is_none()
    }

    fn mark(&self) -> TrainerMark {
        let s = self.status.lock().unwrap_or_else(|e| e.into_inner());
        TrainerMark {
            version: self.backend.version(),
            steps: s.steps,
            trained_groups: s.trained_groups,
        }
    }

    fn serve(&mut self, control: Control) -> Flow {
        self.counters.received(1);
        match control {
            Control::Halt => Flow::Halt,
            Control::Hold(reply) => {
                self.held = true;
                if reply.send(self.mark()).is_err() {
                    self.counters.dropped(1);
                }
                Flow::Continue
            }
            Control::Checkpoint { dir, reply } => {
                let result = if self.poisoned {
                    Err(BackendError::new(
                        "trainer_poisoned",
                        "a training step panicked, so the trainer's state is unknown; the last \
                         good checkpoint is kept",
                    ))
                } else {
                    self.backend.checkpoint(&dir).map(|()| self.mark())
                };
                if let Err(e) = &result {
                    tracing::error!(error = %e, dir = %dir.display(), "trainer checkpoint failed");
                    self.counters.error(e.kind);
                }
                if reply.send(result).is_err() {
                    self.counters.dropped(1);
                }
                Flow::Continue
            }
        }
    }

    /// One step on `batch`, taken from weights `version` under lag bound `eta`.
    fn train(&mut self, batch: Vec<RolloutGroup>, version: PolicyVersion, eta: u64, idle: f64) {
        self.counters.received(1);
        let check = check_batch(&batch, version, eta, &mut self.trained);
        if check.violations > 0 || check.duplicates > 0 {
            tracing::error!(
                violations = check.violations,
                duplicates = check.duplicates,
                "batch broke an invariant"
            );
        }
        let step_started = Instant::now();
        let backend = &mut self.backend;
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.train_step(&batch)))
                .unwrap_or_else(|panic| {
                    self.poisoned = true;
                    Err(BackendError::new(
                        "trainer_panic",
                        format!("the training step panicked: {}", panic_message(&*panic)),
                    ))
                });
        let seconds = step_started.elapsed().as_secs_f64();
        metrics::histogram!(m::TRAINER_STEP_SECONDS).record(seconds);
        let groups = batch.len() as u64;
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status.idle_seconds += idle;
        status.uptime_seconds = self.started.elapsed().as_secs_f64();
        status.lag_violations += check.violations;
        status.duplicate_groups += check.duplicates;
        let out = match outcome {
            Ok(out) => out,
            Err(e) => {
                // The batch is consumed on disk and this step is lost; nothing is retried, so
                // nothing is trained twice.
                tracing::error!(error = %e, step = status.steps + 1, "training step failed; the trainer stops");
                self.counters.error(e.kind);
                status.failed_groups += groups;
                status.error = Some(e.to_string());
                return;
            }
        };
        status.steps += 1;
        status.trained_groups += groups;
        status.trained_samples += batch.iter().map(|g| g.rollouts.len() as u64).sum::<u64>();
        status.trained_tokens += check.tokens;
        status.lag_sum += check.lag_sum;
        status.max_lag = status.max_lag.max(check.max_lag);
        status.done = status.steps >= self.options.max_steps;
        let steps = status.steps;
        if self.options.track_ids
            && let Ok(mut ids) = self.ids.lock()
        {
            ids.extend(batch.iter().map(|g| g.id));
        }
        metrics::counter!(m::TRAINER_STEPS).increment(1);
        metrics::counter!(m::TRAINER_TRAINED_TOKENS).increment(check.tokens);
        metrics::gauge!(m::TRAINER_IDLE_RATIO).set(status.idle_ratio());
        if check.tokens > 0 {
            metrics::gauge!(m::TRAINER_MEAN_VERSION_LAG_VERSIONS)
                .set(check.lag_sum as f64 / check.tokens as f64);
            metrics::gauge!(m::TRAINER_MAX_VERSION_LAG_VERSIONS).set(check.max_lag as f64);
        }
        if !out.metrics.contains_key(m::TRAINER_TOKENS_PER_SECOND) && seconds > 0.0 {
            metrics::gauge!(m::TRAINER_TOKENS_PER_SECOND).set(check.tokens as f64 / seconds);
        }
        export_step_metrics(&out.metrics);
        let published = out.weights.inspect(|w| status.version = w.version);
        if published.is_none() {
            status.skipped_steps += 1;
        }
        drop(status);
        if published.is_none() {
            // The batch is consumed but no version moved the admission bound: give its groups
            // back, or η + 1 skipped steps would stop admission for good.
            self.replay.release_skipped(groups);
        }
        if let Some(w) = &published {
            metrics::gauge!(m::TRAINER_POLICY_VERSION).set(w.version.0 as f64);
        }
        (self.publish)(StepReport {
            seconds,
            weights: published,
        });
        self.counters.sent(1);
        self.steps.send_replace(steps);
    }
}

/// The text of a caught panic (`panic!` with a literal or a formatted message).
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// Exports a step's catalog-named scalars: gauges are set, counters incremented by the value.
/// Histograms the actor records itself (step time, per-token lag) are skipped, so a step's mean
/// does not count twice; names outside the catalog are ignored (an ad-hoc name would be an
/// undocumented series). Returns how many names were ignored.
pub fn export_step_metrics(values: &BTreeMap<String, f64>) -> usize {
    let mut ignored = 0;
    for (name, v) in values {
        match m::find(name).map(|d| d.kind) {
            Some(MetricKind::Gauge) => metrics::gauge!(name.clone()).set(*v),
            Some(MetricKind::Counter) if *v >= 0.0 => {
                metrics::counter!(name.clone()).increment(v.round() as u64)
            }
            Some(MetricKind::Histogram)
                if name != m::TRAINER_STEP_SECONDS
                    && name != m::TRAINER_TOKEN_VERSION_LAG_VERSIONS =>
            {
                metrics::histogram!(name.clone()).record(*v)
            }
            Some(_) => {}
            None => ignored += 1,
        }
    }
    ignored
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
