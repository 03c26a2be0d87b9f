//! An OpenAI-compatible HTTP server on the native engine (`sluice serve`).
//!
//! | route | module |
//! |---|---|
//! | `POST /v1/completions` | [`completions`]: text or token-id prompts, `n`, `logprobs`, `echo`, `stop`, SSE |
//! | `POST /v1/chat/completions` | [`chat`]: the checkpoint's chat template, `tools` → `tool_calls`, SSE |
//! | `GET /v1/models`, `GET /health`, `GET /get_weight_version` | [`admin`] |
//! | `POST /abort_request`, `/pause_generation`, `/continue_generation`, `/update_weights_from_disk` | [`admin`]: the SGLang-style RL extensions |
//! | `POST /update_weights_from_url` | [`fetch`]: an engine node fetches a version from its head |
//!
//! The five `POST` routes that change what the server does (weights, pause, abort, continue)
//! need `Authorization: Bearer <token>` when [`ServerOptions::token`] is set (an engine node's
//! node token, `sluice serve`'s `$SLUICE_SERVE_TOKEN`), checked by the check every Sluice server
//! shares ([`sluice_http::check_bearer`]); a refusal answers 401 and changes nothing. Prompt
//! text is bounded and tokenized off the runtime ([`prompt_text`]).
//!
//! Every generation call becomes one engine request per choice; their token updates come back
//! through a bounded channel per HTTP call ([`generate`]). A client that goes away aborts its
//! requests. Errors are OpenAI's JSON shape with a 4xx/5xx status ([`error`]).

pub mod admin;
pub mod chat;
pub mod completions;
pub mod error;
pub mod fetch;
pub mod generate;
mod limits;
pub mod prompt_text;
mod reply_stream;
mod text;
mod tool_json;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sluice_core::config::Secret;
use sluice_core::{PolicyVersion, RequestId};
use sluice_model::{Tokenizer, candle};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::backend::EngineEvent;
use crate::native::NativeControl;
pub use error::ApiError;

/// What the server serves and how it loads new weights.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The model name clients must use (`model` field); by default the directory name.
    pub model_name: String,
    /// dtype new checkpoints are loaded in (the running weights').
    pub dtype: candle::DType,
    /// Device new checkpoints are loaded on.
    pub device: candle::Device,
    /// Most choices one request may ask for.
    pub max_n: u32,
    /// Most sequences (prompts × `n`) accepted at once across all calls, running or waiting.
    /// A call that would go beyond answers 503 with `Retry-After` (try again shortly); one that
    /// asks for more on its own answers 400 (it can never be served).
    pub max_queued_sequences: usize,
    /// Bearer token of the routes that change what the server does (weights, pause, abort,
    /// continue); `None` leaves them open (loopback only: `sluice serve` and engine nodes
    /// refuse a wider bind without one).
    pub token: Option<Secret>,
    /// Header-read deadline and shutdown grace of the HTTP server.
    pub http: sluice_http::ServeOptions,
}

/// Default of [`ServerOptions::max_queued_sequences`]: the native engine's command queue, so
/// the calls the server accepts always fit in it.
pub const DEFAULT_MAX_QUEUED_SEQUENCES: usize = 4096;

/// Waiters for `WeightsUpdated` events (the server's engine sink feeds them).
#[derive(Default)]
pub struct WeightEvents {
    waiters: Mutex<Vec<oneshot::Sender<(PolicyVersion, Duration)>>>,
}

impl WeightEvents {
    /// The sink to start the engine with: routes weight updates to waiters, ignores the rest
    /// (request observers carry completions).
    pub fn sink(self: &Arc<Self>) -> crate::backend::EventSink {
        let me = Arc::clone(self);
        Arc::new(move |e| {
            if let EngineEvent::WeightsUpdated { version, pause, .. } = e {
                let waiters = std::mem::take(&mut *me.waiters.lock().expect("not poisoned"));
                for w in waiters {
                    let _ = w.send((version, pause));
                }
            }
        })
    }

    fn wait(&self) -> oneshot::Receiver<(PolicyVersion, Duration)> {
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().expect("not poisoned").push(tx);
        rx
    }
}

/// Shared by every handler (cheap `Arc` clones).
pub struct ServerState {
    control: NativeControl,
    tokenizer: Arc<Tokenizer>,
    options: ServerOptions,
    weights: Arc<WeightEvents>,
    next_id: AtomicU64,
    /// Client-visible request ids (`rid` or the response id) → the engine requests they made.
    rids: Mutex<HashMap<String, Vec<RequestId>>>,
    /// Serializes weight loads.
    loading: tokio::sync::Mutex<()>,
    /// Sequences of the calls in flight ([`ServerOptions::max_queued_sequences`] at most).
    queued: AtomicUsize,
    /// How weights are fetched over HTTP (engine nodes; `None`: the route answers 404).
    fetch: Option<fetch::WeightFetch>,
}

impl ServerState {
    /// State for an engine started with `weights.sink()`.
    pub fn new(
        control: NativeControl,
        tokenizer: Arc<Tokenizer>,
        options: ServerOptions,
        weights: Arc<WeightEvents>,
    ) -> Arc<Self> {
        Self::with_fetch(control, tokenizer, options, weights, None)
    }

    /// [`Self::new`] for a server that also takes `POST /update_weights_from_url` (an engine
    /// node: weights come from its head over HTTP).
    pub fn with_fetch(
        control: NativeControl,
        tokenizer: Arc<Tokenizer>,
        options: ServerOptions,
        weights: Arc<WeightEvents>,
        fetch: Option<fetch::WeightFetch>,
    ) -> Arc<Self> {
        Arc::new(Self {
            control,
            tokenizer,
            options,
            weights,
            next_id: AtomicU64::new(0),
            rids: Mutex::new(HashMap::new()),
            loading: tokio::sync::Mutex::new(()),
            queued: AtomicUsize::new(0),
            fetch,
        })
    }

    /// The engine's statistics (version loaded, requests running), for an engine node's
    /// heartbeat.
    pub fn stats(&self) -> crate::backend::EngineStats {
        self.control.stats()
    }

    /// Sequences of the calls in flight.
    pub fn queued_sequences(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Takes `n` sequences of the server's budget, or says why not: 400 when `n` alone is over
    /// it, 503 with `Retry-After` when the calls in flight leave too little. Released with
    /// [`release`](Self::release) when the call ends.
    fn reserve(&self, n: usize) -> Result<(), ApiError> {
        let max = self.options.max_queued_sequences;
        if n > max {
            return Err(ApiError::bad_body(format!(
                "the request asks for {n} sequences (prompts × n); this server takes at most {max} at once"
            )));
        }
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q + n <= max).then_some(q + n)
            })
            .map(|_| ())
            .map_err(|q| {
                ApiError::overloaded(format!(
                    "server overloaded: {q} of {max} sequences are queued or running; retry shortly"
                ))
            })
    }

    fn release(&self, n: usize) {
        self.queued.fetch_sub(n, Ordering::AcqRel);
    }

    /// The served model's name.
    pub fn model_name(&self) -> &str {
        &self.options.model_name
    }

    /// The model's context length.
    pub fn context_len(&self) -> usize {
        self.control.model_config().max_position_embeddings
    }

    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.options.model_name => Err(ApiError::not_found(
                Some("model"),
                format!(
                    "The model `{m}` does not exist; this server serves `{}`.",
                    self.options.model_name
                ),
            )),
            _ => Ok(()),
        }
    }
}

/// Refuses a guarded call without the server's bearer token.
async fn authorize(State(state): State<Arc<ServerState>>, req: Request, next: Next) -> Response {
    let checked = sluice_http::api::authorize(
        state.options.token.as_ref(),
        req.headers(),
        "authentication_error",
        None,
    );
    match checked {
        Ok(()) => next.run(req).await,
        Err(refusal) => {
            tracing::warn!(route = %req.uri().path(), reason = %refusal.message, "refused a call to a guarded route");
            refusal.into_response()
        }
    }
}

/// The routes over `state`.
pub fn router(state: Arc<ServerState>) -> Router {
    let guarded = Router::new()
        .route("/abort_request", post(admin::abort_request))
        .route("/pause_generation", post(admin::pause))
        .route("/continue_generation", post(admin::continue_generation))
        .route(
            "/update_weights_from_disk",
            post(admin::update_weights_from_disk),
        )
        .route(
            "/update_weights_from_url",
            post(fetch::update_weights_from_url),
        )
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            authorize,
        ));
    Router::new()
        .route("/v1/completions", post(completions::handle))
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/models", get(admin::models))
        .route("/health", get(admin::health))
        .route("/get_weight_version", get(admin::weight_version))
        .merge(guarded)
        .fallback(|| async { ApiError::not_found(None, "no such route") })
        .with_state(state)
}

/// Serves `state` on `listener` until `shutdown` resolves (tests bind `127.0.0.1:0`), with the
/// header-read deadline and shutdown grace of [`ServerOptions::http`].
pub async fn serve(
    listener: TcpListener,
    state: Arc<ServerState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let options = state.options.http;
    sluice_http::serve(listener, router(state), options, shutdown).await
}
