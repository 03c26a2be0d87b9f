//! The InferenceEngine actor: owns the backend replicas, routes requests, relays completions, and
//! supervises the replicas.
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
//! Giving up (seed 002: an inference infrastructure error is not a bad rollout): a replica that
//! fails `engine_max_restarts` times in a row without serving a request in between, or a node
//! where no replica can serve for `engine_unavailable_timeout_s`, is not restarted again; the
//! engine records why ([`EngineHandle::failure`]) and the node stops the run with a checkpoint
//! and a non-zero exit instead of turning every request into a failed rollout.
//!
//! Graceful stop: [`EngineHandle::close`] aborts everything in flight and answers every later
//! request as aborted at once, so the controller can store every partial before the checkpoint.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort};
use serde::Serialize;
use sluice_core::config::{FaultsConfig, SupervisionConfig};
use sluice_core::metrics as m;
use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};
use sluice_engine::{
    Completion, EngineError, EngineEvent, EngineStats, EventSink, FinishReason, GenerateRequest,
    InferenceBackend, TokenOutput,
};

use crate::faults::{EngineFaults, FaultyBackend};
use crate::supervise::{Backoff, Watchdog};
use crate::telemetry::ActorCounters;
use crate::{ActorError, Sink};

/// Builds the backend of replica `index`, starting at `version`, reporting to the sink.
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

/// How the engine supervises its replicas.
#[derive(Debug, Clone)]
pub struct EngineSupervision {
    /// First restart delay (doubles per consecutive failure of a replica).
    pub backoff_initial: Duration,
    /// Longest restart delay.
    pub backoff_max: Duration,
    /// Restart a replica that holds requests without progress this long (`None` = off).
    pub watchdog: Option<Duration>,
    /// Give up on a replica after this many failures in a row with nothing served in between
    /// (0 = never).
    pub max_restarts: u64,
    /// Give up when no replica can serve for this long (`None` = never).
    pub unavailable_timeout: Option<Duration>,
    /// Injected faults (tests and drills).
    pub faults: EngineFaults,
}

impl Default for EngineSupervision {
    fn default() -> Self {
        Self {
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(30),
            watchdog: None,
            max_restarts: 0,
            unavailable_timeout: None,
            faults: EngineFaults::default(),
        }
    }
}

impl EngineSupervision {
    /// The policy of `[supervision]` with the engine faults of `[faults]`.
    pub fn from_config(supervision: &SupervisionConfig, faults: &FaultsConfig) -> Self {
        Self {
            backoff_initial: supervision.restart_backoff_initial,
            backoff_max: supervision.restart_backoff_max,
            watchdog: supervision.engine_watchdog,
            max_restarts: supervision.engine_max_restarts,
            unavailable_timeout: supervision.engine_unavailable_timeout,
            faults: EngineFaults::from_config(faults),
        }
    }
}

/// A replica's supervision record, for `/v1/status` and the tests.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReplicaHealth {
    /// A backend is running (false while waiting out a restart backoff).
    pub alive: bool,
    /// Times the replica was rebuilt.
    pub restarts: u64,
    /// Failures by cause: `error` (a call failed), `crash` (injected), `watchdog`.
    pub failures: std::collections::BTreeMap<String, u64>,
    /// Seconds from the last failure to the rebuilt backend taking requests.
    pub last_restart_seconds: Option<f64>,
    /// Requests handed back as aborted because the replica died.
    pub requests_returned: u64,
    /// Failures since the replica last served a request.
    pub failures_in_a_row: u64,
    /// The last failure's error (or cause).
    pub last_error: Option<String>,
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
    /// Starts `replicas` backends from `factory` at `version`; reports go to `reports`. Default
    /// supervision: backoff from 100 ms to 30 s, no watchdog, no faults.
    pub async fn spawn(
        replicas: u32,
        version: PolicyVersion,
        factory: BackendFactory,
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
        factory: BackendFactory,
        reports: Sink<EngineReport>,
        supervision: EngineSupervision,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
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
    factory: BackendFactory,
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
}

/// The actor's state.
pub struct EngineState {
    replicas: Vec<Replica>,
    owner: HashMap<RequestId, (u32, Option<TokenOutput>)>,
    /// Requests that arrived while no replica was alive.
    parked: VecDeque<(GenerateRequest, Option<u32>)>,
    target: PolicyVersion,
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

fn sink_for(me: &ActorRef<EngineMsg>, replica: u32, generation: u64) -> EventSink {
    let me = me.clone();
    Arc::new(move |e| {
        let _ = me.cast(EngineMsg(Cmd::Event(replica, generation, e)));
    })
}

impl EngineState {
    /// Builds replica `i`'s backend for its current generation (wrapped by the fault injector).
    fn build(&mut self, i: usize) {
        let generation = self.replicas[i].generation;
        let sink = sink_for(&self.me, i as u32, generation);
        let faults = &self.args.supervision.faults;
        let backend: Box<dyn InferenceBackend> = if faults.any() {
            let me = self.me.clone();
            let replica = i as u32;
            let on_crash = Box::new(move || {
                let _ = me.cast(EngineMsg(Cmd::Died(replica, generation, "crash")));
            });
            let factory = Arc::clone(&self.args.factory);
            let target = self.target;
            Box::new(FaultyBackend::new(
                move |gated| factory(replica, target, gated),
                sink,
                faults.clone(),
                on_crash,
            ))
        } else {
            (self.args.factory)(i as u32, self.target, sink)
        };
        let r = &mut self.replicas[i];
        let counter = backend.stats().generated_tokens;
        r.backend = Some(backend);
        r.version = self.target;
        r.load = 0;
        r.backoff.started(Instant::now());
        if let Some(w) = &mut r.watchdog {
            w.reset(counter);
        }
    }
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
            target: args.version,
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
            s.build(i);
            s.replicas[i].health.alive = true;
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
                s.target = s.target.max(w.version);
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

impl EngineState {
    /// Sends a report to the controller (the engine actor's one outbound flow).
    fn report(&self, report: EngineReport) {
        self.counters.sent(1);
        (self.args.reports)(report);
    }

    fn route(&mut self, req: GenerateRequest, preferred: Option<u32>) {
        if self.closed {
            self.refuse(req);
            return;
        }
        let alive = |i: usize| self.replicas[i].backend.is_some();
        let n = self.replicas.len();
        let replica = match preferred {
            Some(r) if (r as usize) < n && alive(r as usize) => Some(r as usize),
            _ => (0..n)
                .filter(|i| alive(*i))
                .min_by_key(|i| self.replicas[*i].load),
        };
        let Some(replica) = replica else {
            self.parked.push_back((req, preferred));
            return;
        };
        self.owner
            .insert(req.id, (replica as u32, req.resume.clone()));
        let r = &mut self.replicas[replica];
        r.load += 1;
        let result = r.backend.as_ref().map(|b| b.submit(req));
        if let Some(Err(e)) = result {
            self.fail_replica(replica as u32, "error", Some(&e));
        }
    }

    /// Answers a request as aborted without running it (graceful stop).
    fn refuse(&self, req: GenerateRequest) {
        self.report(EngineReport::Finished {
            completion: Completion {
                id: req.id,
                output: req.resume.unwrap_or_default(),
                finish: FinishReason::Abort,
            },
            replica: 0,
        });
    }

    fn on_event(&mut self, replica: u32, event: EngineEvent) {
        let r = &mut self.replicas[replica as usize];
        match event {
            EngineEvent::Finished(c) => {
                metrics::counter!(m::ENGINE_FINISHED_REQUESTS, "reason" => c.finish.as_label())
                    .increment(1);
                if c.finish != FinishReason::Abort {
                    // It served a request: earlier failures were transient.
                    r.health.failures_in_a_row = 0;
                }
                if self.owner.remove(&c.id).is_some() {
                    r.load = r.load.saturating_sub(1);
                }
                if let Some(w) = &mut r.watchdog {
                    w.progressed();
                }
                self.report(EngineReport::Finished {
                    completion: c,
                    replica,
                });
            }
            EngineEvent::WeightsUpdated {
                version,
                pause,
                mode,
            } => {
                metrics::histogram!(m::ENGINE_WEIGHT_SYNC_PAUSE_SECONDS, "mode" => mode.as_str())
                    .record(pause.as_secs_f64());
                r.version = version;
                self.report_versions();
            }
        }
    }

    /// Reports when every live replica runs the target version.
    fn report_versions(&self) {
        let live = self.replicas.iter().filter(|r| r.backend.is_some());
        if live.clone().all(|r| r.version >= self.target) && live.count() > 0 {
            self.report(EngineReport::WeightsUpdated {
                version: self.target,
            });
        }
    }

    /// The periodic checks: the give-up timer, and the watchdog, which fails a replica holding
    /// requests without progress for its limit.
    fn watch(&mut self) {
        let now = Instant::now();
        if let (Some(since), Some(limit)) = (
            self.unavailable_since,
            self.args.supervision.unavailable_timeout,
        ) && now.saturating_duration_since(since) >= limit
        {
            let last = self
                .replicas
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    Some(format!("replica {i}: {}", r.health.last_error.as_ref()?))
                })
                .collect::<Vec<_>>()
                .join("; ");
            self.give_up(format!(
                "no engine replica could serve for {:.0} s (supervision.engine_unavailable_timeout_s); last errors: {last}",
                limit.as_secs_f64()
            ));
        }
        let dead: Vec<u32> = self
            .replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| r.backend.as_ref().is_some_and(|b| !b.is_alive()))
            .map(|(i, _)| i as u32)
            .collect();
        for i in dead {
            let e = EngineError::Stopped {
                backend: format!("replica {i} (its compute thread ended unexpectedly)"),
            };
            self.fail_replica(i, "died", Some(&e));
        }
        let stuck: Vec<u32> = self
            .replicas
            .iter_mut()
            .enumerate()
            .filter_map(|(i, r)| {
                let b = r.backend.as_ref()?;
                let w = r.watchdog.as_mut()?;
                let counter = b.stats().generated_tokens;
                w.check(now, r.load > 0, counter).then_some(i as u32)
            })
            .collect();
        for i in stuck {
            tracing::warn!(
                replica = i,
                "engine replica made no progress; the watchdog restarts it"
            );
            self.fail_replica(i, "watchdog", None);
        }
    }

    /// A replica failed: hand its requests back as aborted (with the output they were resumed
    /// from: nothing newer was reported), shut the backend down off the actor, and schedule the
    /// restart after the backoff.
    fn fail_replica(&mut self, replica: u32, cause: &'static str, error: Option<&EngineError>) {
        let kind = error.map_or(
            match cause {
                "watchdog" => "engine_watchdog",
                "crash" => "engine_crash",
                _ => "engine_failure",
            },
            EngineError::kind,
        );
        self.counters.error(kind);
        let described = error.map_or_else(|| format!("{cause} ({kind})"), ToString::to_string);
        let now = Instant::now();
        let r = &mut self.replicas[replica as usize];
        if let Some(mut old) = r.backend.take() {
            self.tasks
                .push(tokio::task::spawn_blocking(move || old.shutdown()));
        }
        r.generation += 1;
        r.load = 0;
        r.failed_at = Some(now);
        r.health.alive = false;
        *r.health.failures.entry(cause.to_owned()).or_default() += 1;
        r.health.failures_in_a_row += 1;
        r.health.last_error = Some(described.clone());
        let in_a_row = r.health.failures_in_a_row;
        let generation = r.generation;
        let delay = r.backoff.failed(now);
        let max = self.args.supervision.max_restarts;
        let give_up = max > 0 && in_a_row > max;
        if !give_up {
            tracing::warn!(replica, error = %described, "engine replica failed; restarting it");
        }
        if self.unavailable_since.is_none() && self.replicas.iter().all(|r| r.backend.is_none()) {
            self.unavailable_since = Some(now);
        }
        let lost: Vec<(RequestId, Option<TokenOutput>)> = self
            .owner
            .iter()
            .filter(|(_, (rep, _))| *rep == replica)
            .map(|(id, (_, resume))| (*id, resume.clone()))
            .collect();
        self.replicas[replica as usize].health.requests_returned += lost.len() as u64;
        for (id, resume) in lost {
            self.owner.remove(&id);
            self.report(EngineReport::Finished {
                completion: Completion {
                    id,
                    output: resume.unwrap_or_default(),
                    finish: FinishReason::Abort,
                },
                replica,
            });
        }
        self.tasks.retain(|t| !t.is_finished());
        if give_up {
            self.give_up(format!(
                "engine replica {replica} failed {in_a_row} times in a row without serving a \
                 request (supervision.engine_max_restarts = {max}); last error: {described}"
            ));
            return;
        }
        metrics::gauge!(m::ACTOR_RESTART_BACKOFF_SECONDS, "actor" => "engine")
            .set(delay.as_secs_f64());
        self.timers.retain(|t| !t.is_finished());
        self.timers.push(
            self.me
                .send_after(delay, move || EngineMsg(Cmd::Restart(replica, generation))),
        );
    }

    fn restart(&mut self, replica: u32, generation: u64) {
        let i = replica as usize;
        if self.replicas[i].generation != generation || self.replicas[i].backend.is_some() {
            return;
        }
        self.build(i);
        self.unavailable_since = None;
        let r = &mut self.replicas[i];
        r.health.alive = true;
        r.health.restarts += 1;
        r.health.last_restart_seconds = r.failed_at.take().map(|t| t.elapsed().as_secs_f64());
        metrics::counter!(m::ACTOR_RESTARTS, "actor" => "engine").increment(1);
        metrics::gauge!(m::ACTOR_RESTART_BACKOFF_SECONDS, "actor" => "engine").set(0.0);
        tracing::info!(
            replica,
            restarts = r.health.restarts,
            "engine replica restarted"
        );
        // Weights published while it was down: it starts at the target already.
        self.report_versions();
        let parked: Vec<_> = self.parked.drain(..).collect();
        for (req, preferred) in parked {
            self.route(req, preferred);
        }
    }

    /// Stops restarting and records why; the node stops the run (see the module docs).
    fn give_up(&mut self, reason: String) {
        if self.failure.is_some() {
            return;
        }
        tracing::error!(%reason, "the engine cannot serve; the run stops");
        self.counters.error("engine_unavailable");
        self.failure = Some(reason);
    }
}
