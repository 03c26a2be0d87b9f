//! The env server: hosts envs of registered tasks behind the remote protocol (see the module
//! docs of [`crate::remote`]). Env calls run guarded (own task, deadline), so a panicking or
//! hanging env answers 500 / 504 and the server keeps serving. Open envs are capped, and envs
//! left idle (a client that died without closing) are dropped after `idle_timeout`.
//!
//! Each env follows the protocol's order, `init` once, then `step` until one answers `done`;
//! anything else answers 409 `env_protocol` without reaching the env, so an env never sees a call
//! its author did not plan for. With a token configured every `/v1/envs` call needs
//! `Authorization: Bearer <token>` (401 `unauthorized` otherwise).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use sluice_core::config::Secret;
use tokio::net::TcpListener;

use super::{
    CreateRequest, CreateResponse, ErrorBody, ErrorDetail, HealthResponse, StepRequest,
    TasksResponse,
};
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
        let slot = envs.get_mut(id).ok_or_else(|| ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "unknown_env".into(),
            message: format!("no open env `{id}`"),
            deadline_ms: None,
        })?;
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

struct ApiError {
    status: StatusCode,
    kind: String,
    message: String,
    deadline_ms: Option<u64>,
}

impl From<EnvError> for ApiError {
    fn from(e: EnvError) -> Self {
        let status = match &e {
            EnvError::BadInput(_) => StatusCode::BAD_REQUEST,
            EnvError::UnknownTask { .. } => StatusCode::NOT_FOUND,
            EnvError::Protocol(_) => StatusCode::CONFLICT,
            EnvError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let deadline_ms = match &e {
            EnvError::Timeout { after, .. } => Some(after.as_millis() as u64),
            _ => None,
        };
        Self {
            status,
            kind: e.kind().to_owned(),
            message: e.to_string(),
            deadline_ms,
        }
    }
}

impl ApiError {
    fn new(status: StatusCode, kind: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind: kind.to_owned(),
            message: message.into(),
            deadline_ms: None,
        }
    }
}

/// A body that is not the JSON a route expects answers in the protocol's error shape, kind
/// `bad_request` (axum's own rejections are plain text). The status says what was wrong: 400
/// for JSON that does not parse or has the wrong shape, 415 without `Content-Type:
/// application/json`, 413 for a body over axum's limit.
impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let status = match &r {
            JsonRejection::JsonDataError(_) | JsonRejection::JsonSyntaxError(_) => {
                StatusCode::BAD_REQUEST
            }
            other => other.status(),
        };
        Self::new(status, "bad_request", r.body_text())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                kind: self.kind,
                message: self.message,
                deadline_ms: self.deadline_ms,
            },
        };
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

/// Refuses an env call without the configured bearer token.
async fn authorize(State(s): Shared, req: Request, next: Next) -> Response {
    match sluice_http::check_bearer(s.config.token.as_ref(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err(refusal) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            refusal.to_string(),
        )
        .into_response(),
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
    ApiError::new(
        StatusCode::NOT_FOUND,
        "unknown_route",
        "no such route; see the protocol table in docs/envs.md",
    )
}

async fn create(
    State(s): Shared,
    body: Result<Json<CreateRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<CreateResponse>), ApiError> {
    let Json(req) = body?;
    let task = s.registry.get(&req.task)?;
    let evicted = s.evict_idle();
    if evicted > 0 {
        tracing::info!(evicted, "dropped idle envs");
    }
    if s.envs().len() >= s.config.max_envs {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_full".into(),
            message: format!("{} envs are open; close some first", s.config.max_envs),
            deadline_ms: None,
        });
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
    body: Result<Json<StepRequest>, JsonRejection>,
) -> Result<Json<EnvStep>, ApiError> {
    let Json(req) = body?;
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
    let slot = removed.ok_or_else(|| ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "unknown_env".into(),
        message: format!("no open env `{id}`"),
        deadline_ms: None,
    })?;
    let env = slot.env;
    run_guarded("close", s.config.call_timeout, async move {
        env.lock().await.env.close().await
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
