//! The InferenceEngine actor: owns the backend replicas, routes requests, relays completions.
//!
//! Routing: a request carrying a preferred replica (a resumed turn goes back to the replica that
//! served it, for its prefix cache) goes there when that replica is alive; otherwise to the
//! replica with the fewest requests. A replica whose backend stopped is restarted from the
//! factory; its requests come back as aborted with an empty output (the controller keeps the
//! partial it last saw, per §9).

use std::collections::HashMap;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use sluice_core::metrics as m;
use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};
use sluice_engine::{
    Completion, EngineError, EngineEvent, EngineStats, EventSink, FinishReason, GenerateRequest,
    InferenceBackend, TokenOutput,
};

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

enum Cmd {
    Generate(GenerateRequest, Option<u32>),
    Abort(RequestId),
    Update(WeightSnapshot, WeightUpdateMode),
    Event(u32, EngineEvent),
    Stats(RpcReplyPort<Vec<EngineStats>>),
}

/// The actor's messages (private: use [`EngineHandle`]).
pub struct EngineMsg(Cmd);

/// Typed handle; cloning is shallow.
#[derive(Clone)]
pub struct EngineHandle {
    actor: ActorRef<EngineMsg>,
}

impl EngineHandle {
    /// Starts `replicas` backends from `factory` at `version`; reports go to `reports`.
    pub async fn spawn(
        replicas: u32,
        version: PolicyVersion,
        factory: BackendFactory,
        reports: Sink<EngineReport>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        let (actor, join) = Actor::spawn(
            None,
            EngineActor,
            Args {
                replicas,
                version,
                factory,
                reports,
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

    /// Statistics of every replica.
    pub async fn stats(&self) -> Result<Vec<EngineStats>, ActorError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(EngineMsg(Cmd::Stats(tx.into())))
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
}

/// The actor's state.
pub struct EngineState {
    backends: Vec<Option<Box<dyn InferenceBackend>>>,
    versions: Vec<PolicyVersion>,
    owner: HashMap<RequestId, (u32, Option<TokenOutput>)>,
    load: Vec<usize>,
    target: PolicyVersion,
    args: Args,
    me: ActorRef<EngineMsg>,
}

fn sink_for(me: &ActorRef<EngineMsg>, replica: u32) -> EventSink {
    let me = me.clone();
    Arc::new(move |e| {
        let _ = me.cast(EngineMsg(Cmd::Event(replica, e)));
    })
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
        let backends = (0..args.replicas)
            .map(|i| Some((args.factory)(i, args.version, sink_for(&me, i))))
            .collect();
        Ok(EngineState {
            backends,
            versions: vec![args.version; args.replicas as usize],
            owner: HashMap::new(),
            load: vec![0; args.replicas as usize],
            target: args.version,
            args,
            me,
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<EngineMsg>,
        EngineMsg(cmd): EngineMsg,
        s: &mut EngineState,
    ) -> Result<(), ActorProcessingErr> {
        metrics::counter!(m::ACTOR_RECEIVED, "actor" => "engine").increment(1);
        match cmd {
            Cmd::Generate(req, preferred) => {
                let n = s.backends.len();
                let replica = match preferred {
                    Some(r) if (r as usize) < n && s.backends[r as usize].is_some() => r as usize,
                    _ => (0..n).min_by_key(|i| s.load[*i]).unwrap_or(0),
                };
                s.owner.insert(req.id, (replica as u32, req.resume.clone()));
                s.load[replica] += 1;
                let result = match &s.backends[replica] {
                    Some(b) => b.submit(req),
                    None => Err(EngineError::Stopped {
                        backend: format!("replica {replica}"),
                    }),
                };
                if let Err(e) = result {
                    s.fail_replica(replica as u32, &e);
                }
            }
            Cmd::Abort(id) => {
                if let Some((r, _)) = s.owner.get(&id)
                    && let Some(b) = &s.backends[*r as usize]
                    && let Err(e) = b.abort(id)
                {
                    s.fail_replica(*r, &e);
                }
            }
            Cmd::Update(w, mode) => {
                s.target = s.target.max(w.version);
                for i in 0..s.backends.len() {
                    let result = match &s.backends[i] {
                        Some(b) => b.update_weights(w.clone(), mode),
                        None => Ok(()),
                    };
                    if let Err(e) = result {
                        s.fail_replica(i as u32, &e);
                    }
                }
            }
            Cmd::Event(replica, EngineEvent::Finished(c)) => {
                metrics::counter!(m::ENGINE_FINISHED_REQUESTS, "reason" => c.finish.as_label())
                    .increment(1);
                if s.owner.remove(&c.id).is_some() {
                    s.load[replica as usize] = s.load[replica as usize].saturating_sub(1);
                }
                (s.args.reports)(EngineReport::Finished {
                    completion: c,
                    replica,
                });
            }
            Cmd::Event(
                replica,
                EngineEvent::WeightsUpdated {
                    version,
                    pause,
                    mode,
                },
            ) => {
                metrics::histogram!(m::ENGINE_WEIGHT_SYNC_PAUSE_SECONDS, "mode" => mode.as_str())
                    .record(pause.as_secs_f64());
                s.versions[replica as usize] = version;
                if version >= s.target && s.versions.iter().all(|v| *v >= s.target) {
                    (s.args.reports)(EngineReport::WeightsUpdated { version: s.target });
                }
            }
            Cmd::Stats(reply) => {
                let stats = s
                    .backends
                    .iter()
                    .map(|b| b.as_ref().map(|b| b.stats()).unwrap_or_default())
                    .collect();
                let _ = reply.send(stats);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<EngineMsg>,
        s: &mut EngineState,
    ) -> Result<(), ActorProcessingErr> {
        let backends: Vec<_> = s.backends.iter_mut().filter_map(Option::take).collect();
        tokio::task::spawn_blocking(move || {
            for mut b in backends {
                b.shutdown();
            }
        })
        .await
        .ok();
        Ok(())
    }
}

impl EngineState {
    /// Restarts a replica whose backend failed; its requests return as aborted with the output
    /// they were resumed from (nothing newer was reported).
    fn fail_replica(&mut self, replica: u32, error: &EngineError) {
        tracing::warn!(replica, error = %error, "engine replica failed; restarting it");
        metrics::counter!(m::ACTOR_ERRORS, "actor" => "engine", "kind" => error.kind())
            .increment(1);
        metrics::counter!(m::ACTOR_RESTARTS, "actor" => "engine").increment(1);
        if let Some(mut old) = self.backends[replica as usize].take() {
            old.shutdown();
        }
        let lost: Vec<(RequestId, Option<TokenOutput>)> = self
            .owner
            .iter()
            .filter(|(_, (r, _))| *r == replica)
            .map(|(id, (_, resume))| (*id, resume.clone()))
            .collect();
        for (id, resume) in lost {
            self.owner.remove(&id);
            let completion = Completion {
                id,
                output: resume.unwrap_or_default(),
                finish: FinishReason::Abort,
            };
            (self.args.reports)(EngineReport::Finished {
                completion,
                replica,
            });
        }
        self.load[replica as usize] = 0;
        let fresh = (self.args.factory)(replica, self.target, sink_for(&self.me, replica));
        self.backends[replica as usize] = Some(fresh);
        self.versions[replica as usize] = self.target;
    }
}
