//! The head's membership and weight routes of the admin API (`docs/admin.md`):
//!
//! | route | token | what |
//! |---|---|---|
//! | `GET /v1/nodes` | – | every member ([`NodeView`]) |
//! | `POST /v1/nodes` | yes | join: a [`JoinRequest`]; answers a [`JoinReply`](super::registry::JoinReply) |
//! | `POST /v1/nodes/{name}/heartbeat` | yes | a [`Heartbeat`]; 404 when not a member (join again) |
//! | `POST /v1/nodes/{name}/leave` | yes | `{"incarnation": n}`: a clean leave |
//! | `GET /v1/weights/{version}` | yes | the version's `model.safetensors`, streamed, CRC-32 in `x-sluice-crc32` |
//!
//! A refused token is logged here as well as answered 401, so the operator of the head sees
//! which node tried to join with the wrong one. A node that is not a head answers 404 on these.

use std::sync::Arc;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_core::PolicyVersion;
use sluice_core::config::Secret;
use sluice_core::metrics as m;
use sluice_engine::remote::WeightDirs;
use sluice_http::api::ApiError;
use tokio::io::AsyncReadExt;

use super::registry::{Heartbeat, JoinRequest, NodeView, Registry};

/// The header carrying the CRC-32 (8 hex digits) of a streamed weight file.
pub const CRC32_HEADER: &str = "x-sluice-crc32";

/// What the head's cluster routes serve.
#[derive(Debug)]
pub struct ClusterState {
    /// The members.
    pub registry: Arc<Registry>,
    /// The versions engine nodes fetch.
    pub served: Arc<WeightDirs>,
}

/// What the cluster routes read: the head's members and weights (`None` on other nodes) and
/// the node token (`admin.token`). The admin router hands it over through `FromRef`.
#[derive(Debug, Clone)]
pub struct ClusterApi {
    /// A head's members and served weights.
    pub cluster: Option<Arc<ClusterState>>,
    /// The token members join and call with.
    pub token: Option<Secret>,
}

fn cluster(s: &ClusterApi) -> Result<&Arc<ClusterState>, ApiError> {
    s.cluster.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_a_head",
            "this node is not a head (node.role = \"head\"): it has no members and serves no weights",
        )
    })
}

/// The token check of a member route, logged when refused.
fn member_authorize(s: &ClusterApi, headers: &HeaderMap, what: &str) -> Result<(), ApiError> {
    sluice_http::api::authorize(
        s.token.as_ref(),
        headers,
        "unauthorized",
        Some("admin.token"),
    )
    .inspect_err(|e| {
        tracing::warn!(route = what, reason = %e.message, "refused a node's call: wrong or missing node token (admin.token)");
    })
}

fn json_body<T: for<'de> Deserialize<'de>>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = sluice_http::api::read_body(body, sluice_http::api::MAX_BODY_BYTES)?;
    sluice_http::api::parse_json(&body, "invalid_json", "invalid JSON")
}

/// `GET /v1/nodes`.
pub async fn list(State(s): State<ClusterApi>) -> Result<Json<Vec<NodeView>>, ApiError> {
    Ok(Json(cluster(&s)?.registry.list()))
}

/// `POST /v1/nodes`.
pub async fn join(
    State(s): State<ClusterApi>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let c = cluster(&s)?;
    member_authorize(&s, &headers, "POST /v1/nodes")?;
    let req: JoinRequest = json_body(body)?;
    match c.registry.join(req) {
        Ok(reply) => Ok(Json(serde_json::to_value(reply).unwrap_or_default())),
        Err(e @ super::registry::JoinError::Full { .. }) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_nodes",
            e.to_string(),
        )),
        Err(e @ super::registry::JoinError::NameTaken { .. }) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "node_name_taken",
            e.to_string(),
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_node",
            e.to_string(),
        )),
    }
}

/// `POST /v1/nodes/{name}/heartbeat`.
pub async fn heartbeat(
    State(s): State<ClusterApi>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let c = cluster(&s)?;
    member_authorize(&s, &headers, "POST /v1/nodes/{name}/heartbeat")?;
    let beat: Heartbeat = json_body(body)?;
    if c.registry.heartbeat_from(&name, &beat) {
        Ok(Json(json!({})))
    } else {
        Err(not_member(&name, beat.incarnation))
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Leave {
    incarnation: u64,
}

/// `POST /v1/nodes/{name}/leave`.
pub async fn leave(
    State(s): State<ClusterApi>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let c = cluster(&s)?;
    member_authorize(&s, &headers, "POST /v1/nodes/{name}/leave")?;
    let l: Leave = json_body(body)?;
    if c.registry.leave(&name, l.incarnation) {
        Ok(Json(json!({})))
    } else {
        Err(not_member(&name, l.incarnation))
    }
}

fn not_member(name: &str, incarnation: u64) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_a_member",
        format!("`{name}` is not a member as incarnation {incarnation}; join again"),
    )
}

/// `GET /v1/weights/{version}`: streamed from disk in 1 MiB chunks.
pub async fn weights(
    State(s): State<ClusterApi>,
    Path(version): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let c = cluster(&s)?;
    member_authorize(&s, &headers, "GET /v1/weights/{version}")?;
    let v: u64 = version.parse().map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_version",
            format!("`{version}` is not a version number"),
        )
    })?;
    let kept = || c.served.written();
    let (path, crc) = c.served.file(PolicyVersion(v)).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "no_such_version",
            format!("version {v} is not kept here (kept: {:?})", kept()),
        )
    })?;
    // Opened before answering: a prune that deletes it later does not cut the stream short.
    let file = tokio::fs::File::open(&path).await.map_err(|e| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "no_such_version",
            format!("version {v}: {e}"),
        )
    })?;
    Ok(stream_file(file, crc).await)
}

/// A weight file streamed in 1 MiB chunks with its length and CRC-32 (`x-sluice-crc32`): what
/// `GET /v1/weights/{version}` answers (also used by `sluice bench weights`).
pub async fn stream_file(file: tokio::fs::File, crc: u32) -> Response {
    let len = file.metadata().await.map(|m| m.len()).unwrap_or(0);
    let chunks = futures::stream::unfold(Some(file), |file| async move {
        let mut file = file?;
        let mut buf = vec![0u8; 1 << 20];
        match file.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                metrics::counter!(m::NODE_WEIGHTS_SERVED).increment(n as u64);
                Some((Ok(Bytes::from(buf)), Some(file)))
            }
            Err(e) => Some((Err(e), None)),
        }
    });
    let mut response = Body::from_stream(chunks).into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    if let Ok(v) = HeaderValue::from_str(&format!("{crc:08x}")) {
        h.insert(CRC32_HEADER, v);
    }
    response
}
