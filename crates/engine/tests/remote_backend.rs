//! The remote backend (one server per replica) against `sluice serve`'s server: generation with
//! ids, logprobs and versions, resume, abort with the partial, weight updates through a written
//! checkpoint, a server that does not answer (the replica dies, every request aborts with its
//! partial), the run's weights installed before any work (at start and on the rebuilt replica of
//! a server that came back), old weight directories pruned, and a server holding a version the
//! head never published marked down. Several servers as replicas of
//! the engine actor: `crates/node/tests/node/engine_remote.rs`.

mod server_support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use server_support::{post, serve_tiny, write_tiny};
use sluice_core::{GroupId, NodeId, PolicyVersion, RequestId, RunId, WeightUpdateMode};
use sluice_engine::remote::{RemoteEngine, RemoteParams, WeightDirs};
use sluice_engine::{
    Completion, EngineEvent, FinishReason, GenerateRequest, InferenceBackend, SamplingParams,
};
use sluice_model::candle::{DType, Device};
use sluice_model::presets::{Preset, preset_config, random_snapshot};

fn params(url: String, weights_dir: PathBuf) -> RemoteParams {
    RemoteParams {
        replica: 0,
        url,
        request_timeout: Duration::from_secs(30),
        control_timeout: Duration::from_secs(5),
        weights: WeightDirs::new(weights_dir, None, 3),
        initial: None,
        model_name: Some("tiny".into()),
        token: None,
    }
}

type Events = (
    Receiver<Completion>,
    Receiver<(PolicyVersion, WeightUpdateMode)>,
);

fn start(p: RemoteParams) -> (RemoteEngine, Events) {
    let (ftx, frx) = crossbeam_channel::unbounded();
    let (utx, urx) = crossbeam_channel::unbounded();
    let engine = RemoteEngine::start(
        p,
        PolicyVersion(0),
        Arc::new(move |e| match e {
            EngineEvent::Finished(c) => {
                let _ = ftx.send(c);
            }
            EngineEvent::WeightsUpdated { version, mode, .. } => {
                let _ = utx.send((version, mode));
            }
        }),
    )
    .unwrap();
    (engine, (frx, urx))
}

fn request(counter: u64, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        id: GroupId {
            run: RunId::from_name("remote"),
            node: NodeId(0),
            counter,
        }
        .rollout(0)
        .request(0, 0),
        prompt_token_ids: vec![10, 11, 12],
        resume: None,
        params: SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens,
            seed: None,
            stop_token_ids: vec![],
        },
        domain: None,
    }
}

async fn next(rx: &Receiver<Completion>) -> Completion {
    let rx = rx.clone();
    tokio::task::spawn_blocking(move || {
        rx.recv_timeout(Duration::from_secs(30))
            .expect("a completion")
    })
    .await
    .unwrap()
}

fn id_of(r: &GenerateRequest) -> RequestId {
    r.id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generates_resumes_aborts_and_updates_through_a_server() {
    let s = serve_tiny().await;
    let weights_dir = s.dir.path().join("published");
    let (engine, (finished, updates)) = start(params(s.url(), weights_dir.clone()));

    let full_req = request(1, 12);
    engine.submit(full_req.clone()).unwrap();
    let full = next(&finished).await;
    assert!(matches!(
        full.finish,
        FinishReason::Length | FinishReason::Stop
    ));
    assert!(!full.output.is_empty());
    assert_eq!(full.output.logprobs.len(), full.output.len());
    assert!(full.output.versions.iter().all(|v| *v == PolicyVersion(0)));

    // Resume from the first 4 tokens: the whole completion comes back, equal to the full one.
    if full.output.len() > 4 {
        let mut resumed = request(2, 12);
        let mut partial = full.output.clone();
        partial.token_ids.truncate(4);
        partial.logprobs.truncate(4);
        partial.versions.truncate(4);
        resumed.resume = Some(partial);
        engine.submit(resumed).unwrap();
        let done = next(&finished).await;
        assert_eq!(done.output.token_ids, full.output.token_ids);
    }

    // Abort a long request: its partial comes back as an abort.
    let long = request(3, 3000);
    let long_id = id_of(&long);
    engine.submit(long).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    engine.abort(long_id).unwrap();
    let aborted = next(&finished).await;
    assert_eq!(aborted.id, long_id);
    // Greedy on the tiny model may hit an end-of-sequence id first, or in an optimised build
    // fill the model's context before the abort lands (a few hundred tokens take tens of
    // milliseconds there); otherwise it is aborted. (The native engine's tests abort at a
    // chosen token, independent of speed.)
    if !matches!(aborted.finish, FinishReason::Stop | FinishReason::Length) {
        assert_eq!(aborted.finish, FinishReason::Abort);
    }
    assert!(aborted.output.len() < 3000);

    // New weights: written as a checkpoint, loaded by the server, tagged on later tokens.
    let config = Arc::new(preset_config(Preset::Tiny));
    let v1 = random_snapshot(config, 1, DType::F32, &Device::Cpu)
        .unwrap()
        .with_version(PolicyVersion(1));
    engine
        .update_weights(Arc::new(v1).to_envelope(), WeightUpdateMode::InFlight)
        .unwrap();
    let (version, mode) =
        tokio::task::spawn_blocking(move || updates.recv_timeout(Duration::from_secs(30)).unwrap())
            .await
            .unwrap();
    assert_eq!(
        (version, mode),
        (PolicyVersion(1), WeightUpdateMode::InFlight)
    );
    assert!(weights_dir.join("v000001").join("config.json").exists());
    engine.submit(request(4, 3)).unwrap();
    let after = next(&finished).await;
    assert!(
        after.output.versions.iter().all(|v| *v == PolicyVersion(1)),
        "{:?}",
        after.output.versions
    );
    assert_eq!(engine.stats().version, PolicyVersion(1));
    drop(engine);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_does_not_answer_is_marked_down_and_requests_abort() {
    // A port with nothing behind it.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dir = tempfile::tempdir().unwrap();
    let (engine, (finished, _)) = start(params(
        format!("http://127.0.0.1:{port}"),
        dir.path().into(),
    ));
    let mut r = request(1, 10);
    let partial = sluice_engine::TokenOutput {
        token_ids: vec![5, 6],
        logprobs: vec![-1.0, -2.0],
        versions: vec![PolicyVersion(0); 2],
    };
    r.resume = Some(partial.clone());
    engine.submit(r).unwrap();
    let c = next(&finished).await;
    assert_eq!(c.finish, FinishReason::Abort);
    assert_eq!(c.output, partial);
    assert_eq!(engine.servers_up(), 0);
    // The replica is dead (the engine actor rebuilds it); a request that still reaches it comes
    // back aborted for the controller to resume elsewhere, not failed as a bad rollout.
    assert!(!engine.is_alive());
    engine.submit(request(2, 10)).unwrap();
    let c = next(&finished).await;
    assert_eq!(c.finish, FinishReason::Abort);
    assert!(c.output.is_empty());
}

/// Weights of the tiny preset unlike the served ones (seed `seed`), as version `version`.
fn head_weights(seed: u64, version: u64) -> Arc<sluice_model::ModelWeights> {
    let config = Arc::new(preset_config(Preset::Tiny));
    Arc::new(
        random_snapshot(config, seed, DType::F32, &Device::Cpu)
            .unwrap()
            .with_version(PolicyVersion(version)),
    )
}

async fn next_update(rx: &Receiver<(PolicyVersion, WeightUpdateMode)>) -> PolicyVersion {
    let rx = rx.clone();
    tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(30)).unwrap().0)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_install_the_runs_weights_before_any_work_and_old_versions_are_pruned() {
    let s = serve_tiny().await;
    let addr = s.addr;
    // Outside the server's directory: the weights outlive the server's crash.
    let published = tempfile::tempdir().unwrap();
    let weights_dir = published.path().join("weights");
    let mut p = params(s.url(), weights_dir.clone());
    // The head is at version 5 with weights the server has never seen (it started from its own
    // checkpoint, as `sluice serve <model dir>` does, and calls them version 0).
    p.initial = Some(head_weights(11, 5));
    p.weights = WeightDirs::new(weights_dir.clone(), None, 2);
    let (engine, (finished, updates)) = start(p);
    // Submitted at once: it must wait until the server holds version 5.
    engine.submit(request(1, 6)).unwrap();
    let first = next(&finished).await;
    assert!(
        matches!(first.finish, FinishReason::Length | FinishReason::Stop),
        "{first:?}"
    );
    assert!(
        !first.output.is_empty() && first.output.versions.iter().all(|v| *v == PolicyVersion(5)),
        "served before the run's weights were installed: {:?}",
        first.output.versions
    );
    assert_eq!(engine.servers_up(), 1);

    // Each update writes a directory; only the newest two stay.
    for v in 6..=8 {
        engine
            .update_weights(head_weights(v, v).to_envelope(), WeightUpdateMode::InFlight)
            .unwrap();
        assert_eq!(next_update(&updates).await, PolicyVersion(v));
    }
    let on_disk: Vec<String> = {
        let mut names: Vec<String> = std::fs::read_dir(&weights_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(on_disk, vec!["v000007", "v000008"]);

    // The server crashes: the replica dies. It comes back from its own checkpoint; the replica
    // rebuilt on the newest weights (as the engine actor's factory does) installs version 8
    // before any work.
    s.stop().await;
    engine.submit(request(2, 6)).unwrap();
    let lost = next(&finished).await;
    assert_eq!(lost.finish, FinishReason::Abort);
    assert_eq!(engine.servers_up(), 0);
    assert!(!engine.is_alive());
    drop(engine);
    let back = server_support::serve_tiny_at(addr).await;
    let mut p = params(back.url(), weights_dir.clone());
    p.initial = Some(head_weights(8, 8));
    p.weights = WeightDirs::new(weights_dir.clone(), None, 2);
    let (engine, (finished, _)) = start(p);
    engine.submit(request(3, 6)).unwrap();
    let after = next(&finished).await;
    assert!(
        !after.output.is_empty() && after.output.versions.iter().all(|v| *v == PolicyVersion(8)),
        "a rebuilt replica got work before the run's weights: {:?}",
        after.output.versions
    );
    drop(engine);
    back.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replicas_load_is_its_servers() {
    let s = serve_tiny().await;
    let (engine, (finished, _)) = start(params(s.url(), s.dir.path().join("published")));
    engine.submit(request(1, 64)).unwrap();
    next(&finished).await;
    // The server computed for the request; the replica reads its busy time within a second
    // or two (a stuck 0 is what a replica that does not read its server reports).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let stats = loop {
        let stats = engine.stats();
        if stats.busy_seconds > 0.0 {
            break stats;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "busy seconds never read: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        stats.busy_seconds <= stats.uptime_seconds,
        "counted from the replica's first reading: {stats:?}"
    );
    drop(engine);
    s.stop().await;
}

/// Weights swapped in behind the head's back as a version the head never published (the hostile
/// sweep's `weight_version: 999999`, which the head used to count as lag 0): the first reply or
/// load reading that shows it marks the server down (the replica is rebuilt on the run's
/// weights), and no token of those weights reaches the head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_holding_a_version_the_head_never_published_is_marked_down() {
    let s = serve_tiny().await;
    let (engine, (finished, _)) = start(params(s.url(), s.dir.path().join("published")));
    engine.submit(request(1, 2)).unwrap();
    let first = next(&finished).await;
    assert!(first.output.versions.iter().all(|v| *v == PolicyVersion(0)));
    assert!(engine.is_alive());

    let injected = s.dir.path().join("injected");
    write_tiny(&injected, 5);
    let r = post(
        s.addr,
        "/update_weights_from_disk",
        serde_json::json!({"model_path": injected, "weight_version": 999_999}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    engine.submit(request(2, 4)).unwrap();
    let c = next(&finished).await;
    assert_eq!(c.finish, FinishReason::Abort);
    assert!(
        c.output.is_empty(),
        "no token of the injected weights: {:?}",
        c.output.versions
    );
    assert!(
        !engine.is_alive(),
        "the server is down: its replica is rebuilt"
    );
    assert_eq!(engine.stats().version, PolicyVersion(0));
}

/// A server that lies: it installs any weights it is sent, reports no load, and answers every
/// completion with `choice`, whatever was asked. One connection per call, as the client opens.
async fn serve_lies(choice: serde_json::Value) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let reply = serde_json::json!({"choices": [choice]}).to_string();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let reply = reply.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                // The head, then as much body as it announces.
                let (head_end, length) = loop {
                    let n = stream.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                        let length = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                        break (end + 4, length);
                    }
                };
                while got.len() < head_end + length {
                    let n = stream.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                let line = String::from_utf8_lossy(&got[..head_end]).into_owned();
                let (status, body) = if line.starts_with("POST /v1/completions ") {
                    ("200 OK", reply)
                } else if line.starts_with("POST /update_weights_from_disk ") {
                    ("200 OK", r#"{"success": true}"#.to_owned())
                } else {
                    ("404 Not Found", r#"{"error": "no such route"}"#.to_owned())
                };
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    url
}

/// A lying server's impossible per-token data (the hostile sweep's findings 5 and 6) fails the
/// request as `remote_bad_reply`, keeping only the tokens it resumed from: a logprob that is
/// null, a string, above 0 or beyond f32, an id outside the vocabulary of the weights the head
/// installed, more new tokens than `max_tokens`, a version that is not an integer. The same
/// server telling the truth (a logprob rounded a hair above 0 included) is trained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impossible_per_token_replies_fail_as_bad_replies_and_are_not_trained() {
    use serde_json::json;
    let vocab = preset_config(Preset::Tiny).vocab_size;
    let many: Vec<u32> = (0..5000).map(|i| i % 7).collect();
    let many_lps = vec![-1.0; 5000];
    let lies = [
        (
            "null logprob",
            json!({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0, null]}}),
        ),
        (
            "string logprob",
            json!({"token_ids": [1], "logprobs": {"token_logprobs": ["x"]}}),
        ),
        (
            "positive logprob",
            json!({"token_ids": [1], "logprobs": {"token_logprobs": [50.0]}}),
        ),
        (
            "logprob beyond f32",
            json!({"token_ids": [1], "logprobs": {"token_logprobs": [1e300]}}),
        ),
        (
            "id = vocab",
            json!({"token_ids": [1, vocab], "logprobs": {"token_logprobs": [-1, -1]}}),
        ),
        (
            "id u32::MAX",
            json!({"token_ids": [u32::MAX], "logprobs": {"token_logprobs": [-1]}}),
        ),
        (
            "5000 tokens for 4",
            json!({"token_ids": many, "logprobs": {"token_logprobs": many_lps}}),
        ),
        (
            "3 new tokens for max_tokens 4, 2 resumed",
            json!({"token_ids": [1, 2, 3], "logprobs": {"token_logprobs": [-1, -1, -1]}}),
        ),
        (
            "string version",
            json!({"token_ids": [1], "logprobs": {"token_logprobs": [-1]}, "token_versions": ["x"]}),
        ),
        (
            "fractional version",
            json!({"token_ids": [1], "logprobs": {"token_logprobs": [-1]}, "token_versions": [0.5]}),
        ),
    ];
    let truth = json!({"token_ids": [1, 2], "finish_reason": "length",
                       "logprobs": {"token_logprobs": [-0.5, 0.00001]}, "token_versions": [0, 0]});
    let resumed = sluice_engine::TokenOutput {
        token_ids: vec![5, 6],
        logprobs: vec![-1.0, -2.0],
        versions: vec![PolicyVersion(0); 2],
    };
    for (what, mut choice) in lies.into_iter().chain([("the truth", truth)]) {
        // Ended as asked: only the per-token data lies.
        choice["finish_reason"] = json!("length");
        let dir = tempfile::tempdir().unwrap();
        let mut p = params(serve_lies(choice).await, dir.path().into());
        p.initial = Some(head_weights(1, 0));
        let (engine, (finished, _)) = start(p);
        let mut r = request(1, 4);
        r.resume = Some(resumed.clone());
        engine.submit(r).unwrap();
        let c = next(&finished).await;
        if what == "the truth" {
            assert_eq!(c.finish, FinishReason::Length, "{what}");
            assert_eq!(c.output.token_ids, vec![5, 6, 1, 2], "{what}");
            assert_eq!(c.output.logprobs, vec![-1.0, -2.0, -0.5, 0.0], "{what}");
        } else {
            assert_eq!(
                c.finish,
                FinishReason::Error("remote_bad_reply".into()),
                "{what}"
            );
            assert_eq!(c.output, resumed, "{what}: none of its tokens kept");
        }
        assert!(engine.is_alive(), "{what}");
    }
}

/// One bad reply fails its request and leaves the server up; four in a row take it down, so a
/// server that keeps breaking the protocol is rebuilt instead of failing every request it gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_replies_keep_breaking_the_protocol_is_marked_down() {
    use serde_json::json;
    let lie = json!({"token_ids": [1], "finish_reason": "length",
                     "logprobs": {"token_logprobs": [50.0]}});
    let dir = tempfile::tempdir().unwrap();
    let mut p = params(serve_lies(lie).await, dir.path().into());
    p.initial = Some(head_weights(1, 0));
    let (engine, (finished, _)) = start(p);
    for counter in 1..=4 {
        assert!(engine.is_alive(), "down after {} bad replies", counter - 1);
        engine.submit(request(counter, 4)).unwrap();
        let c = next(&finished).await;
        assert_eq!(c.finish, FinishReason::Error("remote_bad_reply".into()));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.is_alive() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        !engine.is_alive(),
        "still up after four bad replies in a row"
    );
}
