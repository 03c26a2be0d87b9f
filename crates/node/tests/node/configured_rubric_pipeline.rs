//! Config that shapes how a native node renders and scores rollouts. A rubric from config
//! through the whole node (tiny model, real engine and trainer): the groups the trainer trains on
//! carry the configured functions' components — `length` among them, which only group scoring at
//! settle time can compute — and nothing else of the task's default rubric. Chat-template kwargs
//! reach the rendered prompts; `rollout.max_prompt_tokens` bounds the episodes' prompts.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_core::{
    BackendError, PolicyVersion, RolloutGroup, TrainStepOutput, TrainerBackend, WeightSnapshot,
};
use sluice_data::{DatasetRows, MixSampler, SamplerConfig};
use sluice_env::datasets::{GeneratedRows, load_datasets};
use sluice_node::native::setup::env_limits;
use sluice_node::native::{NativeSetup, ensure_model_dir};
use sluice_node::{Node, NodeOptions};

/// Records the component names of every trainable rollout it trains on.
struct Recording {
    inner: Box<dyn TrainerBackend>,
    seen: Arc<Mutex<Vec<BTreeSet<String>>>>,
}

impl TrainerBackend for Recording {
    fn version(&self) -> PolicyVersion {
        self.inner.version()
    }

    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError> {
        let mut seen = self.seen.lock().unwrap();
        for r in batch
            .iter()
            .flat_map(|g| &g.rollouts)
            .filter(|r| r.status.is_trainable())
        {
            seen.push(r.reward_components.keys().cloned().collect());
        }
        drop(seen);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trainer_sees_the_configured_rubrics_components() {
    let dir = tempfile::tempdir().unwrap();
    let config = rubric_config(dir.path());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let node = start_recording_node(&config, Arc::clone(&seen)).await;
    let status = node
        .wait_done(Duration::from_secs(120), |_| {})
        .await
        .unwrap();
    let base = format!(
        "http://{}",
        node.metrics_addr().expect("metrics are served")
    );
    let (code, metrics) = tokio::task::spawn_blocking(move || {
        sluice_node::client::request(&base, "GET", "/metrics", None, None).unwrap()
    })
    .await
    .unwrap();
    node.shutdown().await;
    assert_eq!(code, 200);
    check_components_on_metrics(&metrics);
    assert_eq!(status.trainer.error, None);
    assert_eq!(status.trainer.steps, 2);
    check_trained_components(&seen.lock().unwrap());
}

/// Two steps of a tiny native run on the arithmetic dataset, whose math rubric is configured:
/// `correct` and `length` weighted, an error reward, metrics served.
fn rubric_config(dir: &Path) -> sluice_config::Config {
    let text = format!(
        r#"
[run]
name = "rubric-test"
output_dir = "{out}"
max_steps = 2

[model]
init_preset = "tiny"

[engine]
backend = "native"
max_running_sequences = 32

[trainer]
learning_rate = 1e-3
micro_batch_size = 8
max_seq_len = 128

[rollout]
group_size = 4
groups_per_step = 2
max_new_tokens = 6

[replay]
filter_zero_advantage = false

[metrics]
listen = "127.0.0.1:0"

[data]
datasets = ["math::arithmetic@train"]

[data.domains.math.rubric]
weights = {{ correct = 1.0, length = 0.5 }}
error_reward = -1.0
"#,
        out = dir.display()
    );
    sluice_config::parse(&text, "test.toml", &[], &|_| None).unwrap()
}

/// Starts a native node from `config` whose trainer records, into `seen`, the component names
/// of every trainable rollout it trains on.
async fn start_recording_node(
    config: &sluice_config::Config,
    seen: Arc<Mutex<Vec<BTreeSet<String>>>>,
) -> Node {
    ensure_model_dir(config).unwrap();
    let setup = NativeSetup::load(config, None).unwrap();
    let datasets = load_datasets(&config.data, &setup.registry, GeneratedRows::new(0)).unwrap();
    let source = MixSampler::with_rows(
        SamplerConfig::from_data_config(&config.data, 0),
        DatasetRows::new(datasets, 0),
    )
    .unwrap();
    let trainer = Recording {
        inner: setup.trainer_backend(config, None).unwrap(),
        seen,
    };
    let options = NodeOptions {
        backend: Some(setup.backend_factory(config, None).unwrap()),
        trainer: Some(Box::new(trainer)),
        source: Some(Box::new(source)),
        env: Some(Arc::new(setup.env(config))),
        serve_metrics: true,
        ..NodeOptions::default()
    };
    Node::start(config, options).await.unwrap()
}

/// `/metrics` shows the mean reward of each configured component for the math domain.
fn check_components_on_metrics(metrics: &str) {
    let components: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("sluice_rollout_reward_component_mean_reward{"))
        .collect();
    for component in ["correct", "length"] {
        assert!(
            components
                .iter()
                .any(|l| l.contains(&format!("component=\"{component}\""))
                    && l.contains("domain=\"math\"")),
            "{component} missing from /metrics: {components:?}"
        );
    }
}

/// Every rollout of the two steps was recorded, and each carries exactly the configured
/// functions' components.
fn check_trained_components(seen: &[BTreeSet<String>]) {
    assert!(seen.len() >= 2 * 2 * 4, "{} rollouts trained", seen.len());
    // Completed and truncated rollouts alike (no truncation_reward: the functions score partial
    // output) carry exactly the configured functions.
    for components in seen.iter() {
        let names: Vec<&str> = components.iter().map(String::as_str).collect();
        assert_eq!(names, ["correct", "length"], "{names:?}");
    }
}

fn tiny_config(dir: &Path, extra: &str) -> sluice_config::Config {
    let text = format!(
        "[run]\noutput_dir = \"{}\"\n[model]\ninit_preset = \"tiny\"\n{extra}",
        dir.display()
    );
    sluice_config::parse(&text, "test.toml", &[], &|_| None).unwrap()
}

#[test]
fn chat_template_kwargs_reach_the_rendered_prompt() {
    use sluice_env::Renderer;
    let dir = tempfile::tempdir().unwrap();
    let plain = tiny_config(dir.path(), "");
    ensure_model_dir(&plain).unwrap();
    // A template that reads `enable_thinking`, as Qwen3's does.
    let path = plain.model.path.join("tokenizer_config.json");
    let mut tokenizer_config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tokenizer_config["chat_template"] = serde_json::Value::String(
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}\
         {% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
            .into(),
    );
    std::fs::write(&path, tokenizer_config.to_string()).unwrap();
    let render = |config: &sluice_config::Config| {
        let setup = NativeSetup::load(config, None).unwrap();
        let ids = setup
            .renderer
            .render_prompt(&[sluice_core::Message::user("2+2?")], &[])
            .unwrap();
        setup.tokenizer.decode(&ids, false).unwrap()
    };
    assert_eq!(render(&plain), "2+2?\n");
    let off = tiny_config(
        dir.path(),
        "chat_template_kwargs = { enable_thinking = false }\n",
    );
    assert_eq!(render(&off), "2+2?\n/no_think");
}

#[test]
fn max_prompt_tokens_bounds_episode_prompts_within_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let derived = tiny_config(dir.path(), "[rollout]\nmax_new_tokens = 100\n");
    assert_eq!(env_limits(&derived, 1024).max_prompt_tokens, 924);
    let set = tiny_config(
        dir.path(),
        "[rollout]\nmax_new_tokens = 100\nmax_prompt_tokens = 300\n",
    );
    assert_eq!(env_limits(&set, 1024).max_prompt_tokens, 300);
    // Never past what the context leaves for the completion.
    assert_eq!(env_limits(&set, 350).max_prompt_tokens, 250);
}
