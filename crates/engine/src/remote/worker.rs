//! The remote backend's loop: install the run's weights on each server before it gets work,
//! dispatch to the least-loaded ready server, relay completions, mark servers down on transport
//! failures, poll `/health` (and reinstall on return), publish weights.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde_json::{Value, json};
use sluice_core::{PolicyVersion, RequestId, WeightUpdateMode};
use sluice_http::{HttpClient, Method, StatusCode};
use sluice_model::WeightSnapshot as ModelWeights;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::{Command, Pinned, RemoteParams, Shared, WeightDirs, wire};
use crate::backend::{
    Completion, EngineEvent, EventSink, FinishReason, GenerateRequest, TokenOutput,
};

pub(super) struct Server {
    pub(super) client: HttpClient,
    /// Not marked down.
    pub(super) up: bool,
    /// Holds the run's weights since it (re)joined: it may get work.
    pub(super) ready: bool,
    /// An install of the newest weights is under way.
    pub(super) installing: bool,
    pub(super) inflight: usize,
}

/// What a spawned call reports back to the worker loop.
enum Done {
    Generate {
        id: RequestId,
        server: usize,
        /// What goes to the sink (on a failure: an abort with the partial).
        completion: Completion,
        /// The transport failure that marks the server down, if any.
        failure: Option<String>,
    },
    Update {
        version: PolicyVersion,
        mode: WeightUpdateMode,
        asked: Instant,
        failed: Vec<(usize, String)>,
    },
    Control {
        server: usize,
        ok: bool,
    },
    /// A server's install of `version` ended.
    Installed {
        server: usize,
        version: PolicyVersion,
        result: Result<(), String>,
    },
}

pub(super) struct Worker {
    pub(super) params: RemoteParams,
    pub(super) servers: Vec<Server>,
    pub(super) sink: EventSink,
    pub(super) shared: Arc<Shared>,
    pub(super) version: PolicyVersion,
    /// Request → (server, resumed tokens it came with).
    pub(super) inflight: HashMap<RequestId, (usize, usize)>,
    /// The weights a (re)joining server installs: the initial ones, then each update's.
    pub(super) latest: Option<Arc<ModelWeights>>,
    /// Requests that arrived while every live server was still installing. Bounded by what the
    /// engine actor routes here (the controller's admission bounds that).
    pub(super) waiting: VecDeque<GenerateRequest>,
}

impl Worker {
    pub(super) async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        let mut tasks: JoinSet<Done> = JoinSet::new();
        let mut health = tokio::time::interval(self.params.health_interval);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for server in 0..self.servers.len() {
            if !self.servers[server].ready {
                self.install(server, &mut tasks);
            }
        }
        loop {
            tokio::select! {
                command = rx.recv() => match command {
                    None | Some(Command::Shutdown) => return,
                    Some(c) => self.apply(c, &mut tasks),
                },
                Some(done) = tasks.join_next(), if !tasks.is_empty() => match done {
                    Ok(d) => self.on_done(d, &mut tasks),
                    Err(e) => tracing::error!(error = %e, "remote engine call panicked"),
                },
                _ = health.tick() => self.check_health(&mut tasks),
            }
        }
    }

    fn apply(&mut self, command: Command, tasks: &mut JoinSet<Done>) {
        match command {
            Command::Submit(request) => self.dispatch(request, tasks),
            Command::Abort(id) => {
                if let Some(&(s, _)) = self.inflight.get(&id) {
                    let body = json!({"rid": id.to_string()});
                    self.control(s, "/abort_request", body, tasks);
                } else if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
                    let request = self.waiting.remove(i).expect("found");
                    self.give_back(request, FinishReason::Abort);
                }
            }
            Command::AbortAll => {
                for request in std::mem::take(&mut self.waiting) {
                    self.give_back(request, FinishReason::Abort);
                }
                for s in 0..self.servers.len() {
                    if self.servers[s].up {
                        self.control(s, "/abort_request", json!({"abort_all": true}), tasks);
                    }
                }
            }
            Command::Update(weights, mode, asked) => self.update(weights, mode, asked, tasks),
            Command::Shutdown => {}
        }
    }

    /// Finishes `request` unserved with `finish` and the partial it came with.
    fn give_back(&self, request: GenerateRequest, finish: FinishReason) {
        (self.sink)(EngineEvent::Finished(Completion {
            id: request.id,
            output: request.resume.unwrap_or_default(),
            finish,
        }));
    }

    fn dispatch(&mut self, request: GenerateRequest, tasks: &mut JoinSet<Done>) {
        let pick = (0..self.servers.len())
            .filter(|&i| self.servers[i].up && self.servers[i].ready)
            .min_by_key(|&i| self.servers[i].inflight);
        let Some(server) = pick else {
            if self.servers.iter().any(|s| s.up) {
                // Live servers are still installing the run's weights: wait for one.
                self.waiting.push_back(request);
            } else {
                self.give_back(request, FinishReason::Error("remote_unavailable".into()));
            }
            return;
        };
        let partial = request.resume.clone().unwrap_or_default();
        self.servers[server].inflight += 1;
        self.inflight.insert(request.id, (server, partial.len()));
        self.publish();
        let client = self.servers[server].client.clone();
        let timeout = self.params.request_timeout;
        let version = self.version;
        let body = wire::completion_body(&request, self.params.model_name.as_deref());
        tasks.spawn(async move {
            let id = request.id;
            let fail = |message: String| {
                let aborted = Completion {
                    id,
                    output: partial.clone(),
                    finish: FinishReason::Abort,
                };
                (aborted, Some(message))
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
                Err(e) => fail(e.to_string()),
                Ok((status, _)) if status.is_server_error() => {
                    fail(format!("{}: status {status}", client.url()))
                }
                Ok((status, bytes)) => (
                    finish_from_reply(id, &partial, status, &bytes, version),
                    None,
                ),
            };
            Done::Generate {
                id,
                server,
                completion,
                failure,
            }
        });
    }

    fn control(
        &mut self,
        server: usize,
        path: &'static str,
        body: Value,
        tasks: &mut JoinSet<Done>,
    ) {
        let client = self.servers[server].client.clone();
        let timeout = self.params.control_timeout;
        tasks.spawn(async move {
            let r = client
                .call(
                    Method::POST,
                    path,
                    Some(body.to_string().into_bytes()),
                    timeout,
                )
                .await;
            Done::Control {
                server,
                ok: r.is_ok(),
            }
        });
    }

    fn check_health(&mut self, tasks: &mut JoinSet<Done>) {
        for (server, s) in self.servers.iter().enumerate() {
            if s.up {
                continue;
            }
            let client = s.client.clone();
            let timeout = self.params.control_timeout;
            tasks.spawn(async move {
                let r = client.call(Method::GET, "/health", None, timeout).await;
                Done::Control {
                    server,
                    ok: matches!(r, Ok((st, _)) if st.is_success()),
                }
            });
        }
    }

    /// Installs the newest weights on `server` before it gets work (ready at once when there
    /// are none to install: the servers hold the start version).
    fn install(&mut self, server: usize, tasks: &mut JoinSet<Done>) {
        let Some(weights) = self.latest.clone() else {
            self.servers[server].ready = true;
            self.publish();
            self.serve_waiting(tasks);
            return;
        };
        if self.servers[server].installing {
            return;
        }
        self.servers[server].installing = true;
        let dirs = Arc::clone(&self.params.weights);
        let client = self.servers[server].client.clone();
        let timeout = self.params.request_timeout;
        let version = weights.version;
        tasks.spawn(async move {
            let result = match write(dirs, weights).await {
                Err(e) => Err(e),
                Ok(pinned) => {
                    load(&client, &pinned, WeightUpdateMode::InFlight, timeout).await
                    // `pinned` drops here: the directory may be pruned from now on.
                }
            };
            Done::Installed {
                server,
                version,
                result,
            }
        });
    }

    /// Sends the requests that waited for a ready server.
    fn serve_waiting(&mut self, tasks: &mut JoinSet<Done>) {
        if self.servers.iter().any(|s| s.up && s.ready) {
            for request in std::mem::take(&mut self.waiting) {
                self.dispatch(request, tasks);
            }
        } else if !self.servers.iter().any(|s| s.up) {
            for request in std::mem::take(&mut self.waiting) {
                self.give_back(request, FinishReason::Error("remote_unavailable".into()));
            }
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
        // Servers still installing get these weights when their install ends (it was older).
        let live: Vec<(usize, HttpClient)> = self
            .servers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.up && s.ready)
            .map(|(i, s)| (i, s.client.clone()))
            .collect();
        let dirs = Arc::clone(&self.params.weights);
        let timeout = self.params.request_timeout;
        tasks.spawn(async move {
            let pinned = match write(dirs, weights).await {
                Ok(p) => p,
                Err(e) => {
                    let failed = live.iter().map(|(i, _)| (*i, e.clone())).collect();
                    return Done::Update {
                        version,
                        mode,
                        asked,
                        failed,
                    };
                }
            };
            let calls = live.iter().map(|(i, c)| {
                let pinned = &pinned;
                async move { load(c, pinned, mode, timeout).await.err().map(|e| (*i, e)) }
            });
            let failed = futures::future::join_all(calls)
                .await
                .into_iter()
                .flatten()
                .collect();
            Done::Update {
                version,
                mode,
                asked,
                failed,
            }
        });
    }

    fn on_done(&mut self, done: Done, tasks: &mut JoinSet<Done>) {
        match done {
            Done::Generate {
                id,
                server,
                completion,
                failure,
            } => {
                let resumed = self.inflight.remove(&id).map_or(0, |(_, r)| r);
                self.servers[server].inflight = self.servers[server].inflight.saturating_sub(1);
                if let Some(message) = failure {
                    self.mark_down(server, &message);
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
                failed,
            } => {
                for (server, message) in &failed {
                    self.mark_down(*server, message);
                }
                if failed.len() < self.servers.len() && version >= self.version {
                    self.version = version;
                    self.shared.version.store(version.0, Ordering::Relaxed);
                }
                (self.sink)(EngineEvent::WeightsUpdated {
                    version: self.version,
                    pause: asked.elapsed(),
                    mode,
                });
            }
            Done::Control { server, ok } => {
                if ok && !self.servers[server].up {
                    tracing::info!(url = %self.servers[server].client.url(), "remote engine server is back; installing the run's weights");
                    self.servers[server].up = true;
                    self.servers[server].ready = false;
                    self.install(server, tasks);
                }
            }
            Done::Installed {
                server,
                version,
                result,
            } => {
                self.servers[server].installing = false;
                match result {
                    Err(message) => {
                        self.mark_down(server, &format!("installing v{}: {message}", version.0));
                        self.serve_waiting(tasks);
                    }
                    Ok(()) if !self.servers[server].up => {}
                    Ok(()) if self.latest.as_ref().is_some_and(|w| w.version > version) => {
                        // A newer version was published meanwhile: install that one first.
                        self.install(server, tasks);
                    }
                    Ok(()) => {
                        tracing::info!(url = %self.servers[server].client.url(), version = version.0, "remote engine server holds the run's weights");
                        self.servers[server].ready = true;
                        self.publish();
                        self.serve_waiting(tasks);
                    }
                }
            }
        }
    }

    fn mark_down(&mut self, server: usize, message: &str) {
        if self.servers[server].up {
            tracing::warn!(url = %self.servers[server].client.url(), %message, "remote engine server marked down");
            self.servers[server].up = false;
            self.servers[server].ready = false;
            self.publish();
        }
    }

    fn publish(&self) {
        self.shared
            .running
            .store(self.inflight.len() as u64, Ordering::Relaxed);
        let up = self.servers.iter().filter(|s| s.up && s.ready).count();
        self.shared.servers_up.store(up as u64, Ordering::Relaxed);
    }
}

/// Writes `weights` (unless already on disk) and pins the directory, off the runtime.
async fn write(dirs: Arc<WeightDirs>, weights: Arc<ModelWeights>) -> Result<Pinned, String> {
    tokio::task::spawn_blocking(move || dirs.publish(&weights))
        .await
        .unwrap_or_else(|e| Err(format!("writer thread: {e}")))
}

/// Asks the server behind `client` to load `pinned` as its version, with `mode`.
async fn load(
    client: &HttpClient,
    pinned: &Pinned,
    mode: WeightUpdateMode,
    timeout: std::time::Duration,
) -> Result<(), String> {
    let body = json!({
        "model_path": pinned.path(),
        "weight_version": pinned.version().0,
        "mode": mode.as_str(),
        "abort_all_requests": mode == WeightUpdateMode::AbortResume,
    })
    .to_string()
    .into_bytes();
    match client
        .call(
            Method::POST,
            "/update_weights_from_disk",
            Some(body),
            timeout,
        )
        .await
    {
        Ok((st, _)) if st.is_success() => Ok(()),
        Ok((st, b)) => Err(format!("status {st}: {}", String::from_utf8_lossy(&b))),
        Err(e) => Err(e.to_string()),
    }
}

/// The completion of a request from a server's reply (2xx or 4xx): the resumed tokens first.
fn finish_from_reply(
    id: RequestId,
    partial: &TokenOutput,
    status: StatusCode,
    bytes: &[u8],
    version: PolicyVersion,
) -> Completion {
    let mut output = partial.clone();
    let finish = if !status.is_success() {
        tracing::warn!(%id, %status, body = %String::from_utf8_lossy(bytes), "remote engine refused a request");
        FinishReason::Error("remote_bad_request".into())
    } else {
        match serde_json::from_slice::<Value>(bytes)
            .map_err(|e| wire::BadReply(e.to_string()))
            .and_then(|v| wire::parse_completion(&v, version))
        {
            Ok((new, finish)) => {
                output.token_ids.extend(new.token_ids);
                output.logprobs.extend(new.logprobs);
                output.versions.extend(new.versions);
                finish
            }
            Err(wire::BadReply(reason)) => {
                tracing::warn!(%id, %reason, "remote engine reply is malformed");
                FinishReason::Error("remote_bad_reply".into())
            }
        }
    };
    Completion { id, output, finish }
}
