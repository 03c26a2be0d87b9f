//! A start that fails at any stage leaves nothing running (issue 37): for a failure injected
//! after each of the three stages (`NodeOptions::fail_after`), and for a real one (the admin
//! port taken), the start returns the error only once every backend it was handed has been
//! released (so every actor holding one has stopped), the replay store's database is closed
//! (redb refuses a second open while it is), and the admin and metrics ports are free again.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sluice_actors::engine::BackendFactory;
use sluice_actors::replay::{ReplayHandle, ReplayOptions};
use sluice_actors::sampler::{SampleSource, SimSource};
use sluice_config::Config;
use sluice_core::{
    BackendError, DataSample, PolicyVersion, RolloutGroup, TrainStepOutput, TrainerBackend,
    WeightSnapshot,
};
use sluice_engine::simulated::SimEngineParams;
use sluice_engine::{InferenceBackend, SimEngine};
use sluice_env::SimTask;
use sluice_node::{Node, NodeOptions, Stage};

use crate::common;

/// A trainer that holds `_held` while it lives.
struct HeldTrainer {
    inner: common::RecordingTrainer,
    _held: Arc<()>,
}

impl TrainerBackend for HeldTrainer {
    fn version(&self) -> PolicyVersion {
        self.inner.version()
    }
    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError> {
        self.inner.train_step(batch)
    }
    fn snapshot(&self) -> WeightSnapshot {
        self.inner.snapshot()
    }
    fn checkpoint(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.inner.checkpoint(dir)
    }
    fn restore(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.inner.restore(dir)
    }
}

/// A sample source that holds `_held` while it lives.
struct HeldSource {
    inner: SimSource,
    _held: Arc<()>,
}

impl SampleSource for HeldSource {
    fn next_sample(&mut self, shares: &BTreeMap<String, f64>) -> Option<DataSample> {
        SampleSource::next_sample(&mut self.inner, shares)
    }
    fn record_completed(&mut self, domain: &str, rollouts: u64) {
        SampleSource::record_completed(&mut self.inner, domain, rollouts);
    }
    fn publish_metrics(&self, shares: &BTreeMap<String, f64>) {
        SampleSource::publish_metrics(&self.inner, shares);
    }
    fn domains(&self) -> Vec<String> {
        SampleSource::domains(&self.inner)
    }
    fn state(&self) -> Value {
        SampleSource::state(&self.inner)
    }
    fn restore(&mut self, state: Value) -> Result<(), String> {
        SampleSource::restore(&mut self.inner, state)
    }
}

/// What one start is handed, and the tokens that show whether it still holds any of it.
struct Handed {
    /// Held by the trainer backend, the sample source and the engine's replica factory.
    trainer: Arc<()>,
    source: Arc<()>,
    factory: Arc<()>,
    /// The env itself (its count is the holders').
    env: Arc<SimTask>,
}

impl Handed {
    fn new() -> Self {
        Self {
            trainer: Arc::new(()),
            source: Arc::new(()),
            factory: Arc::new(()),
            env: Arc::new(SimTask {
                prompt_tokens: 8,
                env_reply_tokens: 2,
                turns: 1,
                seed: 7,
            }),
        }
    }

    fn options(&self, config: &Config, dir: &Path, fail_after: Option<Stage>) -> NodeOptions {
        let held = Arc::clone(&self.factory);
        let sim = config.engine.simulated.clone();
        let cap = config.engine.max_running_sequences.get();
        let factory: BackendFactory = Arc::new(move |replica, version, sink| {
            let _ = &held;
            let params = SimEngineParams {
                replica,
                max_running_sequences: cap,
                sim: sim.clone(),
            };
            Box::new(SimEngine::start(params, version, sink)) as Box<dyn InferenceBackend>
        });
        NodeOptions {
            replay_dir: Some(dir.join("replay")),
            checkpoint_dir: Some(dir.join("checkpoint")),
            serve_admin: true,
            serve_metrics: true,
            backend: Some(factory.into()),
            trainer: Some(Box::new(HeldTrainer {
                inner: common::RecordingTrainer::new().0,
                _held: Arc::clone(&self.trainer),
            })),
            source: Some(Box::new(HeldSource {
                inner: SimSource::from_config(
                    &config.data,
                    config.simulated_domains(),
                    config.run.seed,
                ),
                _held: Arc::clone(&self.source),
            })),
            env: Some(Arc::clone(&self.env) as _),
            fail_after,
            ..NodeOptions::default()
        }
    }

    /// Who still holds what this start was handed (empty: nothing).
    fn still_held(&self) -> Vec<&'static str> {
        let mut held = Vec::new();
        for (name, count) in [
            ("trainer backend", Arc::strong_count(&self.trainer)),
            ("sample source", Arc::strong_count(&self.source)),
            ("replica factory", Arc::strong_count(&self.factory)),
            ("env", Arc::strong_count(&self.env)),
        ] {
            if count > 1 {
                held.push(name);
            }
        }
        held
    }
}

/// A port free now on loopback.
fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
}

fn config_on(admin: SocketAddr, metrics: SocketAddr) -> Config {
    let mut config = common::config("", "");
    config.admin.listen = admin;
    config.metrics.enabled = true;
    config.metrics.listen = metrics;
    config
}

/// Checks that nothing of a start is left running: every backend released, the replay store
/// closed, both ports free.
async fn nothing_left_running(what: &str, handed: &Handed, dir: &Path, ports: [SocketAddr; 2]) {
    // The backends are dropped with the actors' state and threads, which the guards wait for;
    // a moment's grace covers a dedicated thread that exits just after its actor.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !handed.still_held().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        handed.still_held().is_empty(),
        "{what}: still held after the start returned: {:?}",
        handed.still_held()
    );
    let options = ReplayOptions {
        dir: Some(dir.join("replay")),
        drop_expired: false,
        filter_zero_advantage: false,
        tail_batch_candidate_steps: 0,
    };
    let (replay, _, join) = ReplayHandle::spawn(options, Arc::new(|_| {}))
        .await
        .unwrap_or_else(|e| panic!("{what}: the replay store is still open: {e}"));
    replay.stop().await;
    join.await.unwrap();
    for port in ports {
        TcpListener::bind(port).unwrap_or_else(|e| panic!("{what}: {port} still bound: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_after_any_stage_leaves_nothing_running() {
    for stage in [Stage::Core, Stage::Feeds, Stage::Servers] {
        let dir = tempfile::tempdir().unwrap();
        let ports = [free_port(), free_port()];
        let config = config_on(ports[0], ports[1]);
        let handed = Handed::new();
        let options = handed.options(&config, dir.path(), Some(stage));
        let err = match Node::start(&config, options).await {
            Ok(_) => panic!("the start went on past the failure injected after {stage}"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(&format!("after the {stage} stage")),
            "{stage}: {err}"
        );
        nothing_left_running(
            &format!("failure after {stage}"),
            &handed,
            dir.path(),
            ports,
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_admin_port_fails_the_start_and_stops_every_actor() {
    let dir = tempfile::tempdir().unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics = free_port();
    let config = config_on(taken.local_addr().unwrap(), metrics);
    let handed = Handed::new();
    let err = match Node::start(&config, handed.options(&config, dir.path(), None)).await {
        Ok(_) => panic!("the start went on without its admin port"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("cannot listen on"), "{err}");
    drop(taken);
    let ports = [config.admin.listen, metrics];
    nothing_left_running("admin port taken", &handed, dir.path(), ports).await;

    // The same start with the port free runs, and its shutdown leaves nothing running either.
    let handed = Handed::new();
    let node = Node::start(&config, handed.options(&config, dir.path(), None))
        .await
        .expect("the start succeeds once the port is free");
    assert_eq!(node.admin_addr(), Some(config.admin.listen));
    assert_eq!(node.metrics_addr(), Some(metrics));
    common::wait_for_status(&node, "a first step", Duration::from_secs(30), |s| {
        s.trainer.steps >= 1
    })
    .await;
    node.shutdown().await;
    nothing_left_running("after shutdown", &handed, dir.path(), ports).await;
}
