//! The Trainer actor: a dedicated thread pulls `groups_per_step` groups from the replay store
//! (holding weights `t`, with the live η), checks the staleness invariant on every token, trains,
//! and publishes version `t + 1`. The actor owns the thread; its handle reads the status and sends
//! control requests (checkpoint, halt) that the thread serves between steps.
//!
//! Each trained step leaves the thread once, as one [`StepEvent`] handed to the controller and
//! the step feed, with the totals on the status watch ([`StepFeed`] says what a lagging reader gets).
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
mod event;
mod step;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use sluice_core::{
    BackendError, GroupId, KnobsHandle, PolicyVersion, RolloutGroup, TrainerBackend,
};
use tokio::sync::{mpsc, oneshot, watch};

use crate::checkpoint::CheckpointError;
use crate::counters::ActorCounters;
use crate::events::RunEvents;
use crate::replay::ReplayHandle;
use crate::{ActorError, Sink};

use event::StepPublisher;
pub use event::{MismatchStatus, STEP_FEED_CAPACITY, StepEvent, StepFeed, TrainerStatus};
pub use step::export_step_metrics;

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
    /// Where every step, the end of the budget and a failure are announced.
    pub events: RunEvents,
    /// Where every completed step goes too, with its weights (the run monitor's feed).
    pub feed: Option<StepFeed>,
    /// How the trainer scores advantages, to report them per situation (none: not reported).
    pub advantage: Option<sluice_trainer::AdvantageConfig>,
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
    status: watch::Receiver<TrainerStatus>,
    ids: Arc<Mutex<Vec<GroupId>>>,
}

impl TrainerHandle {
    /// The actor's cell (for linking it to a supervisor).
    pub fn cell(&self) -> ractor::ActorCell {
        self.actor.get_cell()
    }

    /// Starts the trainer thread; every step goes to `controller` (and to `options.feed`) as
    /// one [`StepEvent`].
    pub async fn spawn(
        backend: Box<dyn TrainerBackend>,
        replay: ReplayHandle,
        knobs: KnobsHandle,
        controller: Sink<Arc<StepEvent>>,
        mut options: TrainerOptions,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        // The weights it starts from are the published ones (the restored ones after a resume):
        // the gauge reads them before the first step does.
        metrics::gauge!(sluice_core::metrics::TRAINER_POLICY_VERSION)
            .set(backend.version().0 as f64);
        let status = TrainerStatus {
            version: backend.version(),
            steps: options.start_step,
            trained_groups: options.start_trained_groups,
            done: options.start_step >= options.max_steps,
            ..TrainerStatus::default()
        };
        let publisher = StepPublisher::new(
            status.clone(),
            controller,
            options.feed.take(),
            options.events.clone(),
        );
        let status_rx = publisher.status_channel().subscribe();
        let ids = Arc::new(Mutex::new(Vec::new()));
        let (control, control_rx) = mpsc::channel(CONTROL_QUEUE);
        let worker = Worker {
            backend,
            replay,
            knobs,
            publisher,
            options,
            status,
            ids: Arc::clone(&ids),
            control: control_rx,
            trained: HashSet::new(),
            started: Instant::now(),
            held: false,
            poisoned: false,
            rt: tokio::runtime::Handle::current(),
            counters: ActorCounters::new("trainer"),
            situation_series: Default::default(),
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
                status: status_rx,
                ids,
            },
            join,
        ))
    }

    /// The trainer's view (its totals after the newest step or change).
    pub fn status(&self) -> TrainerStatus {
        self.status.borrow().clone()
    }

    /// Ids of the groups trained, in order (when `track_ids` is on).
    pub fn trained_ids(&self) -> Vec<GroupId> {
        self.ids.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The trainer's status as it changes (after every step, failure and the end); a busy
    /// reader sees the newest only. [`TrainerStatus::steps`] is the run's step count.
    pub fn watch_status(&self) -> watch::Receiver<TrainerStatus> {
        self.status.clone()
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
pub struct TrainerActorState {
    control: mpsc::Sender<Control>,
    thread: Option<JoinHandle<()>>,
}

impl Actor for TrainerActor {
    type Msg = ();
    type State = TrainerActorState;
    type Arguments = (Worker, mpsc::Sender<Control>);

    async fn pre_start(
        &self,
        _me: ActorRef<()>,
        (worker, control): Self::Arguments,
    ) -> Result<TrainerActorState, ActorProcessingErr> {
        let status = worker.publisher.status_channel();
        let events = worker.publisher.events();
        let thread = std::thread::Builder::new()
            .name("trainer".into())
            .spawn(move || {
                // A panic outside a step (a step's own panic is caught in `train`) still ends
                // with the error in the status, so the node sees a dead trainer at once.
                if let Err(panic) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run()))
                {
                    let error = format!("the trainer thread panicked: {}", panic_message(&*panic));
                    status.send_modify(|s| s.error = Some(error));
                    events.announce();
                }
            })?;
        Ok(TrainerActorState {
            control,
            thread: Some(thread),
        })
    }

    async fn post_stop(
        &self,
        _me: ActorRef<()>,
        s: &mut TrainerActorState,
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
    /// Where each step and status change goes.
    publisher: StepPublisher,
    options: TrainerOptions,
    /// The trainer's totals (owned by the thread; readers get copies through the publisher).
    status: TrainerStatus,
    ids: Arc<Mutex<Vec<GroupId>>>,
    control: mpsc::Receiver<Control>,
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
    /// The (domain, situation) series exported so far (bounded).
    situation_series: sluice_core::metrics::ComponentSeries,
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
        self.status.uptime_seconds = self.started.elapsed().as_secs_f64();
        self.publisher.status(&self.status, false);
    }

    fn can_train(&self) -> bool {
        let s = &self.status;
        !self.held && s.steps < self.options.max_steps && s.error.is_none()
    }

    fn mark(&self) -> TrainerMark {
        TrainerMark {
            version: self.backend.version(),
            steps: self.status.steps,
            trained_groups: self.status.trained_groups,
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
                        crate::checkpoint::TRAINER_POISONED,
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
}

/// The text of a caught panic (`panic!` with a literal or a formatted message).
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}
