//! `POST /v1/replay/clear`: an operator throws away the groups at rest in the replay store
//! (completed, aborted, expired), for instance after changing the reward or the data, so the
//! trainer sees only what is generated from then on.
//!
//! Body (optional, JSON): `{"force": false, "buckets": ["completed", "aborted", "expired"]}`.
//! While the run is training (admission open, or groups pending or in flight) the call is refused
//! with 409 `run_active` unless `force` is true: pause the run (`POST /v1/pause`), let in-flight
//! groups settle, then clear. Groups that are pending or in flight are never cleared; a forced
//! clear leaves them running, and they are stored as usual when they settle.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_replay::Bucket;

use super::{AdminState, ApiError, authorize, read_body, require_json};

/// What the body may say.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClearRequest {
    #[serde(default)]
    force: bool,
    buckets: Option<Vec<String>>,
}

pub(super) async fn clear(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let body = read_body(body)?;
    let request = parse(&headers, &body)?;
    let buckets = match &request.buckets {
        None => Bucket::CLEARABLE.to_vec(),
        Some(names) => names
            .iter()
            .map(|n| clearable(n))
            .collect::<Result<_, _>>()?,
    };
    let unreachable = |e: sluice_actors::ActorError| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "actor_unreachable",
            e.to_string(),
        )
    };
    if !request.force
        && let Some(why) = activity(&s).await.map_err(unreachable)?
    {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "run_active",
            format!(
                "the run is training ({why}): pause it (`sluice pause` or POST /v1/pause), wait until no group is pending or in flight, then clear; or pass `\"force\": true` (`sluice replay clear --force`) to clear the groups at rest now"
            ),
        ));
    }
    match s.node.replay.clear(buckets).await.map_err(unreachable)? {
        Ok(outcome) => Ok(Json(json!({
            "cleared": outcome.cleared,
            "discarded_tokens": outcome.discarded_tokens,
            "forced": request.force,
        }))),
        Err(message) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_bucket",
            message,
        )),
    }
}

/// An empty body means the defaults; anything else must be a JSON object of known fields.
fn parse(headers: &HeaderMap, body: &Bytes) -> Result<ClearRequest, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(ClearRequest::default());
    }
    require_json(headers)?;
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!(
                "invalid clear request: {e}; expected {{\"force\": bool, \"buckets\": [\"completed\", \"aborted\", \"expired\"]}}"
            ),
        )
    })
}

fn clearable(name: &str) -> Result<Bucket, ApiError> {
    Bucket::CLEARABLE
        .into_iter()
        .find(|b| b.as_label() == name)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_bucket",
                format!(
                    "bucket `{name}` cannot be cleared: expected one of completed, aborted, expired (pending and in-flight groups are still running)"
                ),
            )
        })
}

/// Why the run counts as training, or `None` when clearing is safe without force: the trainer
/// has finished its budget, or admission is paused and nothing is pending or in flight.
async fn activity(s: &AdminState) -> Result<Option<String>, sluice_actors::ActorError> {
    if s.node.trainer.status().done {
        return Ok(None);
    }
    let replay = s.node.replay.status().await?;
    let live: u64 = [Bucket::Pending, Bucket::InFlight]
        .iter()
        .map(|b| replay.store.buckets.get(b).copied().unwrap_or(0))
        .sum();
    Ok(if !s.node.knobs.current().paused {
        Some("admission is open".to_owned())
    } else if live > 0 {
        Some(format!("{live} groups pending or in flight"))
    } else {
        None
    })
}
