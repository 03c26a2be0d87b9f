//! The admin API over real HTTP: knobs read and patched (a refused value answers 400 and changes
//! nothing; a missing token answers 401), the change is seen at the next decision (a paused
//! pipeline starts admitting), `/v1/status` and `/metrics` answer.

use crate::common;

use std::time::Duration;

use sluice_node::client::request;
use sluice_node::{Node, NodeOptions};

async fn call(
    base: String,
    method: &'static str,
    path: &'static str,
    body: Option<&'static str>,
    token: Option<&'static str>,
) -> (u16, String) {
    tokio::task::spawn_blocking(move || request(&base, method, path, body, token).unwrap())
        .await
        .unwrap()
}

/// `PATCH /v1/knobs` with `body`, with the token.
async fn patch_knobs(base: &str, body: &'static str) -> (u16, String) {
    call(
        base.to_owned(),
        "PATCH",
        "/v1/knobs",
        Some(body),
        Some("s3cret"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_knob_patched_over_http_takes_effect_at_the_next_decision() {
    let node = start_a_paused_node().await;
    let base = format!("http://{}", node.admin_addr().unwrap());

    let (code, body) = call(base.clone(), "GET", "/v1/knobs", None, None).await;
    assert_eq!(code, 200);
    assert!(body.contains("\"paused\":true"), "{body}");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        node.status().await.unwrap().controller.admitted_total,
        0,
        "paused: nothing admitted"
    );

    check_refused_patches_change_nothing(&node, &base).await;

    let (code, body) = call(
        base.clone(),
        "PATCH",
        "/v1/knobs",
        Some(r#"{"paused": false}"#),
        Some("s3cret"),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    common::wait_for_status(
        &node,
        "unpausing to start admission",
        Duration::from_secs(10),
        |s| s.controller.admitted_total > 0,
    )
    .await;

    let status = node
        .wait_done(Duration::from_secs(20), |_| {})
        .await
        .unwrap();
    common::check_invariants(&status);
    check_status_and_metrics_answer(&node, &base).await;
    node.shutdown().await;
}

/// A three-step node that starts paused, serving the admin API (token `s3cret`) and `/metrics`.
async fn start_a_paused_node() -> Node {
    let mut config = common::config("paused = true\nmax_version_lag = 1", "time_scale = 1.0");
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.token = Some(sluice_config::Secret::new("s3cret"));
    config.metrics.listen = "127.0.0.1:0".parse().unwrap();
    config.run.max_steps = std::num::NonZeroU64::new(3).unwrap();
    let options = NodeOptions {
        serve_admin: true,
        serve_metrics: true,
        ..NodeOptions::default()
    };
    Node::start(&config, options).await.unwrap()
}

/// A patch without the token answers 401; a refused value or an unknown knob answers 400; none
/// of them changes anything (the node stays paused).
async fn check_refused_patches_change_nothing(node: &Node, base: &str) {
    let (code, _) = call(
        base.to_owned(),
        "PATCH",
        "/v1/knobs",
        Some(r#"{"paused": false}"#),
        None,
    )
    .await;
    assert_eq!(code, 401, "mutating calls need the token");
    // The reason and `param` name the knob, whether the range (`invalid_knob`) or the type
    // (`invalid_json`) refused it, also after a knob that was fine.
    for (patch, knob) in [
        (
            r#"{"paused": false, "max_concurrent_rollouts": 2000000}"#,
            "max_concurrent_rollouts",
        ),
        (
            r#"{"paused": false, "max_version_lag": -1}"#,
            "max_version_lag",
        ),
        (r#"{"paused": false, "admission": "eager"}"#, "admission"),
    ] {
        let (code, body) = patch_knobs(base, patch).await;
        assert_eq!(code, 400, "{patch}: {body}");
        let error = &serde_json::from_str::<serde_json::Value>(&body).unwrap()["error"];
        assert_eq!(error["param"], knob, "{patch}: {body}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(knob), "the reason names the knob: {body}");
    }
    let (code, body) = call(
        base.to_owned(),
        "PATCH",
        "/v1/knobs",
        Some(r#"{"no_such_knob": 1}"#),
        Some("s3cret"),
    )
    .await;
    assert_eq!(code, 400, "{body}");
    // `null` is what a serializer writes for NaN or infinity: refused, naming the knob, rather
    // than read as "not given" and answered 200 with no change. A knob given twice is refused too.
    for (patch, named) in [
        (
            r#"{"staleness_threshold": null}"#,
            "`staleness_threshold` is null",
        ),
        (
            r#"{"domain_mix": {"math": null}}"#,
            "`domain_mix.math` is null",
        ),
        (
            r#"{"paused": false, "paused": true}"#,
            "duplicate field `paused`",
        ),
    ] {
        let (code, body) = patch_knobs(base, patch).await;
        assert_eq!(code, 400, "{patch}: {body}");
        assert!(body.contains(named), "{patch}: {body}");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        node.status().await.unwrap().controller.admitted_total,
        0,
        "a refused patch changed nothing"
    );
    assert!(node.handles.knobs.current().paused);
}

/// `/v1/status` answers with the controller and the trainer, `/metrics` with the seeded names.
async fn check_status_and_metrics_answer(node: &Node, base: &str) {
    let (code, body) = call(base.to_owned(), "GET", "/v1/status", None, None).await;
    assert_eq!(code, 200);
    assert!(
        body.contains("\"controller\"") && body.contains("\"trainer\""),
        "{body}"
    );
    // Every name below is on /metrics from the start (seeded) or from the first trained step
    // (the lag histogram): no telemetry tick is waited for.
    let metrics_base = format!("http://{}", node.metrics_addr().unwrap());
    let (code, text) = call(metrics_base, "GET", "/metrics", None, None).await;
    assert_eq!(code, 200);
    for name in [
        "sluice_replay_bucket_groups",
        "sluice_replay_transitions_total",
        "sluice_trainer_policy_version",
        "sluice_trainer_token_version_lag_versions_bucket",
        "sluice_engine_busy_ratio",
        "sluice_trainer_idle_ratio",
        "sluice_node_knob_value",
        "sluice_node_admission_mode_info{mode=\"demand\"}",
        "sluice_node_admission_mode_info{mode=\"eta\"}",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}");
    }
    // Each series is seeded with the label values it can take only.
    for never in [
        "sluice_node_admission_mode_info{mode=\"drain\"}",
        "sluice_rollout_finished_rollouts_total{status=\"aborted\"}",
    ] {
        assert!(!text.contains(never), "/metrics seeds {never}");
    }
}

/// The admin server cuts off a client that sends half a request head (200 such connections used
/// to stay open for good), and still answers whole requests; the deadline is the server's
/// option (10 s by default, short here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_request_is_closed_after_the_header_read_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .build_recorder()
        .handle();
    let options = sluice_http::ServeOptions {
        header_read_timeout: Duration::from_millis(300),
        ..sluice_http::ServeOptions::default()
    };
    let server = sluice_node::admin::Server::start_with(
        "127.0.0.1:0".parse().unwrap(),
        sluice_node::admin::metrics_router(handle, None),
        options,
    )
    .await
    .unwrap();
    let mut halves = Vec::new();
    for _ in 0..20 {
        let mut s = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAcc")
            .await
            .unwrap();
        halves.push(s);
    }
    for mut s in halves {
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest)).await;
        assert!(matches!(closed, Ok(Ok(_))), "still open: {closed:?}");
    }
    let (code, _) = call(
        format!("http://{}", server.addr),
        "GET",
        "/metrics",
        None,
        None,
    )
    .await;
    assert_eq!(code, 200);
    server.shutdown().await;
}
