//! The remote backend: [`InferenceBackend`] over one OpenAI-compatible server with the token-id
//! and RL extensions (Sluice's own `sluice serve`, or an SGLang/vLLM-style server). A node with
//! several servers runs one replica per server (`engine.remote_urls[i]` is replica `i`): the
//! engine actor balances, parks and restarts them like local replicas, so routing happens in one
//! place.
//!
//! A dedicated thread runs a current-thread tokio runtime; trait calls `try_send` onto a bounded
//! channel. Each request is one `POST /v1/completions` (prompt + resumed tokens as ids,
//! `return_token_ids`, `logprobs: 1`, `rid` = the request id); `abort` posts
//! `/abort_request {rid}`, which answers the pending call with the partial output. A weight update
//! writes the snapshot as a Hugging Face directory ([`WeightDirs`]: `weights_dir/v<version>`, the
//! newest few kept) and posts `/update_weights_from_disk`.
//!
//! The server gets work only once it holds the run's weights: at start it first installs
//! `initial` (the newest version the actor has), so a server started from its own checkpoint
//! never generates tokens tagged with the run's version; requests that arrive meanwhile wait. A
//! server that fails a call (connection refused or reset, no answer within `request_timeout`, a
//! 5xx, a failed install, four replies in a row that break the
//! protocol) is down for good (a call that got no answer at all also makes
//! [`RemoteEngine::unreachable`] say why): its requests, and any sent to it later, finish as
//! [`FinishReason::Abort`](crate::backend::FinishReason::Abort) with the partial they came with (their rollouts go back to the aborted
//! bucket), and [`InferenceBackend::is_alive`] turns false, so the engine actor fails the replica
//! and rebuilds it after its backoff, which installs the newest weights again.
//!
//! The replica's load is its server's: every second it reads `GET /get_weight_version`, and when
//! the server reports `busy_seconds` and `waiting` (a `sluice serve` does; an SGLang/vLLM-style
//! server may not, and then it is asked no more), [`InferenceBackend::stats`] carries them — the
//! busy seconds counted from the replica's first reading, which comes before the replica sends
//! the server any work — so the engine busy ratio of a head measures its engine nodes, not 0.

mod fault;
mod weights;
mod wire;
mod worker;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sluice_core::config::Secret;
use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};
use sluice_model::ModelWeights;
use tokio::sync::mpsc;

use crate::backend::{
    EngineError, EngineStats, EventSink, GenerateRequest, InferenceBackend, enqueued, model_weights,
};
use sluice_http::HttpClient;
pub use sluice_http::HttpError;
pub use weights::{Pinned, WeightDirs};
use worker::{Server, Worker};

/// Commands queued per backend.
const COMMAND_QUEUE: usize = 4096;

/// Where the servers are and how the backend talks to them.
#[derive(Debug, Clone)]
pub struct RemoteParams {
    /// Replica index (names the thread).
    pub replica: u32,
    /// The server's base URL (`engine.remote_urls[replica]`).
    pub url: String,
    /// Deadline of one generation call or weight load (`engine.request_timeout_s`).
    pub request_timeout: Duration,
    /// Deadline of the small calls (abort).
    pub control_timeout: Duration,
    /// Where new weights are written (the servers must be able to read it); shared by every
    /// replica of the node.
    pub weights: Arc<WeightDirs>,
    /// The weights every server installs before it gets work; later updates replace them.
    /// `None`: the servers already hold the start version (nothing to install).
    pub initial: Option<Arc<ModelWeights>>,
    /// `model` field sent with each request, when the servers check it.
    pub model_name: Option<String>,
    /// Bearer token sent with every call: a joined engine node's node token (`admin.token`),
    /// else `$SLUICE_SERVE_TOKEN` for static servers (what `sluice serve` requires beyond
    /// loopback).
    pub token: Option<Secret>,
}

/// The environment variable holding `sluice serve`'s bearer token: the server requires it
/// beyond loopback, and a head calls its static `engine.remote_urls` with it.
pub const SERVE_TOKEN_VAR: &str = "SLUICE_SERVE_TOKEN";

/// `$SLUICE_SERVE_TOKEN`, trimmed, when set and not empty.
pub fn serve_token() -> Option<Secret> {
    sluice_http::auth::token_from_env(SERVE_TOKEN_VAR)
        .ok()
        .flatten()
}

impl RemoteParams {
    /// Replica `replica` of `[engine]`: the server `remote_urls[replica]` (wrapping around when
    /// there are more replicas than servers), `request_timeout_s`, publishing into `weights` and
    /// installing `initial` first; 5 s control calls; `$SLUICE_SERVE_TOKEN` as the token.
    pub fn from_config(
        engine: &crate::config::EngineConfig,
        replica: u32,
        weights: Arc<WeightDirs>,
        initial: Option<Arc<ModelWeights>>,
    ) -> Self {
        Self {
            replica,
            url: engine
                .remote_urls
                .get(replica as usize % engine.remote_urls.len().max(1))
                .cloned()
                .unwrap_or_default(),
            request_timeout: engine.request_timeout,
            control_timeout: Duration::from_secs(5),
            weights,
            initial,
            model_name: None,
            token: serve_token(),
        }
    }
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
    /// The server holds the run's weights and takes work.
    ready: AtomicBool,
    /// The server failed a call: the replica is dead.
    down: AtomicBool,
    /// Why, when the failed call got no answer at all (the server is unreachable).
    unreachable: std::sync::Mutex<Option<String>>,
    /// The server's busy time since the replica first read it, milliseconds.
    busy_ms: AtomicU64,
    /// Requests the server has queued, as last read.
    waiting: AtomicU64,
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
    /// Starts the backend's thread at `version` (the version of `params.initial` when given,
    /// else what the servers hold now).
    pub fn start(
        params: RemoteParams,
        version: PolicyVersion,
        sink: EventSink,
    ) -> Result<Self, String> {
        if params.url.is_empty() {
            return Err("the remote backend needs a server url".into());
        }
        // With weights to install, the server is not ready before it installed them.
        let ready = params.initial.is_none();
        let version = params.initial.as_ref().map_or(version, |w| w.version);
        let client = HttpClient::new(&params.url, "remote engine")
            .map_err(|e| e.to_string())?
            .with_token(params.token.clone());
        let server = Server {
            client,
            up: true,
            ready,
        };
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let shared = Arc::new(Shared::default());
        shared.version.store(version.0, Ordering::Relaxed);
        shared.ready.store(ready, Ordering::Relaxed);
        let name = format!("remote-engine-{}", params.replica);
        let worker = Worker {
            latest: params.initial.clone(),
            params,
            server,
            sink,
            shared: Arc::clone(&shared),
            version,
            inflight: HashMap::new(),
            waiting: VecDeque::new(),
            load: worker::ServerLoad::default(),
            bad_replies: 0,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("remote engine runtime: {e}"))?;
        let span = tracing::info_span!("engine_replica", backend = "remote", thread = %name);
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let _span = span.entered();
                runtime.block_on(worker.run(rx))
            })
            .map_err(|e| format!("spawning the remote engine thread: {e}"))?;
        Ok(Self {
            tx,
            shared,
            started: Instant::now(),
            thread: Some(thread),
            name,
        })
    }

    /// Why the replica is down when its server could not be reached (a call got no answer:
    /// connection refused or reset, nothing within its deadline); `None` while it is up, or
    /// when the server answered with an error (a 5xx, a refused install). A head tells its
    /// engine nodes apart by it: an unreachable node is not the replica's failure.
    pub fn unreachable(&self) -> Option<String> {
        self.shared
            .unreachable
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// 1 while the server is up and holds the run's weights (ready for work), else 0.
    pub fn servers_up(&self) -> u64 {
        u64::from(self.shared.ready.load(Ordering::Relaxed))
    }

    fn send(&self, command: Command) -> Result<(), EngineError> {
        enqueued(self.tx.try_send(command), &self.name, COMMAND_QUEUE)
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
        let model = model_weights(&weights, &self.name)?;
        self.send(Command::Update(model, mode, Instant::now()))
    }

    fn stats(&self) -> EngineStats {
        let s = &self.shared;
        EngineStats {
            version: PolicyVersion(s.version.load(Ordering::Relaxed)),
            running: s.running.load(Ordering::Relaxed),
            waiting: s.waiting.load(Ordering::Relaxed),
            generated_tokens: s.generated_tokens.load(Ordering::Relaxed),
            busy_seconds: s.busy_ms.load(Ordering::Relaxed) as f64 / 1000.0,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            kv_cache: None,
        }
    }

    fn is_alive(&self) -> bool {
        !self.shared.down.load(Ordering::Relaxed)
            && self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    fn server_gone(&self) -> Option<String> {
        // A plain remote engine is the replica itself: its server's failure is its own. A head's
        // replica on a joined node answers this from the registry (`MemberBackend`).
        None
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
