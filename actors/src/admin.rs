//! The admin HTTP API (axum) and the `/metrics` route.
//!
//! | route | token | what |
//! |---|---|---|
//! | `GET /v1/status` | – | version, step, buckets, rates, knobs, actor health ([`StatusReport`]) |
//! | `GET /v1/knobs` | – | the live knobs |
//! | `PATCH /v1/knobs` | yes | a JSON [`KnobPatch`]; all or nothing |
//! | `POST /v1/pause` | yes | sets the `paused` knob (admission stops, in-flight work goes on) |
//! | `POST /v1/resume` | yes | clears the `paused` knob |
//!
//! "Token" means `Authorization: Bearer <token>` when `admin.token` is configured (the config
//! refuses a non-loopback `admin.listen` without one). A mutating call answers
//! `{"changes": [...], "knobs": {...}}`. Every refusal answers a 4xx (5xx only when an actor is
//! unreachable) with one JSON shape, `{"error": {"message": "...", "type": "<stable kind>"}}`,
//! and changes nothing: 401 for a missing or wrong token, 400 for a body that is not valid JSON or
//! names an unknown knob or a refused value, 413 for a body over [`MAX_BODY_BYTES`], 415 for a
//! body that is not `application/json`, 404 for an unknown route, 405 for a wrong method.
//!
//! New routes go in [`routes`] so they get the error fallbacks and the body limit.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use serde_json::{Value, json};
use sluice_core::config::Secret;
use sluice_core::{KnobPatch, Knobs};
use sluice_engine::EngineStats;
use sluice_replay::StoreSnapshot;

use crate::ActorError;
use crate::controller::ControllerStatus;
use crate::node::NodeHandles;
use crate::trainer::TrainerStatus;

/// Largest request body accepted; larger ones answer 413.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// How long `/v1/status` waits for each actor before reporting it unreachable.
const ACTOR_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// What the admin routes need.
#[derive(Clone)]
pub struct AdminState {
    /// The node's actors and knobs.
    pub node: NodeHandles,
    /// Bearer token for mutating calls.
    pub token: Option<Secret>,
}

/// The router's state: the caller's [`AdminState`] plus what the status route keeps between
/// calls. Handlers may extract either (`State<AdminState>` works through [`FromRef`]).
#[derive(Clone)]
struct Shared {
    admin: AdminState,
    started: Instant,
    rates: Arc<Mutex<RateWindow>>,
}

impl FromRef<Shared> for AdminState {
    fn from_ref(s: &Shared) -> Self {
        s.admin.clone()
    }
}

/// Every admin route, without fallbacks (add new routes here).
fn routes() -> Router<Shared> {
    Router::new()
        .route("/v1/status", get(get_status))
        .route("/v1/knobs", get(get_knobs).patch(patch_knobs))
        .route("/v1/pause", post(pause))
        .route("/v1/resume", post(resume))
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

/// The metrics route (Prometheus text format).
pub fn metrics_router(handle: PrometheusHandle) -> Router {
    let render = move || async move {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            )],
            handle.render(),
        )
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

/// A refused admin call: a status, a stable kind and a reason, answered as
/// `{"error": {"message", "type"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status (4xx, or 503 when an actor cannot answer).
    pub status: StatusCode,
    /// Short stable name (`unauthorized`, `invalid_json`, `invalid_knob`, …).
    pub kind: &'static str,
    /// What was wrong and what is expected.
    pub message: String,
}

impl ApiError {
    /// A refusal with `status`, `kind` and `message`.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(json!({ "error": { "message": self.message, "type": self.kind } }));
        let mut response = (self.status, body).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Checks the bearer token of a mutating call (every call passes when none is configured).
pub fn authorize(state: &AdminState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &state.token else {
        return Ok(());
    };
    let unauthorized = |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", m);
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        });
    match given {
        None => Err(unauthorized(
            "missing bearer token: send `Authorization: Bearer <token>` (admin.token)",
        )),
        Some(t) if constant_time_eq(t.as_bytes(), token.expose().as_bytes()) => Ok(()),
        Some(_) => Err(unauthorized("wrong bearer token")),
    }
}

/// Compares without an early exit, so timing does not tell how much of a guess was right
/// (only whether its length was).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The body of a call, or why it cannot be read (over the limit: 413).
fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| match r.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("request body over {MAX_BODY_BYTES} bytes"),
        ),
        status => ApiError::new(status, "invalid_body", r.body_text()),
    })
}

/// Refuses a non-empty body that does not say it is JSON.
fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!(
                "expected Content-Type: application/json, got `{}`",
                if ct.is_empty() { "none" } else { ct }
            ),
        ))
    }
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
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_knob",
            e.to_string(),
        )),
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
    let value: Value = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("invalid JSON: {e}"),
        )
    })?;
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
    let patch: KnobPatch = serde_json::from_value(value).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("invalid knob patch: {e}"),
        )
    })?;
    apply(&s, &patch)
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

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!(
            "no route {method} {}; routes: GET /v1/status, GET|PATCH /v1/knobs, POST /v1/pause, POST /v1/resume, GET /metrics (metrics listener)",
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

/// How an actor is doing, as `/v1/status` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Answering.
    Running,
    /// Finished its work (the trainer after `run.max_steps`).
    Done,
    /// Stopped with an error.
    Failed,
    /// Did not answer within the status timeout, or is gone.
    Unreachable,
}

/// One actor's line in `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct ActorHealth {
    /// Running, done, failed or unreachable.
    pub health: Health,
    /// Why, when not running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Throughput over the last minute of status calls (since start on the first call).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Rates {
    /// Seconds the rates below are measured over.
    pub window_seconds: f64,
    /// Training steps per minute.
    pub steps_per_minute: f64,
    /// Rollouts trained per second.
    pub trained_samples_per_second: f64,
    /// Completion tokens trained per second.
    pub trained_tokens_per_second: f64,
    /// Tokens decoded per second, all engine replicas together.
    pub generated_tokens_per_second: f64,
    /// Busy fraction of the engine replicas over the window.
    pub engine_busy_ratio: f64,
    /// Fraction of its lifetime the trainer waited for data (since start).
    pub trainer_idle_ratio: f64,
    /// Mean version lag of trained tokens (since start).
    pub mean_version_lag: f64,
}

/// What `GET /v1/status` answers. Parts whose actor did not answer are `null`; `actors` says why.
#[derive(Debug, Clone, Serialize)]
pub struct StatusReport {
    /// Sluice's version.
    pub sluice_version: &'static str,
    /// Seconds since the admin API started (with the node).
    pub uptime_seconds: f64,
    /// Version of the weights the next training step starts from.
    pub policy_version: u64,
    /// Training steps taken.
    pub step: u64,
    /// The `paused` knob.
    pub paused: bool,
    /// Groups per replay bucket.
    pub buckets: Option<std::collections::BTreeMap<&'static str, u64>>,
    /// Throughput.
    pub rates: Rates,
    /// Every knob's value.
    pub knobs: Knobs,
    /// Health of each actor the API can reach.
    pub actors: std::collections::BTreeMap<&'static str, ActorHealth>,
    /// The controller's view.
    pub controller: Option<ControllerStatus>,
    /// The trainer's view.
    pub trainer: TrainerStatus,
    /// The replay store's buckets and counters.
    pub replay: Option<StoreSnapshot>,
    /// Each engine replica.
    pub engines: Option<Vec<EngineStats>>,
}

/// Counters the rates are differences of.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    steps: u64,
    trained_samples: u64,
    trained_tokens: u64,
    generated_tokens: u64,
    busy_seconds: f64,
    engine_seconds: f64,
}

/// Recent observations, at most a minute old and [`RateWindow::CAP`] long.
#[derive(Debug, Default)]
struct RateWindow {
    seen: VecDeque<(Instant, Totals)>,
}

impl RateWindow {
    const SPAN: Duration = Duration::from_secs(60);
    const CAP: usize = 64;

    /// Records `now` and returns the baseline to difference against: the oldest observation at
    /// least a second old, else the start (all zeros).
    fn observe(&mut self, now: Instant, totals: Totals, started: Instant) -> (Instant, Totals) {
        while self
            .seen
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Self::SPAN)
            || self.seen.len() >= Self::CAP
        {
            self.seen.pop_front();
        }
        let baseline = match self.seen.front() {
            Some(&(t, old)) if now.duration_since(t) >= Duration::from_secs(1) => (t, old),
            _ => (started, Totals::default()),
        };
        self.seen.push_back((now, totals));
        baseline
    }
}

fn rates(now: (Instant, Totals), then: (Instant, Totals), trainer: &TrainerStatus) -> Rates {
    let secs = now.0.duration_since(then.0).as_secs_f64().max(1e-9);
    let (a, b) = (now.1, then.1);
    let per_s = |x: u64, y: u64| x.saturating_sub(y) as f64 / secs;
    let engine_seconds = a.engine_seconds - b.engine_seconds;
    Rates {
        window_seconds: secs,
        steps_per_minute: per_s(a.steps, b.steps) * 60.0,
        trained_samples_per_second: per_s(a.trained_samples, b.trained_samples),
        trained_tokens_per_second: per_s(a.trained_tokens, b.trained_tokens),
        generated_tokens_per_second: per_s(a.generated_tokens, b.generated_tokens),
        engine_busy_ratio: if engine_seconds > 0.0 {
            ((a.busy_seconds - b.busy_seconds) / engine_seconds).clamp(0.0, 1.0)
        } else {
            0.0
        },
        trainer_idle_ratio: trainer.idle_ratio(),
        mean_version_lag: trainer.mean_lag(),
    }
}

/// Awaits an actor call with the status timeout.
async fn ask<T>(fut: impl Future<Output = Result<T, ActorError>>) -> Result<T, String> {
    match tokio::time::timeout(ACTOR_CALL_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {ACTOR_CALL_TIMEOUT:?}")),
    }
}

fn health<T>(r: &Result<T, String>) -> ActorHealth {
    match r {
        Ok(_) => ActorHealth {
            health: Health::Running,
            detail: None,
        },
        Err(e) => ActorHealth {
            health: Health::Unreachable,
            detail: Some(e.clone()),
        },
    }
}

/// Gathers every actor's view; an actor that does not answer is reported, not fatal.
async fn status_report(s: &Shared) -> StatusReport {
    let node = &s.admin.node;
    let (controller, replay, engines) = tokio::join!(
        ask(node.controller.status()),
        ask(node.replay.status()),
        ask(node.engine.stats()),
    );
    let trainer = node.trainer.status();
    let knobs = node.knobs.current();
    let now = Instant::now();
    let engine_list = engines.as_ref().map(Vec::as_slice).unwrap_or_default();
    let totals = Totals {
        steps: trainer.steps,
        trained_samples: trainer.trained_samples,
        trained_tokens: trainer.trained_tokens,
        generated_tokens: engine_list.iter().map(|e| e.generated_tokens).sum(),
        busy_seconds: engine_list.iter().map(|e| e.busy_seconds).sum(),
        engine_seconds: engine_list.iter().map(|e| e.uptime_seconds).sum(),
    };
    let baseline = s
        .rates
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .observe(now, totals, s.started);
    let trainer_health = match (&trainer.error, trainer.done) {
        (Some(e), _) => ActorHealth {
            health: Health::Failed,
            detail: Some(e.clone()),
        },
        (None, true) => ActorHealth {
            health: Health::Done,
            detail: None,
        },
        (None, false) => ActorHealth {
            health: Health::Running,
            detail: None,
        },
    };
    let actors = [
        ("controller", health(&controller)),
        ("replay", health(&replay)),
        ("engine", health(&engines)),
        ("trainer", trainer_health),
    ]
    .into_iter()
    .collect();
    let replay = replay.ok().map(|r| r.store);
    StatusReport {
        sluice_version: env!("CARGO_PKG_VERSION"),
        uptime_seconds: now.duration_since(s.started).as_secs_f64(),
        policy_version: trainer.version.0,
        step: trainer.steps,
        paused: knobs.paused,
        buckets: replay.as_ref().map(|r| r.buckets.clone()),
        rates: rates((now, totals), baseline, &trainer),
        knobs,
        actors,
        controller: controller.ok(),
        trainer,
        replay,
        engines: engines.ok(),
    }
}

async fn get_status(State(s): State<Shared>) -> Json<StatusReport> {
    Json(status_report(&s).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares_whole_strings() {
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cre", b"s3cret"));
        assert!(!constant_time_eq(b"s3cretx", b"s3cret"));
        assert!(!constant_time_eq(b"", b"s3cret"));
        assert!(!constant_time_eq(b"S3cret", b"s3cret"));
    }

    #[test]
    fn the_rate_window_differences_against_a_second_old_baseline() {
        let start = Instant::now();
        let mut w = RateWindow::default();
        let t = |steps| Totals {
            steps,
            ..Totals::default()
        };
        let (base, _) = w.observe(start + Duration::from_millis(500), t(1), start);
        assert_eq!(base, start, "first call: since start");
        let (base, old) = w.observe(start + Duration::from_secs(3), t(5), start);
        assert_eq!((base, old.steps), (start + Duration::from_millis(500), 1));
        let (base, _) = w.observe(start + Duration::from_secs(120), t(9), start);
        assert_eq!(base, start, "observations older than a minute are dropped");
        for i in 0..200 {
            w.observe(
                start + Duration::from_secs(121) + Duration::from_millis(i),
                t(9),
                start,
            );
        }
        assert!(w.seen.len() <= RateWindow::CAP);
    }
}
