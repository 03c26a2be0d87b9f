//! `POST /update_weights_from_url`, an engine node's weight fetch from its head: the version is
//! streamed from the head with the node token, its CRC-32 checked, and swapped in; a wrong CRC,
//! a URL outside the head (or under it but not `/v1/weights/<version>`), a `weight_version`
//! other than the URL's, or a head that refuses the token change nothing; an engine node takes
//! no weights from disk; a plain `sluice serve` has no such route.

mod server_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde_json::json;
use server_support::post;
use sluice_core::config::Secret;
use sluice_engine::server::fetch::WeightFetch;
use sluice_engine::server::{ServerOptions, ServerState, WeightEvents, serve};
use sluice_engine::{InferenceBackend, NativeEngine, NativeEngineParams};
use sluice_model::presets::{Preset, write_preset};
use sluice_model::{LoadOptions, Tokenizer, load_checkpoint};

const TOKEN: &str = "node-token";

/// The stand-in head's state: the file it serves and the authorization headers it saw.
type HeadState = (Arc<Vec<u8>>, Arc<Mutex<Vec<String>>>);

/// A stand-in head: `GET /v1/weights/1` answers `file` to the node token, 401 otherwise;
/// records the authorization headers it saw.
async fn head(file: Vec<u8>) -> (String, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let state = (Arc::new(file), Arc::clone(&seen));
    let app = axum::Router::new()
        .route(
            "/v1/weights/1",
            axum::routing::get(
                |State((file, seen)): State<HeadState>, headers: HeaderMap| async move {
                    let auth = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    seen.lock().unwrap().push(auth.clone());
                    if auth == format!("Bearer {TOKEN}") {
                        (StatusCode::OK, (*file).clone())
                    } else {
                        (StatusCode::UNAUTHORIZED, b"wrong bearer token".to_vec())
                    }
                },
            ),
        )
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, seen)
}

/// An engine node's server on the tiny preset (seed 0), fetching from `source` with `token`
/// (`None`: a plain server without the route).
async fn node(
    dir: &std::path::Path,
    fetch: Option<(String, &str)>,
) -> (std::net::SocketAddr, NativeEngine) {
    let model = dir.join("model");
    write_preset(Preset::Tiny, &model, 0).unwrap();
    let weights = Arc::new(load_checkpoint(&model, &LoadOptions::default()).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_dir(&model).unwrap());
    let events = Arc::new(WeightEvents::default());
    let engine = NativeEngine::start(
        NativeEngineParams {
            max_running_sequences: 4,
            max_step_tokens: 256,
            ..NativeEngineParams::default()
        },
        Arc::clone(&weights),
        Some(Arc::clone(&tokenizer)),
        events.sink(),
    )
    .unwrap();
    let state = ServerState::with_fetch(
        engine.control(),
        tokenizer,
        ServerOptions {
            model_name: "tiny".into(),
            dtype: weights.dtype(),
            device: weights.device().clone(),
            max_n: 4,
            max_queued_sequences: 16,
            token: None,
            http: Default::default(),
        },
        events,
        fetch.map(|(source, token)| WeightFetch {
            source,
            token: Some(Secret::new(token)),
            dir: dir.join("fetched"),
            model_dir: model.clone(),
            timeout: Duration::from_secs(30),
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, state, std::future::pending()));
    (addr, engine)
}

/// The `model.safetensors` of the tiny preset with another seed: the head's version 1.
fn version_one(dir: &std::path::Path) -> Vec<u8> {
    let d = dir.join("head-v1");
    write_preset(Preset::Tiny, &d, 9).unwrap();
    std::fs::read(d.join("model.safetensors")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_is_fetched_checked_and_swapped_in() {
    let dir = tempfile::tempdir().unwrap();
    let file = version_one(dir.path());
    let crc = crc32fast::hash(&file);
    let (head_url, seen) = head(file.clone()).await;
    let (addr, engine) = node(dir.path(), Some((head_url.clone(), TOKEN))).await;
    let url = format!("{head_url}/v1/weights/1");

    // A wrong CRC: refused, nothing swapped.
    let r = post(
        addr,
        "/update_weights_from_url",
        json!({"url": url, "crc32": crc ^ 1, "weight_version": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("CRC-32"), "{}", r.body);
    assert_eq!(engine.stats().version.0, 0);

    // A URL outside the node's head: refused before any call (the token stays home).
    let calls = seen.lock().unwrap().len();
    let r = post(
        addr,
        "/update_weights_from_url",
        json!({"url": "http://127.0.0.1:9/v1/weights/1", "crc32": crc, "weight_version": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body
            .contains("weights are fetched only from this node's head"),
        "{}",
        r.body
    );
    assert_eq!(seen.lock().unwrap().len(), calls);

    // The right one: fetched with the node token, checked, in use as version 1.
    let r = post(
        addr,
        "/update_weights_from_url",
        json!({"url": url, "crc32": crc, "weight_version": 1, "mode": "in_flight"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["weight_version"], 1);
    assert_eq!(engine.stats().version.0, 1);
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|a| a == &format!("Bearer {TOKEN}"))
    );
    let fetched = std::fs::read(dir.path().join("fetched/v000001/model.safetensors")).unwrap();
    assert!(fetched == file, "the node's copy is the head's bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_is_a_502_and_a_plain_server_has_no_route() {
    let dir = tempfile::tempdir().unwrap();
    let file = version_one(dir.path());
    let crc = crc32fast::hash(&file);
    let (head_url, _) = head(file).await;
    let url = format!("{head_url}/v1/weights/1");
    let (addr, engine) = node(dir.path(), Some((head_url, "not-the-token"))).await;
    let r = post(
        addr,
        "/update_weights_from_url",
        json!({"url": url, "crc32": crc, "weight_version": 1}),
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(r.body.contains("401"), "{}", r.body);
    assert_eq!(engine.stats().version.0, 0);

    let plain = tempfile::tempdir().unwrap();
    let (addr, _engine) = node(plain.path(), None).await;
    let r = post(
        addr,
        "/update_weights_from_url",
        json!({"url": url, "crc32": crc}),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
}

/// `…/v1/weights/../../x` used to pass as "under the head" (a prefix match): only
/// `<head>/v1/weights/<version>` is fetched now, and only as that version, so a caller cannot
/// label the head's weights with a version the head never published; an engine node's
/// `/update_weights_from_disk` (weights the head never saw) answers 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traversal_and_unpublished_versions_are_refused_before_any_fetch() {
    let dir = tempfile::tempdir().unwrap();
    let file = version_one(dir.path());
    let crc = crc32fast::hash(&file);
    let (head_url, seen) = head(file).await;
    let (addr, engine) = node(dir.path(), Some((head_url.clone(), TOKEN))).await;
    for url in [
        format!("{head_url}/v1/weights/../../x"),
        format!("{head_url}/v1/weights/1/../../../admin"),
        format!("{head_url}/v1/weights/1?x=1"),
        format!("{head_url}/v1/nodes"),
        format!("{head_url}:80/v1/weights/1"),
    ] {
        let r = post(
            addr,
            "/update_weights_from_url",
            json!({"url": url, "crc32": crc}),
        )
        .await;
        assert_eq!(r.status, 400, "{url}: {}", r.body);
        assert!(
            r.body
                .contains("weights are fetched only from this node's head"),
            "{url}: {}",
            r.body
        );
    }
    let r = post(
        addr,
        "/update_weights_from_url",
        json!({"url": format!("{head_url}/v1/weights/1"), "crc32": crc, "weight_version": 999_999}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body
            .contains("weight_version 999999 is not the version the url names (1)"),
        "{}",
        r.body
    );
    assert!(seen.lock().unwrap().is_empty(), "no fetch was made");

    let next = dir.path().join("next");
    write_preset(Preset::Tiny, &next, 1).unwrap();
    let r = post(
        addr,
        "/update_weights_from_disk",
        json!({"model_path": next, "weight_version": 999_999}),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("only from its head"), "{}", r.body);
    assert_eq!(engine.stats().version.0, 0);
}
