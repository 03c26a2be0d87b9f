//! The admin HTTP API (axum) and the `/metrics` route.
//!
//! | route | token | what |
//! |---|---|---|
//! | `GET /health` | – | 200 `{}` while the API answers (readiness probes) |
//! | `GET /v1/status` | – | version, step, buckets, rates, knobs, actor health ([`StatusReport`]) |
//! | `GET /v1/knobs` | – | the live knobs |
//! | `PATCH /v1/knobs` | yes | a JSON [`KnobPatch`]; all or nothing |
//! | `POST /v1/pause` | yes | sets the `paused` knob (admission stops, in-flight work goes on) |
//! | `POST /v1/resume` | yes | clears the `paused` knob |
//! | `POST /v1/checkpoint` | yes | writes a checkpoint now; answers `{"checkpoint": manifest}` (409 without a checkpoint directory) |
//! | `POST /v1/replay/clear` | yes | throws away the groups at rest in the replay store; 409 while the run trains unless forced (`replay`) |
//! | `/v1/nodes…`, `GET /v1/weights/{version}` | see [`crate::cluster::routes`] | a head's members and the weights they fetch |
//!
//! "Token" means `Authorization: Bearer <token>` when `admin.token` is configured (the config
//! refuses a non-loopback `admin.listen` without one). A mutating call answers
//! `{"changes": [...], "knobs": {...}}`. Every refusal answers a 4xx (5xx only when an actor is
//! unreachable) with one JSON shape, `{"error": {"message": "...", "type": "<stable kind>",
//! "param": null, "code": <status>}}` (the HTTP kit's, `sluice_http::api`), and changes
//! nothing: 401 for a missing or wrong token, 400 for a body that is not valid JSON or names an
//! unknown knob or a refused value, 413 for a body over [`MAX_BODY_BYTES`], 415 for a body that
//! is not `application/json`, 404 for an unknown route, 405 for a wrong method.
//!
//! New routes go in `routes` so they get the error fallbacks and the body limit. A client that
//! does not send a request's head within the header-read deadline (10 s by default) is cut off.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Value, json};
use sluice_config::Secret;
use sluice_core::{KnobPatch, Knobs};
use sluice_http::api::require_json;

use crate::cluster::Registry;
use crate::cluster::routes as cluster;
use crate::handles::NodeHandles;
use sluice_actors::ActorError;

mod replay;
mod status;

pub use status::{ActorHealth, Health, Rates, StatusReport};

/// Largest request body accepted; larger ones answer 413 (the HTTP kit's limit for a JSON
/// control body).
pub use sluice_http::api::MAX_BODY_BYTES;

/// What the admin routes need.
#[derive(Clone)]
pub struct AdminState {
    /// The node's actors and knobs.
    pub node: NodeHandles,
    /// Bearer token for mutating calls (and the node token members join with).
    pub token: Option<Secret>,
    /// A head's members and served weights (`None` on other nodes).
    pub cluster: Option<Arc<crate::cluster::ClusterState>>,
}

/// The router's state: the caller's [`AdminState`] plus what the status route keeps between
/// calls. Handlers may extract either (`State<AdminState>` works through [`FromRef`]).
#[derive(Clone)]
struct Shared {
    admin: AdminState,
    started: Instant,
    rates: Arc<Mutex<status::RateWindow>>,
}

impl FromRef<Shared> for AdminState {
    fn from_ref(s: &Shared) -> Self {
        s.admin.clone()
    }
}

/// The cluster routes see only what they serve and the token (`cluster::routes` needs nothing
/// else of the admin API, and imports nothing of it).
impl FromRef<Shared> for cluster::ClusterApi {
    fn from_ref(s: &Shared) -> Self {
        Self {
            cluster: s.admin.cluster.clone(),
            token: s.admin.token.clone(),
        }
    }
}

/// Every admin route, without fallbacks (add new routes here).
fn routes() -> Router<Shared> {
    Router::new()
        .route("/health", get(|| async { Json(json!({})) }))
        .route("/v1/status", get(get_status))
        .route("/v1/knobs", get(get_knobs).patch(patch_knobs))
        .route("/v1/pause", post(pause))
        .route("/v1/resume", post(resume))
        .route("/v1/checkpoint", post(checkpoint))
        .route("/v1/replay/clear", post(replay::clear))
        .route("/v1/nodes", get(cluster::list).post(cluster::join))
        .route("/v1/nodes/{name}/heartbeat", post(cluster::heartbeat))
        .route("/v1/nodes/{name}/leave", post(cluster::leave))
        .route("/v1/weights/{version}", get(cluster::weights))
}

/// The admin routes with their JSON fallbacks (404, 405) and body limit.
pub fn router(state: AdminState) -> Router {
    let shared = Shared {
        admin: state,
        started: Instant::now(),
        rates: Arc::default(),
    };
    routes()
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

/// The metrics route (Prometheus text format): the recorder's series, then a head's
/// per-member series rendered from its registry at the scrape (so a departed node's go with
/// it; [`Registry::exposition`]).
pub fn metrics_router(handle: PrometheusHandle, members: Option<Arc<Registry>>) -> Router {
    let render = move || {
        let (handle, members) = (handle.clone(), members.clone());
        async move {
            let mut text = handle.render();
            if let Some(registry) = &members {
                text.push_str(&registry.exposition());
            }
            (
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                )],
                text,
            )
        }
    };
    Router::new()
        .route("/metrics", get(render))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
}

/// A running HTTP server: its address and how to stop it.
pub struct Server {
    /// The bound address (useful with port 0).
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Server {
    /// Binds `addr` and serves `router` until [`Server::shutdown`], with the default header-read
    /// deadline and shutdown grace.
    pub async fn start(addr: SocketAddr, router: Router) -> Result<Self, ActorError> {
        Self::start_with(addr, router, sluice_http::ServeOptions::default()).await
    }

    /// [`Self::start`] with `options` (a shorter header-read deadline in tests, say).
    pub async fn start_with(
        addr: SocketAddr,
        router: Router,
        options: sluice_http::ServeOptions,
    ) -> Result<Self, ActorError> {
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
            if let Err(e) = sluice_http::serve(listener, router, options, shutdown).await {
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

/// A refused admin call: the HTTP kit's one refusal type and shape ([`sluice_http::api`]).
pub use sluice_http::api::ApiError;

/// Checks the bearer token of a mutating call (every call passes when none is configured), with
/// the check every Sluice server shares ([`sluice_http::api::authorize`]).
pub fn authorize(state: &AdminState, headers: &HeaderMap) -> Result<(), ApiError> {
    sluice_http::api::authorize(
        state.token.as_ref(),
        headers,
        "unauthorized",
        Some("admin.token"),
    )
}

/// The body of a call, or why it cannot be read (over [`MAX_BODY_BYTES`]: 413).
fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    sluice_http::api::read_body(body, MAX_BODY_BYTES)
}

async fn get_knobs(State(s): State<AdminState>) -> Json<Knobs> {
    Json(s.node.knobs.current())
}

/// Applies `patch` through the knobs handle (validated whole; nothing changes on error).
fn apply(s: &AdminState, patch: &KnobPatch) -> Result<Json<Value>, ApiError> {
    match s.node.knobs.update(patch) {
        Ok(changes) => Ok(Json(
            json!({ "changes": changes, "knobs": s.node.knobs.current() }),
        )),
        Err(e) => {
            let mut refusal = ApiError::new(StatusCode::BAD_REQUEST, "invalid_knob", e.to_string());
            refusal.param = Some(e.knob);
            Err(refusal)
        }
    }
}

async fn patch_knobs(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let body = read_body(body)?;
    require_json(&headers)?;
    // Parsed as a value first: serde would also read a struct from an array, positionally.
    let value: Value = sluice_http::api::parse_json(&body, "invalid_json", "invalid JSON")?;
    if !value.is_object() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!(
                "invalid knob patch: expected a JSON object of knobs, got {}",
                json_kind(&value)
            ),
        ));
    }
    if let Some(knob) = null_knob(&value) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!(
                "invalid knob patch: `{knob}` is null: give it a value, or leave it out to keep \
                 it (JSON has no NaN or infinity)"
            ),
        ));
    }
    // Read from the bytes into the struct: a knob given twice is refused (`duplicate field`),
    // where the value above kept the last one.
    let patch: KnobPatch = serde_json::from_slice(&body).map_err(|e| {
        // serde names the field only when it is unknown: the knob whose value it refused is
        // found by reading each field on its own.
        let refused = value
            .as_object()
            .into_iter()
            .flatten()
            .find_map(|(knob, v)| {
                let one = Value::Object([(knob.clone(), v.clone())].into_iter().collect());
                let e = serde_json::from_value::<KnobPatch>(one).err()?;
                Some((knob.clone(), e))
            });
        match refused {
            Some((knob, e)) => {
                let mut refusal = ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_json",
                    format!("invalid knob patch: `{knob}`: {e}"),
                );
                refusal.param = Some(knob);
                refusal
            }
            None => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("invalid knob patch: {e}"),
            ),
        }
    })?;
    apply(&s, &patch)
}

/// The first knob (or `domain_mix.<domain>`) the patch sets to `null`: serde would read it as
/// "not given" and change nothing, and `null` is what serializers write for NaN and infinity.
fn null_knob(patch: &Value) -> Option<String> {
    let fields = patch.as_object()?;
    fields.iter().find_map(|(knob, v)| match v {
        Value::Null => Some(knob.clone()),
        Value::Object(mix) => mix
            .iter()
            .find(|(_, w)| w.is_null())
            .map(|(domain, _)| format!("{knob}.{domain}")),
        _ => None,
    })
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Pause and resume take no body; an empty one or `{}` is accepted.
fn no_body(path: &str, headers: &HeaderMap, body: &Bytes) -> Result<(), ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(());
    }
    require_json(headers)?;
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) if o.is_empty() => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            format!("POST {path} takes no body (or `{{}}`)"),
        )),
    }
}

async fn set_paused(
    s: &AdminState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    paused: bool,
) -> Result<Json<Value>, ApiError> {
    authorize(s, headers)?;
    let body = read_body(body)?;
    let path = if paused { "/v1/pause" } else { "/v1/resume" };
    no_body(path, headers, &body)?;
    apply(
        s,
        &KnobPatch {
            paused: Some(paused),
            ..KnobPatch::default()
        },
    )
}

async fn pause(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    set_paused(&s, &headers, body, true).await
}

async fn resume(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    set_paused(&s, &headers, body, false).await
}

async fn checkpoint(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let body = read_body(body)?;
    no_body("/v1/checkpoint", &headers, &body)?;
    match s.node.checkpoint().await {
        Ok(manifest) => Ok(Json(json!({ "checkpoint": manifest }))),
        Err(e @ sluice_actors::checkpoint::CheckpointError::Unavailable(_)) => {
            Err(ApiError::new(StatusCode::CONFLICT, e.kind(), e.to_string()))
        }
        Err(e) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            e.kind(),
            e.to_string(),
        )),
    }
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!(
            "no route {method} {}; routes: GET /health, GET /v1/status, GET|PATCH /v1/knobs, POST /v1/pause, POST /v1/resume, POST /v1/checkpoint, POST /v1/replay/clear, GET|POST /v1/nodes, POST /v1/nodes/{{name}}/heartbeat|leave, GET /v1/weights/{{version}}, GET /metrics (metrics listener)",
            uri.path()
        ),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

async fn get_status(State(s): State<Shared>) -> Json<StatusReport> {
    Json(status::status_report(&s.admin, s.started, &s.rates).await)
}
