//! Rubrics and env servers from config, through the env worker pool as a node runs them: a
//! domain's `[data.domains.<d>.rubric]` weights the task's functions and a group function
//! (`length`), the settled group is scored as a whole with its components; a domain's `env_url`
//! runs its episodes on an env server, where a fork bomb fails its rollout with the configured
//! `error_reward` and the next answer is scored.

#![cfg(target_os = "linux")]

use std::sync::Arc;
use std::time::Duration;

use sluice_actors::env_worker::{EnvPoolConfig, EnvPoolHandle, EnvReply, EnvResult, RolloutEnv};
use sluice_core::{
    DataSample, GroupId, KnobsHandle, NodeId, PolicyVersion, Rollout, RolloutGroup, RolloutStatus,
    RolloutTurn, RunId,
};
use sluice_env::remote::{ServerConfig, serve};
use sluice_env::{ByteRenderer, EnvSessions, TaskRegistry};
use sluice_node::native::TaskEnv;
use sluice_node::native::setup::env_limits;
use tokio::sync::mpsc;

fn config(text: &str) -> sluice_config::Config {
    sluice_config::parse(text, "test.toml", &[], &|_| None).unwrap()
}

/// The pool over the config's tasks, as the native setup builds it.
async fn pool(
    config: &sluice_config::Config,
) -> (EnvPoolHandle, mpsc::UnboundedReceiver<EnvResult>) {
    let registry = Arc::new(
        sluice_env::configured::registry(&config.data, config.supervision.env_step_timeout, None)
            .unwrap(),
    );
    let sessions = EnvSessions::new(
        Arc::clone(&registry),
        Arc::new(ByteRenderer),
        env_limits(config, 4096),
        64,
    );
    let domain_tasks = registry.domain_tasks().clone();
    let env: Arc<dyn RolloutEnv> = Arc::new(TaskEnv::new(registry, sessions, domain_tasks));
    let knobs = KnobsHandle::new(config.rollout.knobs.clone(), 1, Vec::new()).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let out: sluice_actors::Sink<EnvResult> = Arc::new(move |r| {
        let _ = tx.send(r);
    });
    let (pool, _joins) = EnvPoolHandle::spawn(EnvPoolConfig::from_config(config), env, out, &knobs)
        .await
        .unwrap();
    (pool, rx)
}

async fn recv(rx: &mut mpsc::UnboundedReceiver<EnvResult>) -> EnvResult {
    tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("an env result")
        .expect("the pool is alive")
}

/// Plays one single-turn rollout `index` of `group` answering `reply`; returns it finished.
async fn play(
    pool: &EnvPoolHandle,
    rx: &mut mpsc::UnboundedReceiver<EnvResult>,
    sample: &Arc<DataSample>,
    group: GroupId,
    index: u32,
    reply: &str,
) -> Rollout {
    let mut r = Rollout::new(group.rollout(index));
    pool.start(Arc::clone(sample), r.id);
    let EnvReply::Continue { next_prompt } = recv(rx).await.step else {
        panic!("the episode should start");
    };
    let mut turn = RolloutTurn::new(next_prompt);
    turn.completion_token_ids = ByteRenderer::encode(&format!("{reply}{}", ByteRenderer::END));
    r.turns.push(turn);
    pool.step(Arc::clone(sample), r.clone(), false);
    let result = recv(rx).await;
    // What the controller records of the turn: the parsed reply the rubric reads.
    let note = result.note.expect("a step notes its turn");
    r.turns[0].completion_message = note.completion_message;
    match result.step {
        EnvReply::Done {
            reward,
            status,
            components,
        } => {
            r.reward = reward;
            r.status = status;
            r.reward_components = components;
        }
        other => panic!("expected the episode to end, got {other:?}"),
    }
    r
}

fn group_id(counter: u64) -> GroupId {
    GroupId {
        run: RunId::from_name("configured"),
        node: NodeId(0),
        counter,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_rubric_scores_the_whole_group_with_its_components() {
    let config = config(
        r#"
        [data]
        datasets = ["math::arithmetic@train"]
        [data.domains.math.rubric]
        weights = { correct = 1.0, length = 0.5 }
        error_reward = -1.0
        "#,
    );
    let (pool, mut rx) = pool(&config).await;
    assert!(
        pool.scores_groups(),
        "a group function needs the whole group"
    );
    let sample = Arc::new(DataSample {
        id: "p".into(),
        domain: "math".into(),
        dataset: "arithmetic@train".into(),
        input: sluice_env::tasks::arithmetic::problem_input(3, '+', 4),
        system_prompt: None,
    });
    let gid = group_id(1);
    let mut group = RolloutGroup::new(gid, (*sample).clone(), 3, PolicyVersion(0));
    for (i, reply) in ["7", "  7   ", "8"].iter().enumerate() {
        group.rollouts[i] = play(&pool, &mut rx, &sample, gid, i as u32, reply).await;
        assert_eq!(group.rollouts[i].status, RolloutStatus::Completed);
    }
    pool.score_group(Arc::clone(&sample), group);
    let EnvReply::Scored(scored) = recv(&mut rx).await.step else {
        panic!("expected the scored group");
    };
    let r = &scored.rollouts;
    for rollout in r {
        assert!(
            rollout.reward_components.contains_key("correct"),
            "{rollout:?}"
        );
        assert!(
            rollout.reward_components.contains_key("length"),
            "{rollout:?}"
        );
    }
    // Lengths 2, 7, 2 tokens (answer + end marker). Best-scored: the two correct answers.
    assert_eq!(r[0].reward_components["length"], 0.5);
    assert_eq!(r[1].reward_components["length"], -0.5);
    assert_eq!(
        r[2].reward_components["length"], 0.0,
        "wrong answers keep min(0, λ)"
    );
    // Weights normalized: correct 2/3, length 1/3.
    assert!(
        (r[0].reward - (2.0 / 3.0 + 0.5 / 3.0)).abs() < 1e-12,
        "{}",
        r[0].reward
    );
    assert!(
        (r[1].reward - (2.0 / 3.0 - 0.5 / 3.0)).abs() < 1e-12,
        "{}",
        r[1].reward
    );
    assert!(r[2].reward.abs() < 1e-12, "{}", r[2].reward);
    pool.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_domain_on_an_env_server_fails_a_fork_bomb_and_scores_the_next_answer() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        listener,
        Arc::new(TaskRegistry::builtin()),
        ServerConfig::default(),
        async {
            let _ = stopped.await;
        },
    ));
    let config = config(&format!(
        r#"
        [data]
        datasets = ["code::python_code@train"]
        [data.domains.code]
        env_url = "{url}"
        [data.domains.code.rubric]
        weights = {{ correct = 1.0 }}
        error_reward = -1.0
        "#
    ));
    let (pool, mut rx) = pool(&config).await;
    let sample = Arc::new(DataSample {
        id: "c".into(),
        domain: "code".into(),
        dataset: "python_code@train".into(),
        input: serde_json::json!({"problem": "Print 6 times 7.", "expected_output": "42"}),
        system_prompt: None,
    });
    let bomb = play(
        &pool,
        &mut rx,
        &sample,
        group_id(2),
        0,
        "import os\nwhile True:\n    os.fork()\n",
    )
    .await;
    assert_eq!(bomb.status, RolloutStatus::Error("env_failed".into()));
    assert_eq!(bomb.reward, -1.0);
    let ok = play(&pool, &mut rx, &sample, group_id(2), 1, "print(6 * 7)").await;
    assert_eq!(ok.status, RolloutStatus::Completed, "{ok:?}");
    assert_eq!(ok.reward, 1.0);
    assert_eq!(ok.reward_components["env.passed"], 1.0);
    pool.stop().await;
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

/// Each domain's discount reaches the trainer's advantages: the `episodic` task's own γ, a
/// domain's `gamma` key over it, and `trainer.gamma` for the rest.
#[test]
fn each_domains_discount_reaches_the_trainers_advantages() {
    let c = config(
        r#"
        [trainer]
        gamma = 0.95
        [data]
        datasets = ["walk::episodic", "maze::episodic", "math::arithmetic"]
        [data.domains.maze]
        gamma = 0.5
        "#,
    );
    let advantage = sluice_node::native::setup::native_trainer_config(&c).advantage;
    assert_eq!(
        advantage.gamma_for("walk"),
        0.9,
        "the episodic task's own γ"
    );
    assert_eq!(advantage.gamma_for("maze"), 0.5, "the domain's key");
    assert_eq!(advantage.gamma_for("math"), 0.95, "trainer.gamma");
    assert!(!advantage.domain_gamma.contains_key("math"));
}
