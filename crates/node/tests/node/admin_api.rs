//! The admin API's whole surface over real HTTP: `/v1/status` reports version, step, buckets,
//! rates, knobs and actor health; pause and resume need the token and flip the `paused` knob,
//! which stops and restarts admission; unknown routes answer 404 and wrong methods 405, both in
//! the one JSON error shape; a call without a configured token needs none.

use crate::common;

use std::time::Duration;

use serde_json::Value;
use sluice_node::client::{Call, send};
use sluice_node::{Node, NodeOptions};

async fn call(
    base: &str,
    method: &'static str,
    path: &'static str,
    token: Option<&'static str>,
) -> (u16, Value) {
    let base = base.to_owned();
    let (code, body) = tokio::task::spawn_blocking(move || {
        send(
            &base,
            &Call {
                method,
                path,
                body: b"",
                token,
                content_type: None,
            },
        )
        .unwrap()
    })
    .await
    .unwrap();
    let json = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {body}"));
    (code, json)
}

fn error_type(body: &Value) -> &str {
    let e = &body["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "no message: {body}"
    );
    e["type"]
        .as_str()
        .unwrap_or_else(|| panic!("no type: {body}"))
}

async fn start(token: Option<&str>, max_steps: u64) -> Node {
    let mut config = common::config("paused = true", "time_scale = 1.0");
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.token = token.map(sluice_config::Secret::new);
    config.run.max_steps = std::num::NonZeroU64::new(max_steps).unwrap();
    let options = NodeOptions {
        serve_admin: true,
        ..NodeOptions::default()
    };
    Node::start(&config, options).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_pause_and_resume_over_http() {
    let node = start(Some("s3cret"), 3).await;
    let base = format!("http://{}", node.admin_addr().unwrap());

    let (code, s) = call(&base, "GET", "/v1/status", None).await;
    assert_eq!(code, 200, "{s}");
    assert_eq!(s["sluice_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(s["paused"], true);
    assert_eq!(s["step"], 0);
    assert_eq!(s["policy_version"], 0);
    assert_eq!(s["knobs"]["paused"], true);
    for part in [
        "buckets",
        "rates",
        "controller",
        "trainer",
        "replay",
        "engines",
    ] {
        assert!(!s[part].is_null(), "{part} missing: {s}");
    }
    assert_eq!(s["engines"].as_array().unwrap().len(), 2);
    for actor in ["controller", "engine", "replay", "trainer"] {
        assert_eq!(s["actors"][actor]["health"], "running", "{actor}: {s}");
    }

    let (code, body) = call(&base, "POST", "/v1/resume", None).await;
    assert_eq!((code, error_type(&body)), (401, "unauthorized"));
    let (code, body) = call(&base, "POST", "/v1/resume", Some("guess")).await;
    assert_eq!((code, error_type(&body)), (401, "unauthorized"));
    assert!(
        node.handles.knobs.current().paused,
        "refused calls change nothing"
    );

    let (code, body) = call(&base, "POST", "/v1/resume", Some("s3cret")).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["knobs"]["paused"], false);
    assert_eq!(body["changes"][0]["knob"], "paused");
    common::wait_for_status(
        &node,
        "resume to start admission",
        Duration::from_secs(10),
        |s| s.controller.admitted_total > 0,
    )
    .await;
    let (code, body) = call(&base, "POST", "/v1/pause", Some("s3cret")).await;
    assert_eq!(code, 200, "{body}");
    assert!(node.handles.knobs.current().paused);
    let (code, body) = call(&base, "POST", "/v1/pause", Some("s3cret")).await;
    assert_eq!(code, 200, "pausing twice is fine: {body}");
    assert_eq!(body["changes"].as_array().unwrap().len(), 0);
    // Paused: admission stops while in-flight groups finish.
    let admitted = common::wait_for_status(
        &node,
        "the in-flight groups to finish",
        Duration::from_secs(10),
        |s| s.controller.in_flight == 0,
    )
    .await
    .controller
    .admitted_total;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        node.status().await.unwrap().controller.admitted_total,
        admitted
    );

    let (code, _) = call(&base, "POST", "/v1/resume", Some("s3cret")).await;
    assert_eq!(code, 200);
    let done = node
        .wait_done(Duration::from_secs(30), |_| {})
        .await
        .unwrap();
    common::check_invariants(&done);
    let (code, s) = call(&base, "GET", "/v1/status", None).await;
    assert_eq!(code, 200);
    assert_eq!(s["step"], 3);
    assert_eq!(s["policy_version"], 3);
    assert_eq!(s["actors"]["trainer"]["health"], "done");
    assert!(
        s["rates"]["trained_samples_per_second"].as_f64().unwrap() > 0.0,
        "{s}"
    );
    assert!(s["rates"]["window_seconds"].as_f64().unwrap() > 0.0);
    let consumed = s["buckets"]["consumed"].as_u64().unwrap();
    assert_eq!(consumed, 3 * 4, "3 steps of 4 groups: {s}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_and_wrong_methods_answer_json() {
    let node = start(None, 2).await;
    let base = format!("http://{}", node.admin_addr().unwrap());
    for (method, path, code, kind) in [
        ("GET", "/v1/nope", 404, "not_found"),
        ("GET", "/", 404, "not_found"),
        ("POST", "/v2/knobs", 404, "not_found"),
        ("DELETE", "/v1/knobs", 405, "method_not_allowed"),
        ("POST", "/v1/knobs", 405, "method_not_allowed"),
        ("GET", "/v1/pause", 405, "method_not_allowed"),
        ("PUT", "/v1/status", 405, "method_not_allowed"),
    ] {
        let (got, body) = call(&base, method, path, None).await;
        assert_eq!(
            (got, error_type(&body)),
            (code, kind),
            "{method} {path}: {body}"
        );
    }
    // No token configured: mutating calls need none.
    let (code, body) = call(&base, "POST", "/v1/resume", None).await;
    assert_eq!(code, 200, "{body}");
    assert!(!node.handles.knobs.current().paused);
    node.shutdown().await;
}
