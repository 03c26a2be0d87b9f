//! The env worker pool and the task environment under load: a hanging env call holds one slot,
//! not a worker; the session cap follows `max_concurrent_rollouts` and η changed at runtime; and
//! `supervision.env_step_timeout_s` above 30 s is the deadline that counts (no inner default cuts
//! a step or a reward short). Time is paused where the env is slow: no real waiting.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sluice_actors::env_faults::TimeoutEnv;
use sluice_actors::env_worker::{
    BoxFuture, EnvPoolConfig, EnvPoolHandle, EnvReply, EnvResult, RolloutEnv, TurnNote,
};
use sluice_core::{
    DataSample, GroupId, KnobPatch, KnobsHandle, Message, NodeId, Rollout, RolloutId,
    RolloutStatus, RolloutTurn, RunId,
};
use sluice_env::protocol::{EnvInit, EnvStep as MessageStep, MessageEnv};
use sluice_env::{
    ByteRenderer, EnvError, EnvSessions, RewardFn, Rubric, RubricConfig, Task, TaskRegistry,
};
use sluice_node::native::TaskEnv;
use sluice_node::native::setup::env_limits;
use tokio::sync::mpsc;

fn config(text: &str) -> sluice_config::Config {
    sluice_config::parse(text, "test.toml", &[], &|_| None).unwrap()
}

fn knobs(config: &sluice_config::Config) -> KnobsHandle {
    KnobsHandle::new(
        config.rollout.knobs.clone(),
        config.rollout.groups_per_step.get(),
        Vec::new(),
    )
    .unwrap()
}

fn rollout_id(counter: u64) -> RolloutId {
    GroupId {
        run: RunId::from_name("env-pool"),
        node: NodeId(0),
        counter,
    }
    .rollout(0)
}

fn sample(dataset: &str) -> Arc<DataSample> {
    Arc::new(DataSample {
        id: "1".into(),
        domain: "math".into(),
        dataset: dataset.into(),
        input: serde_json::Value::Null,
        system_prompt: None,
    })
}

/// Results as they come out of the pool.
fn sink() -> (
    sluice_actors::Sink<EnvResult>,
    mpsc::UnboundedReceiver<EnvResult>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        Arc::new(move |r| {
            let _ = tx.send(r);
        }),
        rx,
    )
}

async fn recv(rx: &mut mpsc::UnboundedReceiver<EnvResult>) -> EnvResult {
    tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("an env result")
        .expect("the pool is alive")
}

/// Steps of rollouts whose counter is odd never answer; the others answer at once.
struct HalfStuck;

impl RolloutEnv for HalfStuck {
    sluice_env::no_env_state!(abandon, scores_groups, score_group, set_session_cap);

    fn start<'a>(&'a self, _: &'a DataSample, _: RolloutId) -> BoxFuture<'a, EnvReply> {
        Box::pin(async {
            EnvReply::Continue {
                next_prompt: vec![1],
            }
        })
    }

    fn step<'a>(
        &'a self,
        _: &'a DataSample,
        rollout: &'a Rollout,
        _: bool,
    ) -> BoxFuture<'a, (EnvReply, TurnNote)> {
        let stuck = rollout.id.group.counter % 2 == 1;
        Box::pin(async move {
            if stuck {
                std::future::pending::<()>().await;
            }
            (EnvReply::done(1.0), TurnNote::default())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_env_step_does_not_stall_other_rollouts() {
    // The default pool: two workers. Before, each ran one call at a time, so a hung step held
    // its worker and every job sent to it after.
    let config = config("");
    let pool_config = EnvPoolConfig::from_config(&config);
    assert_eq!(pool_config.workers, 2);
    let (out, mut rx) = sink();
    let (pool, joins) =
        EnvPoolHandle::spawn(pool_config, Arc::new(HalfStuck), out, &knobs(&config))
            .await
            .unwrap();
    let s = sample("toy");
    // Interleaved: hung steps on both workers, answering ones behind them.
    for counter in 1..=20 {
        pool.step(Arc::clone(&s), Rollout::new(rollout_id(counter)), false);
    }
    let mut answered = Vec::new();
    for _ in 0..10 {
        let r = recv(&mut rx).await;
        assert!(matches!(r.step, EnvReply::Done { .. }), "{r:?}");
        answered.push(r.rollout.group.counter);
    }
    answered.sort_unstable();
    assert_eq!(answered, (1..=10).map(|k| 2 * k).collect::<Vec<u64>>());
    // The ten hung calls are still in progress, each holding one slot.
    assert_eq!(pool.calls_in_progress(), 10);
    pool.stop().await;
    for j in joins {
        j.await.unwrap();
    }
}

fn task_env(config: &sluice_config::Config, registry: Arc<TaskRegistry>) -> TaskEnv {
    let sessions = EnvSessions::new(
        Arc::clone(&registry),
        Arc::new(ByteRenderer),
        env_limits(config, 4096),
        sluice_actors::env_worker::session_cap(
            &config.rollout.knobs,
            config.rollout.group_size.get(),
            config.rollout.groups_per_step.get(),
        ),
    );
    TaskEnv::new(registry, sessions, BTreeMap::new())
}

/// Starts rollouts `counters` of `sample` through the pool; the statuses of those that could not
/// start (`None` for those that did).
async fn start_all(
    pool: &EnvPoolHandle,
    rx: &mut mpsc::UnboundedReceiver<EnvResult>,
    sample: &Arc<DataSample>,
    counters: std::ops::Range<u64>,
) -> Vec<Option<RolloutStatus>> {
    let n = counters.end - counters.start;
    for c in counters {
        pool.start(Arc::clone(sample), rollout_id(c));
    }
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(match recv(rx).await.step {
            EnvReply::Continue { .. } => None,
            EnvReply::Done { status, .. } => Some(status),
            EnvReply::Failed { kind } => Some(RolloutStatus::Error(kind)),
            EnvReply::Scored(_) => panic!("no group was sent to score"),
        });
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raising_concurrency_knobs_at_runtime_opens_env_sessions() {
    // Admission allows (η + 1) · 1 · 2 = 2 rollouts; max_concurrent_rollouts 4: the cap is 8.
    let config = config(
        "[rollout]\ngroup_size = 2\ngroups_per_step = 1\nmax_version_lag = 0\nmax_concurrent_rollouts = 4",
    );
    let registry = Arc::new(TaskRegistry::builtin());
    let env = Arc::new(task_env(&config, Arc::clone(&registry)));
    let knobs = knobs(&config);
    let (out, mut rx) = sink();
    let (pool, _joins) = EnvPoolHandle::spawn(
        EnvPoolConfig::from_config(&config),
        env.clone(),
        out,
        &knobs,
    )
    .await
    .unwrap();
    assert_eq!(env.session_cap(), 8);
    let task = registry.get("arithmetic").unwrap();
    let s = Arc::new(task.eval_samples(0, 1).unwrap().remove(0));
    let full = Some(RolloutStatus::Error("env_sessions_full".into()));
    let first = start_all(&pool, &mut rx, &s, 0..8).await;
    assert!(first.iter().all(Option::is_none), "{first:?}");
    // At the cap: the next one is refused, as before.
    assert_eq!(
        start_all(&pool, &mut rx, &s, 8..9).await,
        vec![full.clone()]
    );

    // The operator raises max_concurrent_rollouts: the controller will admit 16 at once.
    knobs
        .update(&KnobPatch {
            max_concurrent_rollouts: Some(16),
            ..KnobPatch::default()
        })
        .unwrap();
    let more = start_all(&pool, &mut rx, &s, 100..124).await;
    assert!(
        more.iter().all(Option::is_none),
        "raising max_concurrent_rollouts left no room for sessions: {more:?}"
    );
    assert_eq!(env.session_cap(), 32);

    // And η: at η = 20 admission allows (20 + 1) · 1 · 2 = 42 rollouts → 84 sessions.
    knobs
        .update(&KnobPatch {
            max_version_lag: Some(20),
            ..KnobPatch::default()
        })
        .unwrap();
    let even_more = start_all(&pool, &mut rx, &s, 200..250).await;
    assert!(even_more.iter().all(Option::is_none), "{even_more:?}");
    assert_eq!(env.session_cap(), 84);
    pool.stop().await;
}

/// An episode whose step takes 45 s.
struct SlowEnv;

impl MessageEnv for SlowEnv {
    fn init(&mut self) -> sluice_env::BoxFuture<'_, Result<EnvInit, EnvError>> {
        Box::pin(async {
            Ok(EnvInit {
                messages: vec![Message::user("think slowly")],
                tools: Vec::new(),
            })
        })
    }

    fn step(&mut self, _: Message) -> sluice_env::BoxFuture<'_, Result<MessageStep, EnvError>> {
        Box::pin(async {
            tokio::time::sleep(Duration::from_secs(45)).await;
            Ok(MessageStep {
                done: true,
                ..MessageStep::default()
            })
        })
    }
}

fn slow_registry() -> Arc<TaskRegistry> {
    // Its reward takes 40 s too, and the rubric sets no deadline of its own (the default).
    let reward = RewardFn::new_async("slow", 1.0, |_| async {
        tokio::time::sleep(Duration::from_secs(40)).await;
        Ok(1.0)
    });
    let rubric = Rubric::new(vec![reward], RubricConfig::default()).unwrap();
    let factory = |_: &DataSample| Ok(Box::new(SlowEnv) as Box<dyn MessageEnv>);
    let mut registry = TaskRegistry::new();
    registry
        .register(Task::new("slow", factory, rubric))
        .unwrap();
    Arc::new(registry)
}

async fn slow_step(env_step_timeout_s: u32) -> EnvReply {
    let config = config(&format!(
        "[supervision]\nenv_step_timeout_s = {env_step_timeout_s}"
    ));
    let env = TimeoutEnv::new(
        Arc::new(task_env(&config, slow_registry())),
        config.supervision.env_step_timeout,
    );
    let s = sample("slow");
    let id = rollout_id(1);
    let EnvReply::Continue { next_prompt } = env.start(&s, id).await else {
        panic!("the slow env starts at once");
    };
    let mut rollout = Rollout::new(id);
    let mut turn = RolloutTurn::new(next_prompt);
    turn.completion_token_ids = ByteRenderer::encode("done<|im_end|>");
    rollout.turns.push(turn);
    env.step(&s, &rollout, false).await.0
}

#[tokio::test(start_paused = true)]
async fn an_env_step_timeout_above_30_s_is_the_one_that_counts() {
    // 45 s of stepping and 40 s of reward within a 120 s bound: the episode completes (before,
    // the env's own 30 s call deadline and the rubric's 30 s default ended it as Timeout).
    let t0 = tokio::time::Instant::now();
    match slow_step(120).await {
        EnvReply::Done { status, reward, .. } => {
            assert_eq!(status, RolloutStatus::Completed);
            assert_eq!(reward, 1.0);
        }
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() >= Duration::from_secs(85));
    // And the bound still holds: at 60 s the same step times out.
    match slow_step(60).await {
        EnvReply::Done { status, .. } => assert_eq!(status, RolloutStatus::Timeout),
        other => panic!("{other:?}"),
    }
}
