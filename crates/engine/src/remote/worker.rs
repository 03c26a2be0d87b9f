//! The remote backend's loop: install the run's weights on the server before it gets work,
//! send requests, relay completions, publish weights, and go down for good on a failed call
//! (the engine actor rebuilds the replica). A call that got no answer at all (connection
//! refused or reset, nothing within its deadline) says the server is *unreachable*, which the
//! backend reports apart from a server that answered with an error ([`Fault`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_core::{PolicyVersion, RequestId, WeightUpdateMode};
use sluice_http::{HttpClient, Method, StatusCode};
use sluice_model::ModelWeights;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::fault::Fault;
use super::{Command, RemoteParams, Shared, wire};
use crate::backend::{Completion, EngineEvent, EventSink, FinishReason, GenerateRequest};
use calls::{finish_from_reply, load, write};

mod calls;

pub(super) struct Server {
    pub(super) client: HttpClient,
    /// Not marked down (once down, it stays down: the replica is rebuilt).
    pub(super) up: bool,
    /// Holds the run's weights: it may get work.
    pub(super) ready: bool,
}

/// How often the server's load is read.
const LOAD_PERIOD: Duration = Duration::from_secs(1);

/// Bad replies in a row after which the server is down. One is a failed request (its group
/// resumes or drops it); a server that keeps breaking the protocol would otherwise fail every
/// request it is given while it counts as up, until the run's no-progress guard stopped it.
pub(super) const MAX_BAD_REPLIES_IN_A_ROW: u32 = 4;

/// Reading the server's load (see the module docs).
#[derive(Debug, Default)]
pub(super) struct ServerLoad {
    /// The server's busy seconds at the first reading.
    base: Option<f64>,
    /// A reading is under way.
    pending: bool,
    /// The server does not report its load: it is not asked again.
    unsupported: bool,
    /// The first reading is over, whatever it found. Until then requests wait, so that the
    /// baseline holds none of this replica's work (a request that finished before the first
    /// reading was answered would otherwise never count as busy time).
    settled: bool,
}

/// What a reading of the server's load found.
enum Reading {
    /// Busy seconds since the server started, and requests it has queued.
    Load { busy_seconds: f64, waiting: u64 },
    /// The server says it holds a version (`weight_version`) this head never published.
    Unpublished(PolicyVersion),
    /// The server answers without them: it does not report its load.
    Unsupported,
    /// The call failed; a failed reading says nothing about the server (generation calls
    /// decide whether it is down): read again at the next tick.
    Failed,
}

/// What a spawned call reports back to the worker loop.
enum Done {
    /// A reading of the server's load.
    Load(Reading),
    Generate {
        id: RequestId,
        /// What goes to the sink (on a failure: an abort with the partial).
        completion: Completion,
        /// The failure that marks the server down, if any.
        failure: Option<Fault>,
    },
    Update {
        version: PolicyVersion,
        mode: WeightUpdateMode,
        asked: Instant,
        failure: Option<Fault>,
    },
    /// An abort call ended (its outcome shows in the aborted request's reply).
    Control,
    /// The server's install of `version` ended.
    Installed {
        version: PolicyVersion,
        result: Result<(), Fault>,
    },
}

pub(super) struct Worker {
    pub(super) params: RemoteParams,
    pub(super) server: Server,
    pub(super) sink: EventSink,
    pub(super) shared: Arc<Shared>,
    pub(super) version: PolicyVersion,
    /// Request → resumed tokens it came with.
    pub(super) inflight: HashMap<RequestId, usize>,
    /// The weights the server installs before work: the initial ones, or a newer update's that
    /// arrived during the install.
    pub(super) latest: Option<Arc<ModelWeights>>,
    /// Requests that arrived while the server was still installing. Bounded by what the engine
    /// actor routes here (the controller's admission bounds that).
    pub(super) waiting: VecDeque<GenerateRequest>,
    pub(super) load: ServerLoad,
    /// Replies refused as `remote_bad_reply` since the last sound one.
    pub(super) bad_replies: u32,
}

impl Worker {
    pub(super) async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        let mut tasks: JoinSet<Done> = JoinSet::new();
        if !self.server.ready {
            self.install(&mut tasks);
        }
        let mut reading = tokio::time::interval(LOAD_PERIOD);
        reading.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = rx.recv() => match command {
                    None | Some(Command::Shutdown) => return,
                    Some(c) => self.apply(c, &mut tasks),
                },
                _ = reading.tick() => self.read_load(&mut tasks),
                Some(done) = tasks.join_next(), if !tasks.is_empty() => match done {
                    Ok(d) => self.on_done(d, &mut tasks),
                    Err(e) => tracing::error!(error = %e, "remote engine call panicked"),
                },
            }
        }
    }

    fn apply(&mut self, command: Command, tasks: &mut JoinSet<Done>) {
        match command {
            Command::Submit(request) => self.dispatch(request, tasks),
            Command::Abort(id) => {
                if self.inflight.contains_key(&id) {
                    self.control(json!({"rid": id.to_string()}), tasks);
                } else if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
                    let request = self.waiting.remove(i).expect("found");
                    self.give_back(request);
                }
            }
            Command::AbortAll => {
                for request in std::mem::take(&mut self.waiting) {
                    self.give_back(request);
                }
                if self.server.up {
                    self.control(json!({"abort_all": true}), tasks);
                }
            }
            Command::Update(weights, mode, asked) => self.update(weights, mode, asked, tasks),
            Command::Shutdown => {}
        }
    }

    /// Finishes `request` unserved as aborted with the partial it came with.
    fn give_back(&self, request: GenerateRequest) {
        (self.sink)(EngineEvent::Finished(Completion {
            id: request.id,
            output: request.resume.unwrap_or_default(),
            finish: FinishReason::Abort,
        }));
    }

    fn dispatch(&mut self, request: GenerateRequest, tasks: &mut JoinSet<Done>) {
        if !self.server.up {
            // The replica is dead and about to be rebuilt: the rollout resumes elsewhere.
            self.give_back(request);
            return;
        }
        if !self.server.ready {
            self.waiting.push_back(request);
            return;
        }
        if !self.load.settled {
            self.waiting.push_back(request);
            self.read_load(tasks); // nothing when a reading is under way
            return;
        }
        let partial = request.resume.clone().unwrap_or_default();
        self.inflight.insert(request.id, partial.len());
        self.publish();
        let client = self.server.client.clone();
        let timeout = self.params.request_timeout;
        let body = wire::completion_body(&request, self.params.model_name.as_deref());
        let limits = wire::ReplyLimits {
            version: self.version,
            max_new_tokens: request
                .params
                .max_tokens
                .saturating_sub(partial.len() as u32),
            // The weights the head gave the server: their vocabulary is the server's.
            vocab_size: self.latest.as_ref().map(|w| w.config().vocab_size),
        };
        tasks.spawn(async move {
            let id = request.id;
            let fail = |fault: Fault| {
                let aborted = Completion {
                    id,
                    output: partial.clone(),
                    finish: FinishReason::Abort,
                };
                (aborted, Some(fault))
            };
            let (completion, failure) = match client
                .call(
                    Method::POST,
                    "/v1/completions",
                    Some(body.to_string().into_bytes()),
                    timeout,
                )
                .await
            {
                Err(e) => fail(Fault::unreachable(&e)),
                Ok((status, _)) if status.is_server_error() => {
                    fail(Fault::failed(format!("{}: status {status}", client.url())))
                }
                Ok((status, bytes)) => (
                    finish_from_reply(id, &partial, (status, &bytes), client.url(), limits),
                    None,
                ),
            };
            Done::Generate {
                id,
                completion,
                failure,
            }
        });
    }

    fn control(&mut self, body: Value, tasks: &mut JoinSet<Done>) {
        let client = self.server.client.clone();
        let timeout = self.params.control_timeout;
        tasks.spawn(async move {
            let body = Some(body.to_string().into_bytes());
            if let Err(e) = client
                .call(Method::POST, "/abort_request", body, timeout)
                .await
            {
                tracing::warn!(url = %client.url(), error = %e, "remote engine abort call failed");
            }
            Done::Control
        });
    }

    /// Installs the newest weights on the server before it gets work (ready at once when there
    /// are none to install: the server holds the start version).
    fn install(&mut self, tasks: &mut JoinSet<Done>) {
        let Some(weights) = self.latest.clone() else {
            self.server.ready = true;
            self.publish();
            self.serve_waiting(tasks);
            return;
        };
        let dirs = Arc::clone(&self.params.weights);
        let client = self.server.client.clone();
        let timeout = self.params.request_timeout;
        let version = weights.version;
        tasks.spawn(async move {
            let result = match write(dirs, weights).await {
                Err(e) => Err(Fault::failed(e)),
                Ok(pinned) => {
                    load(&client, &pinned, WeightUpdateMode::InFlight, timeout).await
                    // `pinned` drops here: the directory may be pruned from now on.
                }
            };
            Done::Installed { version, result }
        });
    }

    /// Sends the requests that waited for the server to be ready.
    fn serve_waiting(&mut self, tasks: &mut JoinSet<Done>) {
        for request in std::mem::take(&mut self.waiting) {
            self.dispatch(request, tasks);
        }
    }

    fn update(
        &mut self,
        weights: Arc<ModelWeights>,
        mode: WeightUpdateMode,
        asked: Instant,
        tasks: &mut JoinSet<Done>,
    ) {
        let version = weights.version;
        self.latest = Some(Arc::clone(&weights));
        // A server still installing gets these weights when its install ends (it was older);
        // a down one gets nothing.
        let client = (self.server.up && self.server.ready).then(|| self.server.client.clone());
        let up = self.server.up;
        let dirs = Arc::clone(&self.params.weights);
        let timeout = self.params.request_timeout;
        tasks.spawn(async move {
            let failure = match client {
                None if up => None,
                None => Some(Fault::failed("the server is down".to_owned())),
                Some(client) => match write(dirs, weights).await {
                    Err(e) => Some(Fault::failed(e)),
                    Ok(pinned) => load(&client, &pinned, mode, timeout).await.err(),
                },
            };
            Done::Update {
                version,
                mode,
                asked,
                failure,
            }
        });
    }

    /// Reads the server's load, unless a reading is under way, the server does not report it,
    /// or it is not serving.
    fn read_load(&mut self, tasks: &mut JoinSet<Done>) {
        let l = &self.load;
        if l.pending || l.unsupported || !self.server.up || !self.server.ready {
            return;
        }
        self.load.pending = true;
        let client = self.server.client.clone();
        let timeout = self.params.control_timeout;
        let newest = self.newest_published();
        tasks.spawn(async move {
            let reply = client
                .call(Method::GET, "/get_weight_version", None, timeout)
                .await;
            Done::Load(match reply {
                Ok((StatusCode::OK, body)) => serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| {
                        if let Some(held) = v["weight_version"].as_u64().map(PolicyVersion)
                            && held > newest
                        {
                            return Some(Reading::Unpublished(held));
                        }
                        Some(Reading::Load {
                            busy_seconds: v["busy_seconds"].as_f64()?,
                            waiting: v["waiting"].as_u64()?,
                        })
                    })
                    .unwrap_or(Reading::Unsupported),
                Ok(_) => Reading::Unsupported,
                Err(_) => Reading::Failed,
            })
        });
    }

    fn on_done(&mut self, done: Done, tasks: &mut JoinSet<Done>) {
        match done {
            Done::Load(reading) => {
                self.load.pending = false;
                let first = !self.load.settled;
                self.load.settled = true;
                match reading {
                    Reading::Unsupported => {
                        tracing::info!(url = %self.server.client.url(), "remote engine server does not report its load; its busy ratio stays 0");
                        self.load.unsupported = true;
                    }
                    Reading::Failed => {}
                    Reading::Unpublished(held) => self.unpublished(held, "its weight_version"),
                    Reading::Load {
                        busy_seconds,
                        waiting,
                    } => {
                        let base = *self.load.base.get_or_insert(busy_seconds);
                        let ms = ((busy_seconds - base).max(0.0) * 1000.0) as u64;
                        self.shared.busy_ms.store(ms, Ordering::Relaxed);
                        self.shared.waiting.store(waiting, Ordering::Relaxed);
                    }
                }
                if first {
                    self.serve_waiting(tasks);
                }
            }
            Done::Generate {
                id,
                completion,
                failure,
            } => {
                let resumed = self.inflight.remove(&id).unwrap_or(0);
                if let Some(fault) = failure {
                    self.mark_down(fault);
                }
                self.count_bad_reply(&completion.finish);
                let mut completion = completion;
                let newest = self.newest_published();
                if let Some(&held) = completion.output.versions
                    [resumed.min(completion.output.len())..]
                    .iter()
                    .find(|&&v| v > newest)
                {
                    // Tokens of weights the head never published: not a rollout to train on.
                    self.unpublished(held, "a completion's token versions");
                    completion.output.token_ids.truncate(resumed);
                    completion.output.logprobs.truncate(resumed);
                    completion.output.versions.truncate(resumed);
                    completion.finish = FinishReason::Abort;
                }
                let new_tokens = completion.output.len().saturating_sub(resumed);
                self.shared
                    .generated_tokens
                    .fetch_add(new_tokens as u64, Ordering::Relaxed);
                self.publish();
                (self.sink)(EngineEvent::Finished(completion));
            }
            Done::Update {
                version,
                mode,
                asked,
                failure,
            } => {
                if let Some(fault) = failure {
                    // No report: the replica is dead, and its rebuild starts on these weights.
                    self.mark_down(fault.during(&format!("updating to v{}", version.0)));
                    return;
                }
                if version >= self.version {
                    self.version = version;
                    self.shared.version.store(version.0, Ordering::Relaxed);
                }
                (self.sink)(EngineEvent::WeightsUpdated {
                    version: self.version,
                    pause: asked.elapsed(),
                    mode,
                });
            }
            Done::Control => {}
            Done::Installed { version, result } => match result {
                Err(fault) => self.mark_down(fault.during(&format!("installing v{}", version.0))),
                Ok(()) if !self.server.up => {}
                Ok(()) if self.latest.as_ref().is_some_and(|w| w.version > version) => {
                    // A newer version was published meanwhile: install that one first.
                    self.install(tasks);
                }
                Ok(()) => {
                    tracing::info!(url = %self.server.client.url(), version = version.0, "remote engine server holds the run's weights");
                    self.server.ready = true;
                    self.publish();
                    self.serve_waiting(tasks);
                }
            },
        }
    }

    /// The newest version this head has given the server (installed or being installed): no
    /// token or reading of the server may carry a later one.
    fn newest_published(&self) -> PolicyVersion {
        self.latest
            .as_ref()
            .map_or(self.version, |w| w.version.max(self.version))
    }

    /// The server holds `held`, a version this head never published (its weights were replaced
    /// behind the head's back, `seen_in` says where it showed): an error in the log and the
    /// metric, and the server is down, so the replica is rebuilt on the run's weights.
    fn unpublished(&mut self, held: PolicyVersion, seen_in: &str) {
        let newest = self.newest_published();
        tracing::error!(
            url = %self.server.client.url(),
            held = held.0,
            newest = newest.0,
            "remote engine server reports {seen_in} v{}, a version this head never published (newest v{}); its weights were replaced behind the head's back",
            held.0,
            newest.0
        );
        metrics::counter!(sluice_core::metrics::ENGINE_UNPUBLISHED_VERSION_ERRORS).increment(1);
        self.mark_down(Fault::failed(format!(
            "holds v{}, a version this head never published",
            held.0
        )));
    }

    /// Counts a reply refused as `remote_bad_reply`; the [`MAX_BAD_REPLIES_IN_A_ROW`]th in a row
    /// takes the server down. Any other reply (a refused request included: the server kept the
    /// protocol) starts the count again.
    fn count_bad_reply(&mut self, finish: &FinishReason) {
        match finish {
            FinishReason::Error(kind) if kind == calls::BAD_REPLY => self.bad_replies += 1,
            FinishReason::Abort => return,
            _ => self.bad_replies = 0,
        }
        if self.bad_replies >= MAX_BAD_REPLIES_IN_A_ROW {
            self.mark_down(Fault::failed(format!(
                "{} replies in a row broke the protocol (remote_bad_reply)",
                self.bad_replies
            )));
        }
    }

    /// The server failed a call: the replica is dead from now on (see the module docs).
    fn mark_down(&mut self, fault: Fault) {
        if self.server.up {
            let message = &fault.message;
            tracing::warn!(url = %self.server.client.url(), %message, unreachable = fault.unreachable, "remote engine server is down; the replica will be rebuilt");
            self.server.up = false;
            self.server.ready = false;
            for request in std::mem::take(&mut self.waiting) {
                self.give_back(request);
            }
            self.publish();
            if fault.unreachable {
                *self
                    .shared
                    .unreachable
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(fault.message);
            }
            self.shared.down.store(true, Ordering::Relaxed);
        }
    }

    fn publish(&self) {
        self.shared
            .running
            .store(self.inflight.len() as u64, Ordering::Relaxed);
        self.shared
            .ready
            .store(self.server.up && self.server.ready, Ordering::Relaxed);
    }
}
