//! The env server: hosts envs of registered tasks behind the remote protocol (see the module
//! docs of [`crate::remote`]). Env calls run guarded (own task, deadline), so a panicking or
//! hanging env answers 500 / 504 and the server keeps serving. Open envs are capped, and envs
//! left idle (a client that died without closing) are dropped after `idle_timeout`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
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
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_envs: 1024,
            call_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(600),
        }
    }
}

type SharedEnv = Arc<tokio::sync::Mutex<Box<dyn MessageEnv>>>;

struct Slot {
    env: SharedEnv,
    last_used: Instant,
}

struct ServerState {
    registry: Arc<TaskRegistry>,
    config: ServerConfig,
    envs: Mutex<HashMap<String, Slot>>,
    next_id: AtomicU64,
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                kind: self.kind,
                message: self.message,
                deadline_ms: self.deadline_ms,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

/// The protocol's routes over `registry`.
pub fn router(registry: Arc<TaskRegistry>, config: ServerConfig) -> Router {
    let state = Arc::new(ServerState {
        registry,
        config,
        envs: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
    });
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/tasks", get(tasks))
        .route("/v1/envs", post(create))
        .route("/v1/envs/{id}/init", post(init))
        .route("/v1/envs/{id}/step", post(step))
        .route("/v1/envs/{id}", axum::routing::delete(close))
        .with_state(state)
}

/// Serves the protocol on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<TaskRegistry>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(registry, config))
        .with_graceful_shutdown(shutdown)
        .await
}

type Shared = State<Arc<ServerState>>;

async fn health(State(s): Shared) -> Json<HealthResponse> {
    Json(HealthResponse {
        status: "ok".into(),
        envs: s.envs().len(),
    })
}

async fn tasks(State(s): Shared) -> Json<TasksResponse> {
    Json(TasksResponse {
        tasks: s.registry.names(),
    })
}

async fn create(
    State(s): Shared,
    Json(req): Json<CreateRequest>,
) -> Result<(StatusCode, Json<CreateResponse>), ApiError> {
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
        env: Arc::new(tokio::sync::Mutex::new(env)),
        last_used: Instant::now(),
    };
    s.envs().insert(id.clone(), slot);
    Ok((StatusCode::CREATED, Json(CreateResponse { env_id: id })))
}

async fn init(State(s): Shared, Path(id): Path<String>) -> Result<Json<EnvInit>, ApiError> {
    let env = s.env(&id)?;
    let out = run_guarded("init", s.config.call_timeout, async move {
        env.lock().await.init().await
    })
    .await?;
    Ok(Json(out))
}

async fn step(
    State(s): Shared,
    Path(id): Path<String>,
    Json(req): Json<StepRequest>,
) -> Result<Json<EnvStep>, ApiError> {
    let env = s.env(&id)?;
    let out = run_guarded("step", s.config.call_timeout, async move {
        env.lock().await.step(req.message).await
    })
    .await?;
    Ok(Json(out))
}

async fn close(State(s): Shared, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    let slot = s.envs().remove(&id).ok_or_else(|| ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "unknown_env".into(),
        message: format!("no open env `{id}`"),
        deadline_ms: None,
    })?;
    let env = slot.env;
    run_guarded("close", s.config.call_timeout, async move {
        env.lock().await.close().await
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
