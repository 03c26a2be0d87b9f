//! The env server's answers to hostile or out-of-order clients, at the HTTP level: calls out of
//! the protocol's order answer 409 `env_protocol`, bodies that are not the call's JSON answer the
//! documented error shape, a configured token is required on every env call, and a tool call
//! nested 10,000 deep answers a tool error instead of aborting the server.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use sluice_core::config::Secret;
use sluice_env::TaskRegistry;
use sluice_env::remote::{ServerConfig, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

struct Server {
    addr: String,
    stop: Option<oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start(token: Option<&str>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = oneshot::channel();
        let config = ServerConfig {
            token: token.map(Secret::new),
            call_timeout: Duration::from_secs(10),
            ..ServerConfig::default()
        };
        let handle = tokio::spawn(serve(
            listener,
            Arc::new(TaskRegistry::builtin()),
            config,
            async {
                let _ = rx.await;
            },
        ));
        Self {
            addr,
            stop: Some(tx),
            handle,
        }
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.handle.await.unwrap().unwrap();
    }

    /// Sends one request; returns the status and the body parsed as JSON (`Null` when empty).
    async fn call(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, Value) {
        let mut s = tokio::net::TcpStream::connect(&self.addr).await.unwrap();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        let status: u16 = out[9..12].parse().unwrap();
        let (_, body) = out.split_once("\r\n\r\n").unwrap();
        let json = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
        };
        (status, json)
    }

    async fn json(&self, method: &str, path: &str, body: Value) -> (u16, Value) {
        self.call(
            method,
            path,
            &[("Content-Type", "application/json")],
            &body.to_string(),
        )
        .await
    }

    async fn create(&self, task: &str, input: Value) -> String {
        let (status, body) = self
            .json(
                "POST",
                "/v1/envs",
                json!({"task": task, "sample": sample(input)}),
            )
            .await;
        assert_eq!(status, 201, "{body}");
        body["env_id"].as_str().unwrap().to_owned()
    }
}

fn sample(input: Value) -> Value {
    json!({"id": "s0", "domain": "math", "dataset": "t", "input": input, "system_prompt": null})
}

fn kind(body: &Value) -> &str {
    body["error"]["kind"]
        .as_str()
        .unwrap_or_else(|| panic!("not the error shape: {body}"))
}

fn answer(text: &str) -> Value {
    json!({"message": {"role": "assistant", "content": text}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_out_of_order_answer_409_env_protocol() {
    let server = Server::start(None).await;
    let arith = json!({"question": "1+1=", "answer": 2});
    let id = server.create("arithmetic", arith.clone()).await;
    let step = format!("/v1/envs/{id}/step");
    let init = format!("/v1/envs/{id}/init");

    let (status, body) = server.json("POST", &step, answer("2")).await;
    assert_eq!((status, kind(&body)), (409, "env_protocol"), "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("before init")
    );

    let (status, body) = server.json("POST", &init, json!({})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = server.json("POST", &init, json!({})).await;
    assert_eq!((status, kind(&body)), (409, "env_protocol"), "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("already initialised")
    );

    let (status, body) = server.json("POST", &step, answer("2")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["done"], true);
    let (status, body) = server.json("POST", &step, answer("2")).await;
    assert_eq!((status, kind(&body)), (409, "env_protocol"), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("done"));

    let (status, _) = server
        .call("DELETE", &format!("/v1/envs/{id}"), &[], "")
        .await;
    assert_eq!(status, 204);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_answer_the_documented_json_error_shape() {
    let server = Server::start(None).await;
    let json_ct = [("Content-Type", "application/json")];
    // Not JSON at all.
    let (status, body) = server.call("POST", "/v1/envs", &json_ct, "{oops").await;
    assert_eq!((status, kind(&body)), (400, "bad_request"), "{body}");
    // JSON of the wrong shape (no `sample`).
    let (status, body) = server
        .json("POST", "/v1/envs", json!({"task": "arithmetic"}))
        .await;
    assert_eq!((status, kind(&body)), (400, "bad_request"), "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("sample"),
        "{body}"
    );
    // No JSON content type.
    let (status, body) = server.call("POST", "/v1/envs", &[], "{}").await;
    assert_eq!((status, kind(&body)), (415, "bad_request"), "{body}");
    // A step body of the wrong shape.
    let id = server
        .create("arithmetic", json!({"question": "1+1=", "answer": 2}))
        .await;
    let (status, body) = server
        .json("POST", &format!("/v1/envs/{id}/step"), json!({"msg": 1}))
        .await;
    assert_eq!((status, kind(&body)), (400, "bad_request"), "{body}");
    // An unknown route.
    let (status, body) = server.call("GET", "/v2/nothing", &[], "").await;
    assert_eq!((status, kind(&body)), (404, "unknown_route"), "{body}");
    // The shape every Sluice API answers (sluice_http::api), `kind` on top for env clients.
    assert_eq!(body["error"]["type"], "unknown_route", "{body}");
    assert_eq!(body["error"]["code"], 404, "{body}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_token_is_required_on_every_env_call() {
    let server = Server::start(Some("s3cret")).await;
    let create =
        json!({"task": "arithmetic", "sample": sample(json!({"question": "1+1=", "answer": 2}))})
            .to_string();
    let json_ct = ("Content-Type", "application/json");
    let (status, body) = server.call("POST", "/v1/envs", &[json_ct], &create).await;
    assert_eq!((status, kind(&body)), (401, "unauthorized"), "{body}");
    let wrong = ("Authorization", "Bearer guess");
    let (status, body) = server
        .call("POST", "/v1/envs", &[json_ct, wrong], &create)
        .await;
    assert_eq!((status, kind(&body)), (401, "unauthorized"), "{body}");
    let (status, body) = server.call("DELETE", "/v1/envs/e1", &[], "").await;
    assert_eq!((status, kind(&body)), (401, "unauthorized"), "{body}");
    // Health and the task list stay open.
    let (status, _) = server.call("GET", "/v1/health", &[], "").await;
    assert_eq!(status, 200);
    let right = ("Authorization", "Bearer s3cret");
    let (status, body) = server
        .call("POST", "/v1/envs", &[json_ct, right], &create)
        .await;
    assert_eq!(status, 201, "{body}");
    server.stop().await;

    // The client sends it.
    let server = Server::start(Some("s3cret")).await;
    let url = format!("http://{}", server.addr);
    let s: sluice_core::DataSample =
        serde_json::from_value(sample(json!({"question": "1+1=", "answer": 2}))).unwrap();
    let factory =
        sluice_env::remote::RemoteEnvFactory::new(&url, "arithmetic", Duration::from_secs(5))
            .unwrap();
    let mut env = sluice_env::EnvFactory::make_env(&factory, &s).unwrap();
    let err = env.init().await.unwrap_err();
    assert!(err.to_string().contains("401"), "{err}");
    let mut env =
        sluice_env::EnvFactory::make_env(&factory.with_token(Secret::new("s3cret")), &s).unwrap();
    env.init().await.unwrap();
    env.close().await.unwrap();
    server.stop().await;
}

/// The reported crash: one request with 10,000 nested parentheses aborted the server (stack
/// overflow in the calculator's evaluator). Now it is a tool error and the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deeply_nested_calculator_call_does_not_kill_the_server() {
    let server = Server::start(None).await;
    for nesting in [3_000usize, 10_000] {
        let id = server
            .create(
                "calculator_tool",
                json!({"expression": "1 + 1", "answer": 2}),
            )
            .await;
        let (status, _) = server
            .json("POST", &format!("/v1/envs/{id}/init"), json!({}))
            .await;
        assert_eq!(status, 200);
        let expression = format!("{}1{}", "(".repeat(nesting), ")".repeat(nesting));
        let call = json!({"message": {"role": "assistant", "content": null, "tool_calls": [{
            "id": "call_0", "type": "function",
            "function": {"name": "calc", "arguments": json!({"expression": expression}).to_string()}
        }]}});
        let (status, body) = server
            .json("POST", &format!("/v1/envs/{id}/step"), call)
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["situation"], "tool_error", "{body}");
        let reply = body["messages"][0]["content"].as_str().unwrap();
        assert!(reply.starts_with("error: expression "), "{reply}");
    }
    let (status, _) = server.call("GET", "/v1/health", &[], "").await;
    assert_eq!(status, 200, "the server is still up");
    server.stop().await;
}
