//! The InferenceEngine actor: owns the backend replicas, routes requests, relays completions, and
//! supervises the replicas. It is the one place requests are routed: a remote backend is one
//! server per replica, so servers are balanced, parked for and restarted here like local replicas.
//!
//! Replicas are built by a [`ReplicaFactory`] on the newest weights the actor has seen (it keeps
//! the latest published snapshot), so a replica rebuilt after a crash starts on them; a factory
//! that fails is a replica failure, retried after the backoff.
//!
//! Routing: a request carrying a preferred replica (a resumed turn goes back to the replica that
//! served it, for its prefix cache) goes there when that replica is alive; otherwise to the live
//! replica with the fewest requests. While no replica is alive, requests wait here (their number
//! is bounded by the controller's admission) and go out when one is back.
//!
//! Supervision (`[supervision]`): a replica fails when a call into it errors, when the fault
//! injector crashes it, or when the watchdog sees it hold requests without progress (no token
//! generated, nothing finished) for `engine_watchdog_s`. Its requests come back at once as
//! aborted with the output they were resumed from (the last partial the controller saw, §9), so
//! the controller parks them in the aborted bucket and resumes them. The replica is rebuilt from
//! the factory after an exponential [`Backoff`]; events of the dead incarnation still in flight are
//! recognised by their generation and dropped. The old backend is shut down off the actor (a hung
//! thread must not hang the mailbox).
//!
//! A replica whose *server* is gone (a head's replica on an engine node that does not answer,
//! or that left or was lost: [`InferenceBackend::server_gone`]) has not failed: its requests come
//! back the same way, but it is rebuilt at once on another server (or waits vacant, as a slot
//! with no server does), and nothing counts towards giving up.
//!
//! Giving up (seed 002: an inference infrastructure error is not a bad rollout): a replica that
//! fails `engine_max_restarts` times in a row without serving a request in between, or a node
//! where no replica can serve for `engine_unavailable_timeout_s`, is not restarted again; the
//! engine records why ([`EngineHandle::failure`]) and the node stops the run with a checkpoint
//! and a non-zero exit instead of turning every request into a failed rollout.
//!
//! Graceful stop: [`EngineHandle::close`] aborts everything in flight and answers every later
//! request as aborted at once, so the controller can store every partial before the checkpoint.
mod factory;
mod routing;
mod supervision;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort};
use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};
use sluice_engine::{
    Completion, EngineEvent, EngineStats, EventSink, GenerateRequest, InferenceBackend, TokenOutput,
};
use tokio::time::Instant;

use crate::counters::ActorCounters;
use crate::restart_policy::{Backoff, Watchdog};
use crate::{ActorError, Sink};

pub use factory::ReplicaFactory;
pub use supervision::{EngineSupervision, ReplicaHealth};

/// Builds the backend of replica `index`, starting at `version`, reporting to the sink: the
/// infallible, version-only form of a [`ReplicaFactory`] (it converts into one).
pub type BackendFactory =
    Arc<dyn Fn(u32, PolicyVersion, EventSink) -> Box<dyn InferenceBackend> + Send + Sync>;

/// What the engine tells the controller.
#[derive(Debug, Clone)]
pub enum EngineReport {
    /// A request left the engine (aborted requests carry their partial output).
    Finished {
        /// The outcome.
        completion: Completion,
        /// The replica that served it.
        replica: u32,
    },
    /// Every replica now runs weights `version`.
    WeightsUpdated {
        /// The version.
        version: PolicyVersion,
    },
}

enum Cmd {
    Generate(GenerateRequest, Option<u32>),
    Abort(RequestId),
    Update(WeightSnapshot, WeightUpdateMode),
    Event(u32, u64, EngineEvent),
    Died(u32, u64, &'static str),
    Restart(u32, u64),
    Tick,
    Close(RpcReplyPort<()>),
    Stats(RpcReplyPort<Vec<EngineStats>>),
    Health(RpcReplyPort<Vec<ReplicaHealth>>),
    Failure(RpcReplyPort<Option<String>>),
}

/// The actor's messages (private: use [`EngineHandle`]).
pub struct EngineMsg(Cmd);

/// Typed handle; cloning is shallow.
#[derive(Clone)]
pub struct EngineHandle {
    actor: ActorRef<EngineMsg>,
}

impl EngineHandle {
    /// The actor's cell (for linking it to a supervisor).
    pub fn cell(&self) -> ractor::ActorCell {
        self.actor.get_cell()
    }

    /// Starts `replicas` backends from `factory` at `version`; reports go to `reports`. Default
    /// supervision: backoff from 100 ms to 30 s, no watchdog, no faults.
    pub async fn spawn(
        replicas: u32,
        version: PolicyVersion,
        factory: impl Into<ReplicaFactory>,
        reports: Sink<EngineReport>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        Self::spawn_supervised(
            replicas,
            version,
            factory,
            reports,
            EngineSupervision::default(),
        )
        .await
    }

    /// [`Self::spawn`] with an explicit supervision policy.
    pub async fn spawn_supervised(
        replicas: u32,
        version: PolicyVersion,
        factory: impl Into<ReplicaFactory>,
        reports: Sink<EngineReport>,
        supervision: EngineSupervision,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        let factory = factory.into();
        let (actor, join) = Actor::spawn(
            None,
            EngineActor,
            Args {
                replicas,
                version,
                factory,
                reports,
                supervision,
            },
        )
        .await
        .map_err(|e| ActorError::Spawn {
            actor: "engine",
            message: e.to_string(),
        })?;
        Ok((Self { actor }, join))
    }

    fn cast(&self, cmd: Cmd) {
        let _ = self.actor.cast(EngineMsg(cmd));
    }

    /// Submits a request, to `preferred` replica when it is alive.
    pub fn generate(&self, request: GenerateRequest, preferred: Option<u32>) {
        self.cast(Cmd::Generate(request, preferred));
    }

    /// Aborts one request.
    pub fn abort(&self, id: RequestId) {
        self.cast(Cmd::Abort(id));
    }

    /// Installs new weights on every replica with `mode`.
    pub fn update_weights(&self, weights: WeightSnapshot, mode: WeightUpdateMode) {
        self.cast(Cmd::Update(weights, mode));
    }

    /// Graceful stop: aborts every request in flight (each reported with its partial output) and
    /// answers every later request as aborted at once. Returns when the aborts are sent.
    pub async fn close(&self) -> Result<(), ActorError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(EngineMsg(Cmd::Close(tx.into())))
            .map_err(|_| ActorError::Gone { actor: "engine" })?;
        rx.await.map_err(|_| ActorError::Gone { actor: "engine" })
    }

    /// Statistics of every replica (a replica waiting to restart shows zeros).
    pub async fn stats(&self) -> Result<Vec<EngineStats>, ActorError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(EngineMsg(Cmd::Stats(tx.into())))
            .map_err(|_| ActorError::Gone { actor: "engine" })?;
        rx.await.map_err(|_| ActorError::Gone { actor: "engine" })
    }

    /// Supervision record of every replica.
    pub async fn health(&self) -> Result<Vec<ReplicaHealth>, ActorError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(EngineMsg(Cmd::Health(tx.into())))
            .map_err(|_| ActorError::Gone { actor: "engine" })?;
        rx.await.map_err(|_| ActorError::Gone { actor: "engine" })
    }

    /// Why the engine gave up serving (a replica failing past its restarts, or no replica for
    /// too long); `None` while it serves. The node stops the run when this is set.
    pub async fn failure(&self) -> Result<Option<String>, ActorError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(EngineMsg(Cmd::Failure(tx.into())))
            .map_err(|_| ActorError::Gone { actor: "engine" })?;
        rx.await.map_err(|_| ActorError::Gone { actor: "engine" })
    }

    /// Stops the actor and joins every backend thread.
    pub async fn stop(&self) {
        let _ = self.actor.stop_and_wait(None, None).await;
    }
}

struct EngineActor;

struct Args {
    replicas: u32,
    version: PolicyVersion,
    factory: ReplicaFactory,
    reports: Sink<EngineReport>,
    supervision: EngineSupervision,
}

/// One replica slot: the backend (absent while a restart is pending) and its supervision.
struct Replica {
    backend: Option<Box<dyn InferenceBackend>>,
    /// Bumped at every failure; events and timers of older incarnations are ignored.
    generation: u64,
    version: PolicyVersion,
    load: usize,
    backoff: Backoff,
    watchdog: Option<Watchdog>,
    failed_at: Option<Instant>,
    health: ReplicaHealth,
    /// The factory's wake value when its backend was last built (see [`ReplicaFactory::with_wake`]).
    wake_seen: Option<u64>,
}

/// The actor's state.
pub struct EngineState {
    replicas: Vec<Replica>,
    owner: HashMap<RequestId, (u32, Option<TokenOutput>)>,
    /// Requests that arrived while no replica was alive.
    parked: VecDeque<(GenerateRequest, Option<u32>)>,
    /// The newest weights published (a version-only snapshot of the start version until the
    /// first update): every replica is built on them, a restarted one included.
    latest: WeightSnapshot,
    closed: bool,
    /// Since when no replica has been alive.
    unavailable_since: Option<Instant>,
    /// Why the engine gave up (see the module docs).
    failure: Option<String>,
    args: Args,
    me: ActorRef<EngineMsg>,
    /// The watchdog ticker and shutdowns of failed backends: owned, aborted or joined at stop.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Pending restarts.
    timers: Vec<tokio::task::JoinHandle<Result<(), MessagingErr<EngineMsg>>>>,
    /// Messages handled, reports sent to the controller, events of dead replicas dropped, and
    /// replica failures by kind.
    counters: ActorCounters,
}

impl Actor for EngineActor {
    type Msg = EngineMsg;
    type State = EngineState;
    type Arguments = Args;

    async fn pre_start(
        &self,
        me: ActorRef<EngineMsg>,
        args: Args,
    ) -> Result<EngineState, ActorProcessingErr> {
        let sup = &args.supervision;
        let replicas = (0..args.replicas)
            .map(|_| Replica {
                backend: None,
                generation: 0,
                version: args.version,
                load: 0,
                backoff: Backoff::new(sup.backoff_initial, sup.backoff_max),
                watchdog: sup.watchdog.map(Watchdog::new),
                failed_at: None,
                health: ReplicaHealth::default(),
                wake_seen: None,
            })
            .collect();
        let mut tasks = Vec::new();
        // The periodic checks (dead threads, the watchdog, the give-up timer): at least every
        // second, more often when a limit is shorter.
        let period = [sup.watchdog, sup.unavailable_timeout]
            .into_iter()
            .flatten()
            .min()
            .map_or(Duration::from_secs(1), |limit| {
                (limit / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
            });
        tasks.push(me.send_interval(period, || EngineMsg(Cmd::Tick)));
        let mut s = EngineState {
            replicas,
            owner: HashMap::new(),
            parked: VecDeque::new(),
            latest: WeightSnapshot::version_only(args.version),
            closed: false,
            unavailable_since: None,
            failure: None,
            args,
            me,
            tasks,
            timers: Vec::new(),
            counters: ActorCounters::new("engine"),
        };
        for i in 0..s.replicas.len() {
            s.build_or_fail(i);
        }
        Ok(s)
    }

    async fn handle(
        &self,
        _me: ActorRef<EngineMsg>,
        EngineMsg(cmd): EngineMsg,
        s: &mut EngineState,
    ) -> Result<(), ActorProcessingErr> {
        s.counters.received(1);
        match cmd {
            Cmd::Generate(req, preferred) => s.route(req, preferred),
            Cmd::Abort(id) => {
                if let Some((r, _)) = s.owner.get(&id) {
                    let r = *r;
                    let result = s.replicas[r as usize].backend.as_ref().map(|b| b.abort(id));
                    if let Some(Err(e)) = result {
                        s.fail_replica(r, "error", Some(&e));
                    }
                }
            }
            Cmd::Update(w, mode) => {
                if w.version >= s.latest.version {
                    s.latest = w.clone();
                }
                for i in 0..s.replicas.len() {
                    let result = s.replicas[i]
                        .backend
                        .as_ref()
                        .map(|b| b.update_weights(w.clone(), mode));
                    if let Some(Err(e)) = result {
                        s.fail_replica(i as u32, "error", Some(&e));
                    }
                }
            }
            Cmd::Event(replica, generation, event) => {
                if s.replicas[replica as usize].generation != generation {
                    // A dead incarnation's last words: its requests were already handed back.
                    s.counters.dropped(1);
                    return Ok(());
                }
                s.on_event(replica, event);
            }
            Cmd::Died(replica, generation, cause) => {
                if s.replicas[replica as usize].generation == generation {
                    s.fail_replica(replica, cause, None);
                }
            }
            Cmd::Restart(replica, generation) => s.restart(replica, generation),
            Cmd::Tick => s.watch(),
            Cmd::Close(reply) => {
                s.closed = true;
                for i in 0..s.replicas.len() {
                    let result = s.replicas[i].backend.as_ref().map(|b| b.abort_all());
                    if let Some(Err(e)) = result {
                        s.fail_replica(i as u32, "error", Some(&e));
                    }
                }
                while let Some((req, _)) = s.parked.pop_front() {
                    s.refuse(req);
                }
                let _ = reply.send(());
            }
            Cmd::Stats(reply) => {
                let stats = s
                    .replicas
                    .iter()
                    .map(|r| r.backend.as_ref().map(|b| b.stats()).unwrap_or_default())
                    .collect();
                let _ = reply.send(stats);
            }
            Cmd::Health(reply) => {
                let _ = reply.send(s.replicas.iter().map(|r| r.health.clone()).collect());
            }
            Cmd::Failure(reply) => {
                let _ = reply.send(s.failure.clone());
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<EngineMsg>,
        s: &mut EngineState,
    ) -> Result<(), ActorProcessingErr> {
        let backends: Vec<_> = s
            .replicas
            .iter_mut()
            .filter_map(|r| r.backend.take())
            .collect();
        tokio::task::spawn_blocking(move || {
            for mut b in backends {
                b.shutdown();
            }
        })
        .await
        .ok();
        for t in s.timers.drain(..) {
            t.abort();
        }
        for t in s.tasks.drain(..) {
            t.abort();
            // A failed backend whose thread hangs never joins; do not hang the stop with it.
            let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
        }
        Ok(())
    }
}
