//! The remote backend: [`InferenceBackend`] over OpenAI-compatible servers with the token-id
//! and RL extensions (Sluice's own `sluice serve`, or SGLang/vLLM-style servers).
//!
//! A dedicated thread runs a current-thread tokio runtime; trait calls `try_send` onto a bounded
//! channel. Each request is one `POST /v1/completions` (prompt + resumed tokens as ids,
//! `return_token_ids`, `logprobs: 1`, `rid` = the request id) to the live server with the fewest
//! requests in flight; `abort` posts `/abort_request {rid}` to that server, which answers the
//! pending call with the partial output. A weight update writes the snapshot as a Hugging Face
//! directory under `weights_dir/v<version>` and posts `/update_weights_from_disk` to every live
//! server. A server that fails a call (connection refused or reset, no answer within
//! `request_timeout`, a 5xx) is marked down: its requests finish as [`FinishReason::Abort`] with
//! the partial they came with, so their rollouts go back to the aborted bucket; `/health` is
//! polled to bring it back.

mod http;
mod wire;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};
use sluice_model::WeightSnapshot as ModelWeights;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::backend::{
    Completion, EngineError, EngineEvent, EngineStats, EventSink, FinishReason, GenerateRequest,
    InferenceBackend, TokenOutput,
};
use http::HttpClient;
pub use http::TransportError;

/// Commands queued per backend.
const COMMAND_QUEUE: usize = 4096;

/// Where the servers are and how the backend talks to them.
#[derive(Debug, Clone)]
pub struct RemoteParams {
    /// Replica index (names the thread).
    pub replica: u32,
    /// Base URLs (`engine.remote_urls`).
    pub urls: Vec<String>,
    /// Deadline of one generation call (`engine.request_timeout_s`).
    pub request_timeout: Duration,
    /// Deadline of the small calls (abort, health).
    pub control_timeout: Duration,
    /// How often a down server's `/health` is polled.
    pub health_interval: Duration,
    /// Directory new weights are written under (the servers must be able to read it).
    pub weights_dir: PathBuf,
    /// A model directory whose tokenizer and config files are copied next to new weights
    /// (servers such as SGLang load the whole directory).
    pub aux_files_from: Option<PathBuf>,
    /// `model` field sent with each request, when the servers check it.
    pub model_name: Option<String>,
}

enum Command {
    Submit(GenerateRequest),
    Abort(RequestId),
    AbortAll,
    Update(Arc<ModelWeights>, WeightUpdateMode, Instant),
    Shutdown,
}

#[derive(Default)]
struct Shared {
    version: AtomicU64,
    running: AtomicU64,
    generated_tokens: AtomicU64,
    servers_up: AtomicU64,
}

/// See the module docs.
pub struct RemoteEngine {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    started: Instant,
    thread: Option<JoinHandle<()>>,
    name: String,
}

impl RemoteEngine {
    /// Starts the backend's thread at `version` (what the servers hold now).
    pub fn start(
        params: RemoteParams,
        version: PolicyVersion,
        sink: EventSink,
    ) -> Result<Self, String> {
        if params.urls.is_empty() {
            return Err("the remote backend needs at least one url".into());
        }
        let servers = params
            .urls
            .iter()
            .map(|u| {
                HttpClient::new(u).map(|client| Server {
                    client,
                    up: true,
                    inflight: 0,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let shared = Arc::new(Shared::default());
        shared.version.store(version.0, Ordering::Relaxed);
        shared
            .servers_up
            .store(servers.len() as u64, Ordering::Relaxed);
        let name = format!("remote-engine-{}", params.replica);
        let worker = Worker {
            params,
            servers,
            sink,
            shared: Arc::clone(&shared),
            version,
            inflight: HashMap::new(),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("remote engine runtime: {e}"))?;
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || runtime.block_on(worker.run(rx)))
            .map_err(|e| format!("spawning the remote engine thread: {e}"))?;
        Ok(Self {
            tx,
            shared,
            started: Instant::now(),
            thread: Some(thread),
            name,
        })
    }

    /// Servers currently considered up.
    pub fn servers_up(&self) -> u64 {
        self.shared.servers_up.load(Ordering::Relaxed)
    }

    fn send(&self, command: Command) -> Result<(), EngineError> {
        self.tx.try_send(command).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => EngineError::BadRequest {
                id: self.name.clone(),
                reason: format!("command queue full ({COMMAND_QUEUE}); bound the requests"),
            },
            mpsc::error::TrySendError::Closed(_) => EngineError::Stopped {
                backend: self.name.clone(),
            },
        })
    }
}

impl InferenceBackend for RemoteEngine {
    fn submit(&self, request: GenerateRequest) -> Result<(), EngineError> {
        self.send(Command::Submit(request))
    }

    fn abort(&self, id: RequestId) -> Result<(), EngineError> {
        self.send(Command::Abort(id))
    }

    fn abort_all(&self) -> Result<(), EngineError> {
        self.send(Command::AbortAll)
    }

    fn update_weights(
        &self,
        weights: WeightSnapshot,
        mode: WeightUpdateMode,
    ) -> Result<(), EngineError> {
        let model =
            ModelWeights::from_envelope(&weights).ok_or_else(|| EngineError::BadRequest {
                id: self.name.clone(),
                reason: format!(
                    "weight snapshot {} carries no model weights to write",
                    weights.version
                ),
            })?;
        self.send(Command::Update(model, mode, Instant::now()))
    }

    fn stats(&self) -> EngineStats {
        let s = &self.shared;
        EngineStats {
            version: PolicyVersion(s.version.load(Ordering::Relaxed)),
            running: s.running.load(Ordering::Relaxed),
            waiting: 0,
            generated_tokens: s.generated_tokens.load(Ordering::Relaxed),
            busy_seconds: 0.0,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
        }
    }

    fn shutdown(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.tx.try_send(Command::Shutdown);
            // Our sender replaced: the worker's recv ends if the Shutdown did not fit.
            let (tx, _) = mpsc::channel(1);
            drop(std::mem::replace(&mut self.tx, tx));
            let _ = t.join();
        }
    }
}

impl Drop for RemoteEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Server {
    client: HttpClient,
    up: bool,
    inflight: usize,
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
}

struct Worker {
    params: RemoteParams,
    servers: Vec<Server>,
    sink: EventSink,
    shared: Arc<Shared>,
    version: PolicyVersion,
    /// Request → (server, resumed tokens it came with).
    inflight: HashMap<RequestId, (usize, usize)>,
}

impl Worker {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        let mut tasks: JoinSet<Done> = JoinSet::new();
        let mut health = tokio::time::interval(self.params.health_interval);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = rx.recv() => match command {
                    None | Some(Command::Shutdown) => return,
                    Some(c) => self.apply(c, &mut tasks),
                },
                Some(done) = tasks.join_next(), if !tasks.is_empty() => match done {
                    Ok(d) => self.on_done(d),
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
                }
            }
            Command::AbortAll => {
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

    fn dispatch(&mut self, request: GenerateRequest, tasks: &mut JoinSet<Done>) {
        let partial = request.resume.clone().unwrap_or_default();
        let pick = (0..self.servers.len())
            .filter(|&i| self.servers[i].up)
            .min_by_key(|&i| self.servers[i].inflight);
        let Some(server) = pick else {
            (self.sink)(EngineEvent::Finished(Completion {
                id: request.id,
                output: partial,
                finish: FinishReason::Error("remote_unavailable".into()),
            }));
            return;
        };
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
                    fail(format!("{}: status {status}", client.url))
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

    fn update(
        &mut self,
        weights: Arc<ModelWeights>,
        mode: WeightUpdateMode,
        asked: Instant,
        tasks: &mut JoinSet<Done>,
    ) {
        let version = weights.version;
        let dir = self.params.weights_dir.join(format!("v{:06}", version.0));
        let aux = self.params.aux_files_from.clone();
        let live: Vec<(usize, HttpClient)> = self
            .servers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.up)
            .map(|(i, s)| (i, s.client.clone()))
            .collect();
        let timeout = self.params.request_timeout;
        tasks.spawn(async move {
            let write_dir = dir.clone();
            let written = tokio::task::spawn_blocking(move || -> Result<(), String> {
                sluice_model::save_checkpoint(
                    &weights,
                    &write_dir,
                    &sluice_model::SaveOptions::default(),
                )
                .map_err(|e| e.to_string())?;
                if let Some(src) = aux {
                    sluice_model::copy_aux_files(&src, &write_dir).map_err(|e| e.to_string())?;
                }
                Ok(())
            })
            .await
            .unwrap_or_else(|e| Err(format!("writer thread: {e}")));
            if let Err(e) = written {
                let failed = live
                    .iter()
                    .map(|(i, _)| (*i, format!("writing {}: {e}", dir.display())))
                    .collect();
                return Done::Update {
                    version,
                    mode,
                    asked,
                    failed,
                };
            }
            let body = json!({
                "model_path": dir,
                "weight_version": version.0,
                "mode": mode.as_str(),
                "abort_all_requests": mode == WeightUpdateMode::AbortResume,
            })
            .to_string();
            let calls = live.iter().map(|(i, c)| {
                let body = body.clone().into_bytes();
                async move {
                    match c
                        .call(
                            Method::POST,
                            "/update_weights_from_disk",
                            Some(body),
                            timeout,
                        )
                        .await
                    {
                        Ok((st, _)) if st.is_success() => None,
                        Ok((st, b)) => {
                            Some((*i, format!("status {st}: {}", String::from_utf8_lossy(&b))))
                        }
                        Err(e) => Some((*i, e.to_string())),
                    }
                }
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

    fn on_done(&mut self, done: Done) {
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
                    tracing::info!(url = %self.servers[server].client.url, "remote engine server is back");
                    self.servers[server].up = true;
                    self.publish();
                }
            }
        }
    }

    fn mark_down(&mut self, server: usize, message: &str) {
        if self.servers[server].up {
            tracing::warn!(url = %self.servers[server].client.url, %message, "remote engine server marked down");
            self.servers[server].up = false;
            self.publish();
        }
    }

    fn publish(&self) {
        self.shared
            .running
            .store(self.inflight.len() as u64, Ordering::Relaxed);
        let up = self.servers.iter().filter(|s| s.up).count();
        self.shared.servers_up.store(up as u64, Ordering::Relaxed);
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
