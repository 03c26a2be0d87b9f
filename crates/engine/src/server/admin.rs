//! Health, model listing, and the SGLang-style RL extensions: abort by request id, pause and
//! continue generation, load a new checkpoint from disk as the next policy version.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_core::{PolicyVersion, WeightUpdateMode};
use sluice_model::{LoadOptions, load_checkpoint};

use super::completions::{parse_body, unix_now};
use super::{ApiError, ServerState};

/// How long `update_weights_from_disk` waits for the swap (a `drain` waits for running requests).
const SWAP_TIMEOUT: Duration = Duration::from_secs(600);

/// `GET /health`: 200 while the engine thread runs.
pub async fn health(State(state): State<Arc<ServerState>>) -> Result<Json<Value>, ApiError> {
    if state.control.is_alive() {
        Ok(Json(json!({})))
    } else {
        Err(ApiError::unavailable("the engine has stopped"))
    }
}

/// `GET /v1/models`.
pub async fn models(State(state): State<Arc<ServerState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name(),
            "object": "model",
            "created": unix_now(),
            "owned_by": "sluice",
            "max_model_len": state.context_len(),
        }],
    }))
}

/// `GET /get_weight_version`: the policy version in use, with engine statistics (its load:
/// running, waiting, busy seconds since start; a head's replicas read it).
pub async fn weight_version(State(state): State<Arc<ServerState>>) -> Json<Value> {
    let s = state.control.stats();
    Json(json!({
        "weight_version": s.version.0,
        "running": s.running,
        "waiting": s.waiting,
        "generated_tokens": s.generated_tokens,
        "busy_seconds": s.busy_seconds,
        "uptime_seconds": s.uptime_seconds,
    }))
}

#[derive(Debug, Deserialize)]
struct AbortBody {
    #[serde(default)]
    rid: Option<String>,
    #[serde(default)]
    abort_all: bool,
}

/// `POST /abort_request` `{"rid": …}` or `{"abort_all": true}`: the aborted requests answer
/// with what they generated so far and `finish_reason: "abort"`. An unknown rid is not an error
/// (the request may just have finished).
pub async fn abort_request(
    State(state): State<Arc<ServerState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let b: AbortBody = parse_body(&body)?;
    if b.abort_all {
        state.control.abort_all()?;
        return Ok(Json(json!({"success": true})));
    }
    let rid = b
        .rid
        .ok_or_else(|| ApiError::invalid("rid", "give `rid` or `abort_all: true`"))?;
    let ids = state.rids.lock().expect("not poisoned").get(&rid).cloned();
    let found = ids.is_some();
    for id in ids.into_iter().flatten() {
        state.control.abort(id)?;
    }
    Ok(Json(json!({"success": true, "found": found})))
}

#[derive(Debug, Default, Deserialize)]
struct PauseBody {
    #[serde(default)]
    mode: Option<String>,
}

/// `POST /pause_generation` `{"mode": "abort" | "in_place"}` (default `abort`, as SGLang):
/// `abort` returns every request's partial output; `in_place` keeps them for
/// `/continue_generation`.
pub async fn pause(
    State(state): State<Arc<ServerState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let b: PauseBody = if body.is_empty() {
        PauseBody::default()
    } else {
        parse_body(&body)?
    };
    let abort = match b.mode.as_deref() {
        None | Some("abort") => true,
        Some("in_place") | Some("retract") => false,
        Some(other) => {
            return Err(ApiError::invalid(
                "mode",
                format!("unknown pause mode `{other}` (abort, in_place)"),
            ));
        }
    };
    state.control.pause(abort)?;
    Ok(Json(json!({"success": true})))
}

/// `POST /continue_generation`.
pub async fn continue_generation(
    State(state): State<Arc<ServerState>>,
) -> Result<Json<Value>, ApiError> {
    state.control.continue_generation()?;
    Ok(Json(json!({"success": true})))
}

#[derive(Debug, Deserialize)]
struct UpdateBody {
    model_path: PathBuf,
    #[serde(default)]
    weight_version: Option<Value>,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    abort_all_requests: bool,
}

/// `POST /update_weights_from_disk` `{"model_path", "weight_version"?, "mode"?,
/// "abort_all_requests"?}`: loads a Hugging Face directory and swaps it in as version
/// `weight_version` (default: the current one + 1) with `mode` (`in_flight` by default;
/// `abort_all_requests: true` means `abort_resume`). Answers once the new weights are in use.
pub async fn update_weights_from_disk(
    State(state): State<Arc<ServerState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    if state.fetch.is_some() {
        return Err(ApiError::not_found(
            None,
            "this engine node loads weights only from its head (POST /update_weights_from_url)",
        ));
    }
    let b: UpdateBody = parse_body(&body)?;
    let mode = update_mode(b.mode.as_deref(), b.abort_all_requests)?;
    let _one_at_a_time = state.loading.lock().await;
    let version = requested_version(&state, b.weight_version.as_ref())?;
    check_not_older(&state, version)?;
    let loaded = load_dir(&state, b.model_path.clone(), "model_path").await?;
    install(
        &state,
        loaded,
        version,
        mode,
        &b.model_path.display().to_string(),
    )
    .await
}

/// The swap mode of an update call: `mode`, else `abort_resume` when `abort_all_requests`,
/// else `in_flight`.
pub(super) fn update_mode(
    mode: Option<&str>,
    abort_all_requests: bool,
) -> Result<WeightUpdateMode, ApiError> {
    match (mode, abort_all_requests) {
        (None, true) => Ok(WeightUpdateMode::AbortResume),
        (None, false) => Ok(WeightUpdateMode::InFlight),
        (Some(m), _) => m
            .parse::<WeightUpdateMode>()
            .map_err(|e| ApiError::invalid("mode", e.to_string())),
    }
}

/// The version an update installs: `weight_version`, default the current one + 1 (400 when
/// the current one is the largest there is: versions never wrap back to 0).
pub(super) fn requested_version(
    state: &ServerState,
    weight_version: Option<&Value>,
) -> Result<PolicyVersion, ApiError> {
    match weight_version {
        None | Some(Value::Null) => {
            let current = state.control.stats().version;
            current.0.checked_add(1).map(PolicyVersion).ok_or_else(|| {
                ApiError::invalid(
                    "weight_version",
                    format!(
                        "the current version {} is the largest there is; give `weight_version` explicitly",
                        current.0
                    ),
                )
            })
        }
        Some(v) => v
            .as_u64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .map(PolicyVersion)
            .ok_or_else(|| {
                ApiError::invalid("weight_version", format!("`{v}` is not a version number"))
            }),
    }
}

/// Refuses to install `version` below the one in use (409 naming both): the versions a server
/// reports only rise, so tokens tagged with them order as the weights that made them.
fn check_not_older(state: &ServerState, version: PolicyVersion) -> Result<(), ApiError> {
    let current = state.control.stats().version;
    if version < current {
        return Err(ApiError {
            param: Some("weight_version".into()),
            ..ApiError::new(
                StatusCode::CONFLICT,
                "version_conflict",
                format!(
                    "weight_version {} is below the version in use, {}; versions only rise",
                    version.0, current.0
                ),
            )
        });
    }
    Ok(())
}

/// Loads the Hugging Face directory `path` in the served dtype and device, off the runtime;
/// a failure names `field`.
pub(super) async fn load_dir(
    state: &ServerState,
    path: PathBuf,
    field: &'static str,
) -> Result<sluice_model::ModelWeights, ApiError> {
    let options = LoadOptions {
        dtype: Some(state.options.dtype),
        device: state.options.device.clone(),
    };
    let shown = path.display().to_string();
    // Reading safetensors is blocking I/O: off the runtime, awaited here (not detached).
    tokio::task::spawn_blocking(move || load_checkpoint(&path, &options))
        .await
        .map_err(|e| ApiError::internal(format!("loading thread: {e}")))?
        .map_err(|e| ApiError::invalid(field, format!("{shown}: {e}")))
}

/// Swaps `loaded` in as `version` with `mode` and answers once the engine uses it.
pub(super) async fn install(
    state: &ServerState,
    loaded: sluice_model::ModelWeights,
    version: PolicyVersion,
    mode: WeightUpdateMode,
    source: &str,
) -> Result<Json<Value>, ApiError> {
    let weights = Arc::new(loaded.with_version(version));
    if **weights.config() != **state.control.model_config() {
        return Err(ApiError::invalid(
            "model_path",
            "the checkpoint has another architecture than the served model",
        ));
    }
    let done = state.weights.wait();
    state.control.update_weights(weights.to_envelope(), mode)?;
    let (now, pause) = tokio::time::timeout(SWAP_TIMEOUT, done)
        .await
        .map_err(|_| ApiError::unavailable("the weight swap did not happen in time"))?
        .map_err(|_| ApiError::unavailable("the engine stopped before swapping"))?;
    Ok(Json(json!({
        "success": true,
        "message": format!("loaded {source} as version {}", now.0),
        "weight_version": now.0,
        "mode": mode.as_str(),
        "pause_seconds": pause.as_secs_f64(),
    })))
}
