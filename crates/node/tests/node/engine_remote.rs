//! Remote servers as replicas of the engine actor, the one place requests are routed: a server
//! that dies takes its replica down, its request comes back aborted with the partial it came
//! with, the resumed request runs on the live server, and the dead replica is rebuilt on the
//! newest weights the actor kept.
//!
//! On a head, the replicas run on joined engine nodes: a node that does not answer is not a
//! failure of the replica on it (nothing counts towards `engine_max_restarts`); its slot moves
//! to a node that answers.

use crate::common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_actors::engine::{EngineHandle, EngineReport, EngineSupervision, ReplicaFactory};
use sluice_core::{GroupId, NodeId, PolicyVersion, RequestId, RunId, WeightUpdateMode};
use sluice_engine::remote::{RemoteEngine, RemoteParams, WeightDirs};
use sluice_engine::server::{ServerOptions, ServerState, WeightEvents};
use sluice_engine::{
    Completion, EngineError, FinishReason, GenerateRequest, InferenceBackend, NativeEngine,
    NativeEngineParams, SamplingParams, TokenOutput,
};
use sluice_model::presets::{Preset, write_preset};
use sluice_node::cluster::registry::{JoinRequest, Registry};
use sluice_node::cluster::{HeadEngines, head_factory};

use common::Recorded;

/// `sluice serve` on a fresh tiny preset; returns its URL, its stop switch and its engine.
async fn serve(dir: &std::path::Path) -> (String, tokio::sync::oneshot::Sender<()>, NativeEngine) {
    write_preset(Preset::Tiny, dir, 0).unwrap();
    let weights = Arc::new(
        sluice_model::load_checkpoint(dir, &sluice_model::LoadOptions::default()).unwrap(),
    );
    let tokenizer = Arc::new(sluice_model::Tokenizer::from_dir(dir).unwrap());
    let events = Arc::new(WeightEvents::default());
    let engine = NativeEngine::start(
        NativeEngineParams::default(),
        Arc::clone(&weights),
        Some(Arc::clone(&tokenizer)),
        events.sink(),
    )
    .unwrap();
    let state = ServerState::new(
        engine.control(),
        tokenizer,
        ServerOptions {
            model_name: "tiny".into(),
            dtype: weights.dtype(),
            device: weights.device().clone(),
            max_n: 8,
            max_queued_sequences: sluice_engine::server::DEFAULT_MAX_QUEUED_SEQUENCES,
            token: None,
            http: Default::default(),
        },
        events,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(sluice_engine::server::serve(listener, state, async move {
        let _ = rx.await;
    }));
    (url, tx, engine)
}

/// A server that takes one generation call and holds it until `kill` fires, then vanishes: the
/// connection closes unanswered and the port refuses from then on. Before it, the replica reads
/// the server's load once (`GET`), which this server does not report (404).
fn doomed_server() -> (
    String,
    std::sync::mpsc::Receiver<()>,
    std::sync::mpsc::Sender<()>,
) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (got_tx, got_rx) = std::sync::mpsc::channel();
    let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        for conn in listener.incoming() {
            let mut conn = conn.unwrap();
            loop {
                let n = conn.read(&mut buf).unwrap_or(0);
                if n == 0 {
                    break; // the client closed this connection: take the next one
                }
                let head = String::from_utf8_lossy(&buf[..n]);
                if head.starts_with("GET ") {
                    let reply = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
                    conn.write_all(reply).unwrap();
                    continue;
                }
                assert!(head.starts_with("POST /v1/completions"), "{head}");
                let _ = got_tx.send(());
                let _ = kill_rx.recv();
                return;
            }
        }
    });
    (url, got_rx, kill_tx)
}

fn request(counter: u64, max_tokens: u32, resume: Option<TokenOutput>) -> GenerateRequest {
    GenerateRequest {
        id: GroupId {
            run: RunId::from_name("remote"),
            node: NodeId(0),
            counter,
        }
        .rollout(0)
        .request(0, 0),
        prompt_token_ids: vec![3, 4, 5],
        resume,
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

type Finished = Arc<Recorded<(Completion, u32)>>;

async fn finished(reports: &Finished, id: RequestId) -> (Completion, u32) {
    let is_it = |f: &&(Completion, u32)| f.0.id == id;
    reports
        .until(&format!("{id} to finish"), |r| r.iter().any(|f| is_it(&f)))
        .await;
    reports.lock().iter().find(is_it).unwrap().clone()
}

/// Spawns the engine actor on `replicas` replicas built by `factory`; every completion it
/// reports lands, with its replica, in the returned record.
async fn spawn_engine(
    replicas: u32,
    factory: ReplicaFactory,
    supervision: EngineSupervision,
) -> (EngineHandle, tokio::task::JoinHandle<()>, Finished) {
    let reports: Finished = Arc::default();
    let sink = Arc::clone(&reports);
    let (engine, join) = EngineHandle::spawn_supervised(
        replicas,
        PolicyVersion(0),
        factory,
        Arc::new(move |r| {
            if let EngineReport::Finished {
                completion,
                replica,
            } = r
            {
                sink.push((completion, replica));
            }
        }),
        supervision,
    )
    .await
    .unwrap();
    (engine, join, reports)
}

/// Replica `i` is a remote engine on `urls[i]`; each build is recorded in `built_on` with the
/// version of the weights it was built on.
fn remote_factory(
    urls: [String; 2],
    dirs: Arc<WeightDirs>,
    built_on: Arc<Recorded<(u32, PolicyVersion)>>,
) -> ReplicaFactory {
    ReplicaFactory::new(move |replica, latest, sink| {
        built_on.push((replica, latest.version));
        let params = RemoteParams {
            replica,
            url: urls[replica as usize].clone(),
            request_timeout: Duration::from_secs(30),
            control_timeout: Duration::from_secs(5),
            weights: Arc::clone(&dirs),
            initial: sluice_model::ModelWeights::from_envelope(latest),
            model_name: None,
            token: None,
        };
        RemoteEngine::start(params, latest.version, sink)
            .map(|e| Box::new(e) as Box<dyn InferenceBackend>)
            .map_err(|reason| EngineError::Start { replica, reason })
    })
}

/// Random tiny weights at version 1.
fn tiny_weights_v1() -> Arc<sluice_model::ModelWeights> {
    Arc::new(
        sluice_model::presets::random_snapshot(
            Arc::new(sluice_model::presets::preset_config(Preset::Tiny)),
            7,
            sluice_model::candle::DType::F32,
            &sluice_model::candle::Device::Cpu,
        )
        .unwrap()
        .with_version(PolicyVersion(1)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_is_a_dead_replica_rebuilt_on_the_latest_weights() {
    let dir = tempfile::tempdir().unwrap();
    let (live_url, stop_live, _served) = serve(&dir.path().join("model")).await;
    let (doomed_url, got_call, kill) = doomed_server();
    let dirs = WeightDirs::new(dir.path().join("weights"), None, 2);
    let built_on: Arc<Recorded<(u32, PolicyVersion)>> = Arc::default();
    let factory = remote_factory([doomed_url, live_url], dirs, Arc::clone(&built_on));
    let supervision = EngineSupervision {
        backoff_initial: Duration::from_millis(50),
        backoff_max: Duration::from_millis(200),
        ..EngineSupervision::default()
    };
    let (engine, join, reports) = spawn_engine(2, factory, supervision).await;

    // A resumed request goes back to replica 0, the doomed server, which holds it.
    let partial = TokenOutput {
        token_ids: vec![5, 6, 7],
        logprobs: vec![-1.0, -2.0, -0.5],
        versions: vec![PolicyVersion(0); 3],
    };
    let held = request(1, 10, Some(partial.clone()));
    engine.generate(held.clone(), Some(0));
    tokio::task::spawn_blocking(move || got_call.recv_timeout(Duration::from_secs(30)).unwrap())
        .await
        .unwrap();
    check_the_live_server_serves_meanwhile(&engine, &reports).await;

    // Weights are published, then the doomed server dies: its request comes back aborted with the
    // partial it came with (not failed), and its replica goes down.
    engine.update_weights(tiny_weights_v1().to_envelope(), WeightUpdateMode::InFlight);
    kill.send(()).unwrap();
    let (aborted, _) = finished(&reports, held.id).await;
    assert_eq!(aborted.finish, FinishReason::Abort);
    assert_eq!(aborted.output, partial);

    wait_for_the_live_server_to_install_v1(&engine).await;
    check_the_resumed_rollout_ends_on_the_live_server(&engine, &reports, &held, &partial).await;
    check_replica_0_was_rebuilt_on_the_newest_weights(&built_on).await;
    let health = engine.health().await.unwrap();
    assert!(
        health[0].failures.get("died").is_some_and(|n| *n >= 1),
        "{:?}",
        health[0]
    );
    assert!(health[1].failures.is_empty(), "{:?}", health[1]);
    engine.stop().await;
    join.await.unwrap();
    let _ = stop_live.send(());
}

/// While replica 0 holds its request, the next one goes to the least loaded replica: the live
/// server, replica 1.
async fn check_the_live_server_serves_meanwhile(engine: &EngineHandle, reports: &Finished) {
    let other = request(2, 4, None);
    engine.generate(other.clone(), None);
    let (served, replica) = finished(reports, other.id).await;
    assert_eq!(replica, 1);
    assert!(matches!(
        served.finish,
        FinishReason::Length | FinishReason::Stop
    ));
}

/// The live server holds version 1 before the rollout resumes.
async fn wait_for_the_live_server_to_install_v1(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while engine.stats().await.unwrap()[1].version != PolicyVersion(1) {
        assert!(
            Instant::now() < deadline,
            "the live server never installed v1"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Resumed (as the controller does) with replica 0 preferred: replica 0 is dead or rebuilt on
/// a server that refuses, so the rollout ends on the live server, partial first, its new
/// tokens from version 1.
async fn check_the_resumed_rollout_ends_on_the_live_server(
    engine: &EngineHandle,
    reports: &Finished,
    held: &GenerateRequest,
    partial: &TokenOutput,
) {
    let mut resumed = held.clone();
    resumed.id = request(3, 10, None).id;
    engine.generate(resumed.clone(), Some(0));
    let done = loop {
        let (c, replica) = finished(reports, resumed.id).await;
        if c.finish != FinishReason::Abort {
            break (c, replica);
        }
        // It reached the rebuilt replica 0 before that one found its server gone: resume again.
        reports.lock().retain(|(r, _)| r.id != resumed.id);
        let mut again = resumed.clone();
        again.resume = Some(c.output);
        engine.generate(again, None);
    };
    assert_eq!(done.1, 1);
    assert!(matches!(
        done.0.finish,
        FinishReason::Length | FinishReason::Stop
    ));
    assert_eq!(done.0.output.token_ids[..3], partial.token_ids[..]);
    assert!(
        done.0.output.versions[3..]
            .iter()
            .all(|v| *v == PolicyVersion(1))
    );
}

/// Replica 0 was rebuilt, on the newest weights the actor kept.
async fn check_replica_0_was_rebuilt_on_the_newest_weights(
    built_on: &Recorded<(u32, PolicyVersion)>,
) {
    built_on
        .until("replica 0 to be rebuilt", |b| {
            b.iter().filter(|b| b.0 == 0).count() >= 2
        })
        .await;
    let rebuilt: Vec<PolicyVersion> = built_on
        .lock()
        .iter()
        .filter(|b| b.0 == 0)
        .map(|b| b.1)
        .collect();
    assert_eq!(rebuilt[0], PolicyVersion(0));
    assert!(
        rebuilt[1..].iter().all(|v| *v == PolicyVersion(1)),
        "{rebuilt:?}"
    );
}

/// A URL on loopback where nothing listens (the port was bound and released).
fn closed_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_slot_skips_an_engine_node_it_cannot_reach_and_counts_no_failure() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let (live_url, stop_live, _served) = serve(&model).await;
    let registry = registry_with_a_dead_and_a_live_node(live_url);
    let factory = head_engine_factory(dir.path(), &model, Arc::clone(&registry));
    // One failure in a row is tolerated: a slot that claimed the dead node twice would stop
    // the run.
    let supervision = EngineSupervision {
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(50),
        max_restarts: 1,
        ..EngineSupervision::default()
    };
    let (engine, join, reports) = spawn_engine(1, factory, supervision).await;

    // A request is served (by `b-live`), resumed as the controller does after an abort.
    let mut next = request(1, 4, None);
    let done = loop {
        engine.generate(next.clone(), None);
        let (c, _) = finished(&reports, next.id).await;
        if c.finish != FinishReason::Abort {
            break c;
        }
        assert_eq!(engine.failure().await.unwrap(), None, "the engine gave up");
        reports.lock().retain(|(r, _)| r.id != next.id);
        next.resume = Some(c.output);
    };
    assert!(matches!(
        done.finish,
        FinishReason::Length | FinishReason::Stop
    ));
    check_the_unreachable_node_counts_no_failure(&engine, &registry).await;
    engine.stop().await;
    join.await.unwrap();
    let _ = stop_live.send(());
}

/// Two members: `a-dead` (first by name, so claimed first) advertises a port nothing listens
/// on; `b-live` answers. Neither is ever lost by its heartbeats (an hour).
fn registry_with_a_dead_and_a_live_node(live_url: String) -> Arc<Registry> {
    let registry = Arc::new(Registry::with_timings(
        Duration::from_millis(100),
        Duration::from_secs(3600),
        8,
    ));
    for (name, url) in [("a-dead", closed_url()), ("b-live", live_url)] {
        registry
            .join(JoinRequest {
                name: name.into(),
                role: sluice_config::NodeRole::Engine,
                url,
                tasks: Vec::new(),
            })
            .unwrap();
    }
    registry
}

/// The factory of a head with one remote replica, whose slot claims the members of `registry`.
fn head_engine_factory(
    dir: &std::path::Path,
    model: &std::path::Path,
    registry: Arc<Registry>,
) -> ReplicaFactory {
    let config = sluice_config::parse(
        "[model]\ninit_preset = \"tiny\"\n[engine]\nbackend = \"remote\"\nreplicas = 1\n[node]\nrole = \"head\"\n",
        "head.toml",
        &[],
        &|_| None,
    )
    .unwrap();
    // The nodes read the weights from this machine's disk (one process here).
    let dirs = WeightDirs::new(dir.join("weights"), Some(model.to_path_buf()), 2);
    let initial = Arc::new(
        sluice_model::load_checkpoint(model, &sluice_model::LoadOptions::default()).unwrap(),
    );
    head_factory(
        &config,
        HeadEngines {
            registry,
            served: Arc::clone(&dirs),
            on_disk: dirs,
            initial,
        },
    )
}

/// The replica is alive with no failure counted, one server lost; the registry says why:
/// `a-dead` is unreachable, `b-live` runs the replica.
async fn check_the_unreachable_node_counts_no_failure(engine: &EngineHandle, registry: &Registry) {
    assert_eq!(engine.failure().await.unwrap(), None);
    let health = serde_json::to_value(&engine.health().await.unwrap()[0]).unwrap();
    assert_eq!(health["alive"], true, "{health}");
    assert_eq!(health["failures"], serde_json::json!({}), "{health}");
    assert_eq!(health["failures_in_a_row"], 0, "{health}");
    assert_eq!(health["servers_lost"], 1, "{health}");
    // The registry says why: `a-dead` is unreachable, `b-live` runs the replica.
    let nodes = serde_json::to_value(registry.list()).unwrap();
    assert_eq!(nodes[0]["health"], "unreachable", "{nodes}");
    assert!(
        nodes[0]["unreachable"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("connect")),
        "{nodes}"
    );
    assert_eq!(nodes[0]["replica"], serde_json::Value::Null, "{nodes}");
    assert_eq!(
        (&nodes[1]["health"], &nodes[1]["replica"]),
        (&"live".into(), &0.into())
    );
}
