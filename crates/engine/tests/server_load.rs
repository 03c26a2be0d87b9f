//! `sluice serve` under load: a call beyond the server's sequence budget answers 503 with
//! `Retry-After` (OpenAI clients retry it; they never retry the 400 it used to be), a call that
//! can never fit answers 400, and the engine's `running`/`waiting` counts return to 0 once idle.

mod server_support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use server_support::{call, post, serve_tiny};

/// Polls `/get_weight_version` until `done` holds, for at most 10 s; returns the last answer.
async fn wait_stats(addr: std::net::SocketAddr, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = call(addr, "GET", "/get_weight_version", "").await.json();
        if done(&v) || Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_answers_503_with_retry_after() {
    // The test server takes 16 sequences at once and n ≤ 8.
    let s = serve_tiny().await;
    let addr = s.addr;
    assert_eq!(
        post(addr, "/pause_generation", json!({"mode": "in_place"}))
            .await
            .status,
        200
    );
    // 2 prompts × n = 8: the whole budget, held while the engine is paused.
    let first = tokio::spawn(async move {
        post(
            addr,
            "/v1/completions",
            json!({"prompt": ["a", "b"], "n": 8, "max_tokens": 2, "ignore_eos": true, "rid": "held"}),
        )
        .await
    });
    let v = wait_stats(addr, |v| v["waiting"] == 16).await;
    assert_eq!(v["waiting"], 16, "{v}");

    let busy = tokio::time::timeout(
        Duration::from_secs(10),
        post(
            addr,
            "/v1/completions",
            json!({"prompt": "c", "max_tokens": 2}),
        ),
    )
    .await
    .expect("an overloaded server answers at once instead of queueing");
    assert_eq!(busy.status, 503, "{}", busy.body);
    assert!(busy.head.contains("retry-after: 1\r\n"), "{}", busy.head);
    let e = busy.json();
    assert_eq!(e["error"]["type"], "server_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server overloaded: 16 of 16 sequences"),
        "{e}"
    );
    let chat = post(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(chat.status, 503, "chat too: {}", chat.body);

    // More than the whole budget in one call can never be served: 400, no Retry-After.
    let never = post(
        addr,
        "/v1/completions",
        json!({"prompt": ["a", "b", "c"], "n": 8, "max_tokens": 2}),
    )
    .await;
    assert_eq!(never.status, 400, "{}", never.body);
    assert!(!never.head.contains("retry-after"), "{}", never.head);
    assert!(
        never.body.contains("asks for 24 sequences"),
        "{}",
        never.body
    );

    // A rid still in flight is not reused (aborting by it would hit both calls).
    let twin = post(
        addr,
        "/v1/completions",
        json!({"prompt": "d", "max_tokens": 2, "rid": "held"}),
    )
    .await;
    assert_eq!(twin.status, 400, "{}", twin.body);
    assert_eq!(twin.json()["error"]["param"], "rid");

    assert_eq!(
        post(addr, "/continue_generation", json!({})).await.status,
        200
    );
    let done = first.await.unwrap();
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.json()["choices"].as_array().unwrap().len(), 16);
    // The budget came back: the same call now succeeds.
    let again = post(
        addr,
        "/v1/completions",
        json!({"prompt": "c", "max_tokens": 2}),
    )
    .await;
    assert_eq!(again.status, 200, "{}", again.body);
    s.stop().await;
}

/// The reported staleness: `running` stayed at 1 after one finished request (49 after a large
/// batch), because the engine blocked for the next command without publishing its counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_counts_return_to_zero_when_idle() {
    let s = serve_tiny().await;
    let addr = s.addr;
    let one = post(
        addr,
        "/v1/completions",
        json!({"prompt": "a", "max_tokens": 3, "ignore_eos": true}),
    )
    .await;
    assert_eq!(one.status, 200, "{}", one.body);
    let v = wait_stats(addr, |v| v["running"] == 0 && v["waiting"] == 0).await;
    assert_eq!(
        (v["running"].clone(), v["waiting"].clone()),
        (json!(0), json!(0)),
        "{v}"
    );

    let batch = post(
        addr,
        "/v1/completions",
        json!({"prompt": ["a", "b"], "n": 8, "max_tokens": 4, "ignore_eos": true}),
    )
    .await;
    assert_eq!(batch.status, 200, "{}", batch.body);
    let v = wait_stats(addr, |v| v["running"] == 0 && v["waiting"] == 0).await;
    assert_eq!(
        (v["running"].clone(), v["waiting"].clone()),
        (json!(0), json!(0)),
        "{v}"
    );
    assert!(v["generated_tokens"].as_u64().unwrap() >= 3 + 16 * 4, "{v}");
    s.stop().await;
}
