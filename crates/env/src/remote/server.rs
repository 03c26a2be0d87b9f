//! The env server: hosts envs of registered tasks behind the remote protocol (see the module
//! docs of [`crate::remote`]). Env calls run guarded (own task, deadline), so a panicking or
//! hanging env answers 500 / 504 and the server keeps serving. Open envs are capped, and envs
//! left idle (a client that died without closing) are dropped after `idle_timeout`.
//!
//! Each env follows the protocol's order, `init` once, then `step` until one answers `done`;
//! anything else answers 409 `env_protocol` without reaching the env, so an env never sees a call
//! its author did not plan for. With a token configured every `/v1/envs` call needs
//! `Authorization: Bearer <token>` (401 `unauthorized` otherwise).
//!
//! Refusals are [`sluice_http::api`]'s, in its shape, with the protocol's members on top:
//! `kind` (the same stable name as `type`, what env clients read) and, on a timeout,
//! `deadline_ms`. The bearer check and the body rules are the kit's too; every body refusal
//! keeps the protocol's kind, `bad_request`, whatever its status (400, 413, 415).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use sluice_core::config::Secret;
use sluice_http::api::{self, ApiError};
use tokio::net::TcpListener;

use super::{CreateRequest, CreateResponse, HealthResponse, StepRequest, TasksResponse};
use crate::error::EnvError;
use crate::guard::run_guarded;
use crate::protocol::{EnvInit, EnvStep, MessageEnv};
use crate::task::TaskRegistry;

/// Limits of the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Envs open at once; creating more answers 503 `server_full`.
    pub max_envs: usize,
    /// Deadline of each env call on the server side.
    pub call_timeout: Duration,
    /// An env unused for this long is dropped (without `close`) when the next env is created, so
    /// clients that died without closing do not leak envs until the cap.
    pub idle_timeout: Duration,
    /// Bearer token every `/v1/envs` call must carry; `None` serves anyone (loopback only:
    /// `sluice env-server` refuses a wider bind without one).
    pub token: Option<Secret>,
    /// Header-read deadline and shutdown grace of the HTTP server.
    pub http: sluice_http::ServeOptions,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_envs: 1024,
            call_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(600),
            token: None,
            http: sluice_http::ServeOptions::default(),
        }
    }
}

/// Where an env is in the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Created; `init` not called yet.
    Created,
    /// Initialised; steps are answered.
    Running,
    /// A step answered `done`; only `close` remains.
    Done,
}

/// An env with its protocol phase, behind one lock so that a check and the call it guards
/// cannot interleave with another call on the same env.
struct Hosted {
    env: Box<dyn MessageEnv>,
    phase: Phase,
}

type SharedEnv = Arc<tokio::sync::Mutex<Hosted>>;

struct Slot {
    env: SharedEnv,
    last_used: Instant,
}

/// What a server has done since it started, read while it runs (an env node reports its open
/// envs to its head as its load; `GET /v1/health` shows all three).
#[derive(Debug, Default)]
pub struct ServerStats {
    open: AtomicU64,
    created: AtomicU64,
    steps: AtomicU64,
}

impl ServerStats {
    /// Envs open now.
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Envs created since the server started.
    pub fn created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    /// Steps answered (successfully) since the server started.
    pub fn steps(&self) -> u64 {
        self.steps.load(Ordering::Relaxed)
    }
}

struct ServerState {
    registry: Arc<TaskRegistry>,
    config: ServerConfig,
    envs: Mutex<HashMap<String, Slot>>,
    next_id: AtomicU64,
    stats: Arc<ServerStats>,
}

impl ServerState {
    fn envs(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        // A poisoned map only means a handler panicked between two statements; the map itself
        // is still consistent (every mutation is a single insert/remove).
        self.envs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn env(&self, id: &str) -> Result<SharedEnv, ApiError> {
        let mut envs = self.envs();
        let slot = envs.get_mut(id).ok_or_else(|| unknown_env(id))?;
        slot.last_used = Instant::now();
        Ok(slot.env.clone())
    }

    /// Drops envs idle past the timeout; returns how many.
    fn evict_idle(&self) -> usize {
        let idle = self.config.idle_timeout;
        let mut envs = self.envs();
        let before = envs.len();
        envs.retain(|_, slot| slot.last_used.elapsed() < idle);
        self.stats.open.store(envs.len() as u64, Ordering::Relaxed);
        before - envs.len()
    }
}

/// Largest body of an env call (a sample, an assistant message): axum's default limit, which
/// the server had before it said so; larger ones answer 413.
const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// A refusal of the protocol: the kit's [`ApiError`] with `kind`, the name env clients read.
fn refusal(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
    in_protocol_shape(ApiError::new(status, kind, message))
}

/// `error` with the protocol's `kind` member (the same name as the kit's `type`).
fn in_protocol_shape(error: ApiError) -> ApiError {
    let kind = error.kind;
    error.with_detail("kind", kind)
}

/// 404 `unknown_env`: `id` was never opened, is closed, or was dropped idle.
fn unknown_env(id: &str) -> ApiError {
    refusal(
        StatusCode::NOT_FOUND,
        "unknown_env",
        format!("no open env `{id}`"),
    )
}

/// An env's failure as the protocol answers it: its stable kind, a status per kind, and the
/// deadline that passed on a timeout (so the client's [`EnvError::Timeout`] names it).
impl From<EnvError> for ApiError {
    fn from(e: EnvError) -> Self {
        let status = match &e {
            EnvError::BadInput(_) => StatusCode::BAD_REQUEST,
            EnvError::UnknownTask { .. } => StatusCode::NOT_FOUND,
            EnvError::Protocol(_) => StatusCode::CONFLICT,
            EnvError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let refused = refusal(status, e.kind(), e.to_string());
        match &e {
            EnvError::Timeout { after, .. } => {
                refused.with_detail("deadline_ms", after.as_millis() as u64)
            }
            _ => refused,
        }
    }
}

/// The body of a call as the route's JSON, by the kit's rules: `Content-Type:
/// application/json` (415), at most [`MAX_BODY_BYTES`] (413), JSON of the call's shape (400).
/// Every refusal is the protocol's `bad_request`.
fn json_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    api::require_json(headers)
        .and_then(|()| api::read_body(body, MAX_BODY_BYTES))
        .and_then(|bytes| api::parse_json(&bytes, "bad_request", "invalid JSON body"))
        .map_err(|e| {
            in_protocol_shape(ApiError {
                kind: "bad_request",
                ..e
            })
        })
}

/// Refuses an env call without the configured bearer token.
async fn authorize(State(s): Shared, req: Request, next: Next) -> Response {
    match api::authorize(s.config.token.as_ref(), req.headers(), "unauthorized", None) {
        Ok(()) => next.run(req).await,
        Err(refused) => in_protocol_shape(refused).into_response(),
    }
}

/// The protocol's routes over `registry`.
pub fn router(registry: Arc<TaskRegistry>, config: ServerConfig) -> Router {
    router_with_stats(registry, config, Arc::default())
}

/// [`router`], counting what it serves in `stats`.
pub fn router_with_stats(
    registry: Arc<TaskRegistry>,
    config: ServerConfig,
    stats: Arc<ServerStats>,
) -> Router {
    let state = Arc::new(ServerState {
        registry,
        config,
        envs: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
        stats,
    });
    let envs = Router::new()
        .route("/v1/envs", post(create))
        .route("/v1/envs/{id}/init", post(init))
        .route("/v1/envs/{id}/step", post(step))
        .route("/v1/envs/{id}", axum::routing::delete(close))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/tasks", get(tasks))
        .merge(envs)
        .fallback(unknown_route)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Serves the protocol on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<TaskRegistry>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_stats(listener, registry, config, Arc::default(), shutdown).await
}

/// [`serve`], counting what it serves in `stats`.
pub async fn serve_with_stats(
    listener: TcpListener,
    registry: Arc<TaskRegistry>,
    config: ServerConfig,
    stats: Arc<ServerStats>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let http = config.http;
    sluice_http::serve(
        listener,
        router_with_stats(registry, config, stats),
        http,
        shutdown,
    )
    .await
}

type Shared = State<Arc<ServerState>>;

async fn health(State(s): Shared) -> Json<HealthResponse> {
    Json(HealthResponse {
        status: "ok".into(),
        envs: s.envs().len(),
        envs_created_total: s.stats.created(),
        steps_total: s.stats.steps(),
    })
}

async fn tasks(State(s): Shared) -> Json<TasksResponse> {
    Json(TasksResponse {
        tasks: s.registry.names(),
    })
}

async fn unknown_route() -> ApiError {
    refusal(
        StatusCode::NOT_FOUND,
        "unknown_route",
        "no such route; see the protocol table in docs/envs.md",
    )
}

async fn create(
    State(s): Shared,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<CreateResponse>), ApiError> {
    let req: CreateRequest = json_body(&headers, body)?;
    let task = s.registry.get(&req.task)?;
    let evicted = s.evict_idle();
    if evicted > 0 {
        tracing::info!(evicted, "dropped idle envs");
    }
    if s.envs().len() >= s.config.max_envs {
        return Err(refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_full",
            format!("{} envs are open; close some first", s.config.max_envs),
        ));
    }
    let env = task.make_env(&req.sample)?;
    let id = format!("e{}", s.next_id.fetch_add(1, Ordering::Relaxed));
    let slot = Slot {
        env: Arc::new(tokio::sync::Mutex::new(Hosted {
            env,
            phase: Phase::Created,
        })),
        last_used: Instant::now(),
    };
    {
        let mut envs = s.envs();
        envs.insert(id.clone(), slot);
        s.stats.open.store(envs.len() as u64, Ordering::Relaxed);
    }
    s.stats.created.fetch_add(1, Ordering::Relaxed);
    Ok((StatusCode::CREATED, Json(CreateResponse { env_id: id })))
}

async fn init(State(s): Shared, Path(id): Path<String>) -> Result<Json<EnvInit>, ApiError> {
    let env = s.env(&id)?;
    let out = run_guarded("init", s.config.call_timeout, async move {
        let mut hosted = env.lock().await;
        if hosted.phase != Phase::Created {
            return Err(EnvError::Protocol(format!(
                "env `{id}` is already initialised; create a new env for a new episode"
            )));
        }
        // Marked before the call: an init that failed or timed out is not retried on the
        // same env (its state is unknown); the client closes it.
        hosted.phase = Phase::Running;
        hosted.env.init().await
    })
    .await?;
    Ok(Json(out))
}

async fn step(
    State(s): Shared,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<EnvStep>, ApiError> {
    let req: StepRequest = json_body(&headers, body)?;
    let env = s.env(&id)?;
    let out = run_guarded("step", s.config.call_timeout, async move {
        let mut hosted = env.lock().await;
        match hosted.phase {
            Phase::Created => {
                return Err(EnvError::Protocol(format!(
                    "env `{id}` stepped before init; call POST /v1/envs/{id}/init first"
                )));
            }
            Phase::Done => {
                return Err(EnvError::Protocol(format!(
                    "env `{id}` already answered done; close it and create a new env"
                )));
            }
            Phase::Running => {}
        }
        let out = hosted.env.step(req.message).await?;
        if out.done {
            hosted.phase = Phase::Done;
        }
        Ok(out)
    })
    .await?;
    s.stats.steps.fetch_add(1, Ordering::Relaxed);
    Ok(Json(out))
}

async fn close(State(s): Shared, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    let removed = {
        let mut envs = s.envs();
        let removed = envs.remove(&id);
        s.stats.open.store(envs.len() as u64, Ordering::Relaxed);
        removed
    };
    let slot = removed.ok_or_else(|| unknown_env(&id))?;
    let env = slot.env;
    run_guarded("close", s.config.call_timeout, async move {
        env.lock().await.env.close().await
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
