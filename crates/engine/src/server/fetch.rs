//! `POST /update_weights_from_url`: weights over the network, for an engine node that shares
//! no disk with its head. The body names the URL of one version's `model.safetensors` (the
//! head's `GET /v1/weights/<version>`), its CRC-32 and the version; the server streams the file
//! into its own download directory, checks the CRC, loads it next to the served model's
//! `config.json`, and swaps it in like `/update_weights_from_disk`.
//!
//! Only `<source>/v1/weights/<version>` is fetched ([`WeightFetch::source`], no other path, no
//! `..`): the server sends its node token along, and must not hand it to whatever URL a caller
//! names. The version installed is the one the URL names (a `weight_version` that differs is
//! refused), so a caller cannot label the head's weights with a version the head never
//! published. An engine node takes weights only this way: its `/update_weights_from_disk`
//! answers 404.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use serde::Deserialize;
use serde_json::Value;
use sluice_core::PolicyVersion;
use sluice_core::config::Secret;
use sluice_http::{Download, HttpClient};

use super::admin::{install, load_dir, requested_version, update_mode};
use super::completions::parse_body;
use super::{ApiError, ServerState};

/// Where and how the server fetches weights (an engine node's).
#[derive(Debug, Clone)]
pub struct WeightFetch {
    /// The only base URL weights are fetched from (the head's admin API).
    pub source: String,
    /// Bearer token sent with the fetch (the node token).
    pub token: Option<Secret>,
    /// Directory downloads go to (one subdirectory per version, the previous ones removed).
    pub dir: PathBuf,
    /// The served model's directory: its `config.json` describes every fetched version.
    pub model_dir: PathBuf,
    /// Deadline of one whole download.
    pub timeout: Duration,
}

#[derive(Debug, Deserialize)]
struct FetchBody {
    url: String,
    crc32: u32,
    #[serde(default)]
    weight_version: Option<Value>,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    abort_all_requests: bool,
}

/// `POST /update_weights_from_url` `{"url", "crc32", "weight_version"?, "mode"?,
/// "abort_all_requests"?}` (see the module docs). 400 for a URL outside the source or a CRC
/// mismatch, 502 when the source refuses or fails, 404 when the server fetches no weights.
pub async fn update_weights_from_url(
    State(state): State<Arc<ServerState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let b: FetchBody = parse_body(&body)?;
    let Some(fetch) = state.fetch.clone() else {
        return Err(ApiError::not_found(
            None,
            "this server fetches no weights over HTTP (it is not an engine node)",
        ));
    };
    let mode = update_mode(b.mode.as_deref(), b.abort_all_requests)?;
    let url_version = weights_path_version(&fetch.source, &b.url)?;
    let _one_at_a_time = state.loading.lock().await;
    let version = requested_version(&state, b.weight_version.as_ref())?;
    if b.weight_version.as_ref().is_some_and(|v| !v.is_null()) && version != url_version {
        return Err(ApiError::invalid(
            "weight_version",
            format!(
                "weight_version {} is not the version the url names ({}); a version is installed only as itself",
                version.0, url_version.0
            ),
        ));
    }
    let version = url_version;
    let dir = fetch.dir.join(format!("v{:06}", version.0));
    prepare_dir(&fetch, &dir).await?;
    let client = HttpClient::new(&b.url, "weight source")
        .map_err(|e| ApiError::invalid("url", e.to_string()))?
        .with_token(fetch.token.clone());
    let file = dir.join(sluice_model::checkpoint::SINGLE_FILE);
    let started = std::time::Instant::now();
    let got = client
        .download("", &file, fetch.timeout)
        .await
        .map_err(|e| ApiError::upstream(format!("fetching weights: {e}")))?;
    let bytes = match got {
        Download::Refused(status, body) => {
            return Err(ApiError::upstream(format!(
                "the weight source answered {status}: {}",
                String::from_utf8_lossy(&body)
            )));
        }
        Download::Saved { crc32, bytes } if crc32 != b.crc32 => {
            return Err(ApiError::invalid(
                "crc32",
                format!(
                    "the fetched file ({bytes} bytes) has CRC-32 {crc32:08x}, expected {:08x}",
                    b.crc32
                ),
            ));
        }
        Download::Saved { bytes, .. } => bytes,
    };
    tracing::info!(
        version = version.0,
        bytes,
        seconds = started.elapsed().as_secs_f64(),
        "fetched weights"
    );
    let loaded = load_dir(&state, dir.clone(), "url").await?;
    install(&state, loaded, version, mode, &b.url).await
}

/// The version `url` names, when it is exactly `<source>/v1/weights/<version>`: anything else
/// (another server, another route, `..` segments, a query) is refused, since the server sends
/// its node token along with the fetch.
pub fn weights_path_version(source: &str, url: &str) -> Result<PolicyVersion, ApiError> {
    let refused = || {
        ApiError::invalid(
            "url",
            format!(
                "`{url}` is not {source}/v1/weights/<version>; weights are fetched only from this node's head"
            ),
        )
    };
    let version = url
        .strip_prefix(source.trim_end_matches('/'))
        .and_then(|rest| rest.strip_prefix("/v1/weights/"))
        .filter(|v| !v.is_empty() && v.len() <= 20 && v.bytes().all(|c| c.is_ascii_digit()))
        .ok_or_else(refused)?;
    version.parse().map(PolicyVersion).map_err(|_| refused())
}

/// Empties the download directory but for `dir` (one version at a time is enough: it is loaded
/// before the next arrives), and creates `dir` with the served model's `config.json`.
async fn prepare_dir(fetch: &WeightFetch, dir: &std::path::Path) -> Result<(), ApiError> {
    let (root, dir, model_dir) = (
        fetch.dir.clone(),
        dir.to_path_buf(),
        fetch.model_dir.clone(),
    );
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        std::fs::create_dir_all(&root)?;
        for entry in std::fs::read_dir(&root)?.flatten() {
            if entry.path() != dir {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        std::fs::create_dir_all(&dir)?;
        std::fs::copy(model_dir.join("config.json"), dir.join("config.json"))?;
        Ok(())
    })
    .await
    .map_err(|e| ApiError::internal(format!("download directory thread: {e}")))?
    .map_err(|e| ApiError::internal(format!("preparing {}: {e}", fetch.dir.display())))
}
