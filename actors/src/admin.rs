//! The admin HTTP API (axum): `GET /v1/knobs`, `PATCH /v1/knobs` (a JSON [`KnobPatch`]; a refused
//! value answers 400 with the reason and changes nothing), `GET /v1/status`, and `GET /metrics`
//! (Prometheus text) on the metrics listener. Mutating calls need `Authorization: Bearer <token>`
//! when a token is configured.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use sluice_core::KnobPatch;
use sluice_core::config::Secret;

use crate::ActorError;
use crate::node::NodeHandles;

/// What the admin routes need.
#[derive(Clone)]
pub struct AdminState {
    /// The node's actors and knobs.
    pub node: NodeHandles,
    /// Bearer token for mutating calls.
    pub token: Option<Secret>,
}

/// The admin routes.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/v1/knobs", get(get_knobs).patch(patch_knobs))
        .route("/v1/status", get(get_status))
        .with_state(state)
}

/// The metrics route.
pub fn metrics_router(handle: PrometheusHandle) -> Router {
    Router::new().route("/metrics", get(move || async move { handle.render() }))
}

/// A running HTTP server: its address and how to stop it.
pub struct Server {
    /// The bound address (useful with port 0).
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Server {
    /// Binds `addr` and serves `router` until [`Server::shutdown`].
    pub async fn start(addr: SocketAddr, router: Router) -> Result<Self, ActorError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| ActorError::Setup(format!("cannot listen on {addr}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| ActorError::Setup(e.to_string()))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            if let Err(e) = axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
            {
                tracing::error!(error = %e, "admin server failed");
            }
        });
        Ok(Self {
            addr,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Stops accepting, finishes in-flight requests, and joins the server task.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

fn error(status: StatusCode, reason: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": reason.into() }))).into_response()
}

async fn get_knobs(State(s): State<AdminState>) -> Response {
    axum::Json(s.node.knobs.current()).into_response()
}

async fn patch_knobs(State(s): State<AdminState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(token) = &s.token {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(token.expose()) {
            return error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
        }
    }
    let patch: KnobPatch = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid knob patch: {e}")),
    };
    match s.node.knobs.update(&patch) {
        Ok(changes) => axum::Json(json!({ "changes": changes, "knobs": s.node.knobs.current() }))
            .into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

async fn get_status(State(s): State<AdminState>) -> Response {
    match s.node.status().await {
        Ok(status) => axum::Json(status).into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}
