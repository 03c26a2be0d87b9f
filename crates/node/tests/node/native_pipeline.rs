//! The native pipeline end to end on the tiny preset: real engine replicas, the candle trainer,
//! task envs rendered with the checkpoint's chat template, dataset-backed samples. A few steps
//! of `arithmetic` must train, publish, score with the task's rubric and keep the lag bound.

use std::sync::Arc;
use std::time::Duration;

use sluice_actors::trainer::{MismatchStatus, STEP_FEED_CAPACITY, StepEvent};
use sluice_config::Config;
use sluice_core::{Message, RolloutStatus};
use sluice_engine::{NativeEngineParams, SamplingParams};
use sluice_env::Renderer;
use sluice_node::native::{Evaluator, ModelRenderer, NativeSetup, ensure_model_dir};
use sluice_node::{Node, NodeOptions};

/// A node built from `config` alone (the node builder loads the model, the datasets, the task
/// envs and the engine replicas the config names), with the trainer's step feed.
async fn start_node(config: &Config) -> (Node, tokio::sync::mpsc::Receiver<Arc<StepEvent>>) {
    let (feed, steps) = tokio::sync::mpsc::channel(STEP_FEED_CAPACITY);
    let options = NodeOptions {
        step_feed: Some(feed),
        ..NodeOptions::default()
    };
    (Node::start(config, options).await.unwrap(), steps)
}

/// Every step the feed holds.
fn drain(steps: &mut tokio::sync::mpsc::Receiver<Arc<StepEvent>>) -> Vec<Arc<StepEvent>> {
    std::iter::from_fn(|| steps.try_recv().ok()).collect()
}

fn config(dir: &std::path::Path, steps: u64) -> Config {
    let text = format!(
        r#"
[run]
name = "native-test"
output_dir = "{out}"
max_steps = {steps}

[model]
init_preset = "tiny"

[engine]
backend = "native"
replicas = 2
max_running_sequences = 32

[trainer]
loss = "decoupled_ppo"
learning_rate = 1e-3
micro_batch_size = 8
max_seq_len = 128

[rollout]
group_size = 4
groups_per_step = 2
max_new_tokens = 6
max_version_lag = 1
weight_update_mode = "in_flight"

[replay]
filter_zero_advantage = false

[data]
datasets = ["math::arithmetic@train"]
"#,
        out = dir.display()
    );
    sluice_config::parse(&text, "test.toml", &[], &|_| None).expect("valid config")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_pipeline_trains_scores_and_keeps_the_lag_bound() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 4);
    assert!(ensure_model_dir(&config).unwrap(), "the preset is created");
    assert!(!ensure_model_dir(&config).unwrap(), "and only once");
    let (node, mut steps) = start_node(&config).await;
    let status = node
        .wait_done(Duration::from_secs(60), |s| {
            if std::env::var_os("SLUICE_TEST_TRACE").is_some() {
                eprintln!(
                    "{:?} | {:?} | {:?}",
                    s.controller.admitted_total, s.controller.replay, s.trainer.steps
                );
            }
        })
        .await
        .unwrap();
    node.shutdown().await;
    assert_eq!(status.trainer.error, None);
    assert_eq!(status.trainer.steps, 4);
    assert_eq!(status.trainer.lag_violations, 0);
    assert!(status.controller.finished_rollouts >= 4 * 2 * 4);
    let steps = drain(&mut steps);
    assert_eq!(steps.len(), 4);
    for s in &steps {
        assert!(
            s.metrics
                .contains_key(sluice_core::metrics::TRAINER_LOSS_VALUE),
            "{:?}",
            s.metrics
        );
        assert!(s.trained_tokens > 0);
        assert!((0.0..=1.1).contains(&s.reward_mean), "{}", s.reward_mean);
    }
    assert_eq!(
        steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        [1, 2, 3, 4],
        "the feed numbers the run's steps"
    );
    let latest = steps[3].weights.as_ref().expect("published weights");
    assert_eq!(latest.version.0, 4, "every step published a version");
    check_mismatch_at_lag_zero(&steps, &status);
}

/// The engine replicas decode with the f32 weights the trainer published: on the tokens of the
/// weights a step starts from (lag 0; every token of step 1), the trainer's log-probs are the
/// engine's but for kernel rounding.
fn check_mismatch_at_lag_zero(steps: &[Arc<StepEvent>], status: &sluice_node::NodeStatus) {
    let compared: Vec<MismatchStatus> = steps
        .iter()
        .filter_map(|s| MismatchStatus::of(s.step, &s.metrics))
        .collect();
    assert_eq!(
        compared.first().map(|m| m.step),
        Some(1),
        "step 1 trains only version-0 tokens: {compared:?}"
    );
    assert!(compared[0].tokens > 0 && compared[0].tokens <= steps[0].trained_tokens);
    for m in &compared {
        eprintln!("lag-0 mismatch: {m:?}");
        assert!(
            m.logprob_abs_mean < 1e-3 && m.logprob_abs_max < 1e-2 && m.kl.abs() < 1e-5,
            "engine and trainer disagree on the same weights: {m:?}"
        );
    }
    assert_eq!(status.trainer.mismatch, compared.last().copied());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_renderer_round_trips_chat_and_the_evaluator_scores_every_sample() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 1);
    ensure_model_dir(&config).unwrap();
    let setup = NativeSetup::load(&config, None).unwrap();
    let renderer: &ModelRenderer = &setup.renderer;
    let prompt = renderer
        .render_prompt(&[Message::system("Be brief."), Message::user("2+2?")], &[])
        .unwrap();
    let text = setup.tokenizer.decode(&prompt, false).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let reply = renderer.encode_reply("4").unwrap();
    let parsed = renderer.parse_completion(&reply).unwrap();
    assert_eq!(parsed.content.as_deref(), Some("4"));
    let broken = setup
        .tokenizer
        .encode("<tool_call>{not json</tool_call>", false)
        .unwrap();
    let err = renderer.parse_completion(&broken).unwrap_err();
    assert!(err.raw_text.contains("{not json"), "{err:?}");

    let task = setup.registry.get("arithmetic").unwrap();
    let samples = task.eval_samples(0, 16).unwrap();
    assert!(
        samples.len() > 16,
        "the whole held-out split, not the 16 asked for"
    );
    let mut evaluator = Evaluator::new(
        Arc::clone(&task),
        samples.clone(),
        setup.renderer.clone(),
        setup.limits(&config),
        NativeEngineParams {
            max_running_sequences: 64,
            max_step_tokens: 4096,
            eos_token_ids: setup.tokenizer.eos_token_ids().to_vec(),
            ..NativeEngineParams::default()
        },
        Arc::clone(&setup.tokenizer),
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 4,
            seed: None,
            stop_token_ids: Vec::new(),
        },
    );
    let e = evaluator
        .evaluate(Arc::clone(&setup.weights))
        .await
        .unwrap();
    assert_eq!(e.rollouts.len(), samples.len());
    assert_eq!(e.report.episodes, samples.len());
    // A random model rarely answers: accuracy is defined and low, every episode ended.
    assert!(e.report.accuracy < 0.2);
    assert!(e.rollouts.iter().all(|r| matches!(
        r.status,
        RolloutStatus::Completed | RolloutStatus::Truncated
    )));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_env_renders_steps_and_scores_with_the_tasks_rubric() {
    use sluice_actors::env_worker::{EnvReply, RolloutEnv};
    use sluice_core::{GroupId, NodeId, RolloutTurn, RunId};

    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 1);
    ensure_model_dir(&config).unwrap();
    let setup = NativeSetup::load(&config, None).unwrap();
    let env = setup.env(&config);
    let task = setup.registry.get("arithmetic").unwrap();
    let sample = task.eval_samples(0, 1).unwrap().remove(0);
    let answer = task
        .reference_reply(&sample, 0)
        .expect("arithmetic has references");
    let group = GroupId {
        run: RunId::from_name("t"),
        node: NodeId(0),
        counter: 1,
    };
    for (i, reply, want) in [(0, answer.as_str(), 1.0), (1, "no idea", 0.0)] {
        let id = group.rollout(i);
        let prompt = match env.start(&sample, id).await {
            EnvReply::Continue { next_prompt } => next_prompt,
            other => panic!("start: {other:?}"),
        };
        let mut rollout = sluice_core::Rollout::new(id);
        let mut turn = RolloutTurn::new(prompt);
        turn.completion_token_ids = setup.renderer.encode_reply(reply).unwrap();
        rollout.turns.push(turn);
        let (step, note) = env.step(&sample, &rollout, false).await;
        match step {
            EnvReply::Done {
                reward,
                status,
                components,
            } => {
                assert_eq!(status, RolloutStatus::Completed, "{reply:?}");
                assert_eq!(components.get("correct").copied(), Some(want), "{reply:?}");
                assert!(reward >= want * 0.9, "{reply:?}: {reward}");
            }
            other => panic!("{reply:?}: {other:?}"),
        }
        assert_eq!(
            note.completion_message.and_then(|m| m.content).as_deref(),
            Some(reply)
        );
    }
}

/// `sluice serve`'s server in process on 127.0.0.1:0, serving `model` (its own weights) as
/// version 0. Dropped with the returned sender.
async fn serve(
    model: &std::path::Path,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    sluice_engine::NativeEngine,
) {
    use sluice_engine::server::{ServerOptions, ServerState, WeightEvents};
    let weights = Arc::new(
        sluice_model::load_checkpoint(model, &sluice_model::LoadOptions::default()).unwrap(),
    );
    let tokenizer = Arc::new(sluice_model::Tokenizer::from_dir(model).unwrap());
    let events = Arc::new(WeightEvents::default());
    let params = NativeEngineParams {
        max_running_sequences: 32,
        max_step_tokens: 1024,
        eos_token_ids: tokenizer.eos_token_ids().to_vec(),
        ..NativeEngineParams::default()
    };
    let engine = sluice_engine::NativeEngine::start(
        params,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_server_trains_on_the_runs_weights_from_step_one() {
    let dir = tempfile::tempdir().unwrap();
    // The server starts from a checkpoint of its own (another seed), as `sluice serve <dir>`.
    let served = dir.path().join("served");
    sluice_model::presets::write_preset(sluice_model::presets::Preset::Tiny, &served, 99).unwrap();
    let (url, stop, _engine) = serve(&served).await;
    let mut config = config(dir.path(), 3);
    config.engine.backend = sluice_config::EngineBackend::Remote;
    config.engine.replicas = std::num::NonZeroU32::new(1).unwrap();
    config.engine.remote_urls = vec![url];
    config.engine.remote_keep_versions = std::num::NonZeroU32::new(2).unwrap();
    ensure_model_dir(&config).unwrap();
    let (node, mut steps) = start_node(&config).await;
    let status = node
        .wait_done(Duration::from_secs(120), |_| {})
        .await
        .unwrap();
    node.shutdown().await;
    let _ = stop.send(());
    assert_eq!(status.trainer.error, None);
    assert_eq!(status.trainer.steps, 3);
    // Step 1 trained on tokens the server generated with the head's version-0 weights: the
    // trainer's log-probs (decoupled_ppo's proximal policy, the same weights) match the
    // behaviour log-probs the server reported. On the server's own weights they would not.
    let steps = drain(&mut steps);
    let first = &steps[0].metrics;
    let is_max = first[sluice_core::metrics::TRAINER_IMPORTANCE_WEIGHT_MAX_RATIO];
    let is_mean = first[sluice_core::metrics::TRAINER_IMPORTANCE_WEIGHT_MEAN_RATIO];
    assert!(
        (0.95..1.05).contains(&is_mean) && is_max < 1.05,
        "step 1 importance weights: mean {is_mean}, max {is_max}"
    );
    // Only the newest two published versions stay on disk.
    let mut kept: Vec<String> = std::fs::read_dir(config.run.output_dir.join("weights"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(kept, vec!["v000002", "v000003"]);
}
