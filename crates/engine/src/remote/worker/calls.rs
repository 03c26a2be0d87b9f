//! The worker's calls besides the generation stream: writing the weights to disk and asking the
//! server to load them, and turning a server's reply into a completion.

use std::sync::Arc;

use serde_json::{Value, json};
use sluice_core::{RequestId, WeightUpdateMode};
use sluice_http::{HttpClient, Method, StatusCode};
use sluice_model::ModelWeights;

use super::super::fault::Fault;
use super::super::{Pinned, WeightDirs, wire};
use crate::backend::{Completion, FinishReason, TokenOutput};

/// Writes `weights` (unless already on disk) and pins the directory, off the runtime.
pub(super) async fn write(
    dirs: Arc<WeightDirs>,
    weights: Arc<ModelWeights>,
) -> Result<Pinned, String> {
    tokio::task::spawn_blocking(move || dirs.publish(&weights))
        .await
        .unwrap_or_else(|e| Err(format!("writer thread: {e}")))
}

/// Asks the server behind `client` to load `pinned` as its version, with `mode`.
pub(super) async fn load(
    client: &HttpClient,
    pinned: &Pinned,
    mode: WeightUpdateMode,
    timeout: std::time::Duration,
) -> Result<(), Fault> {
    // Served over HTTP: the server fetches the file and checks its CRC-32 (no shared disk).
    let (route, body) = match pinned.fetch() {
        Some((url, crc)) => (
            "/update_weights_from_url",
            json!({
                "url": url,
                "crc32": crc,
                "weight_version": pinned.version().0,
                "mode": mode.as_str(),
                "abort_all_requests": mode == WeightUpdateMode::AbortResume,
            }),
        ),
        None => (
            "/update_weights_from_disk",
            json!({
                "model_path": pinned.path(),
                "weight_version": pinned.version().0,
                "mode": mode.as_str(),
                "abort_all_requests": mode == WeightUpdateMode::AbortResume,
            }),
        ),
    };
    let body = body.to_string().into_bytes();
    match client.call(Method::POST, route, Some(body), timeout).await {
        Ok((st, _)) if st.is_success() => Ok(()),
        Ok((st, b)) => Err(Fault::failed(format!(
            "status {st}: {}",
            String::from_utf8_lossy(&b)
        ))),
        Err(e) => Err(Fault::unreachable(&e)),
    }
}

/// How a request whose reply broke the protocol finishes.
pub(super) const BAD_REPLY: &str = "remote_bad_reply";

/// The completion of a request from the reply (2xx or 4xx) of the server at `url`: the resumed
/// tokens first. A reply that breaks the protocol or `limits` fails the request as
/// `remote_bad_reply` (the log names the server and what was wrong): none of its tokens is kept.
pub(super) fn finish_from_reply(
    id: RequestId,
    partial: &TokenOutput,
    (status, bytes): (StatusCode, &[u8]),
    url: &str,
    limits: wire::ReplyLimits,
) -> Completion {
    let mut output = partial.clone();
    let finish = if !status.is_success() {
        tracing::warn!(%id, %url, %status, body = %String::from_utf8_lossy(bytes), "remote engine refused a request");
        FinishReason::Error("remote_bad_request".into())
    } else {
        match serde_json::from_slice::<Value>(bytes)
            .map_err(|e| wire::BadReply(e.to_string()))
            .and_then(|v| wire::parse_completion(&v, limits))
        {
            Ok((new, finish)) => {
                output.token_ids.extend(new.token_ids);
                output.logprobs.extend(new.logprobs);
                output.versions.extend(new.versions);
                finish
            }
            Err(wire::BadReply(reason)) => {
                tracing::warn!(%id, %url, %reason, "remote engine server {url} sent a bad reply, refused: {reason}");
                FinishReason::Error(BAD_REPLY.into())
            }
        }
    };
    Completion { id, output, finish }
}
