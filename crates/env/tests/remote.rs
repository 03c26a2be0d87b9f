//! The remote env protocol end to end: a real server on 127.0.0.1:0, the client env driven through
//! TokenEnv and the rubric, failures on the server side, and a server that dies mid-episode.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Scripted, play, renderer, rollout, sample};
use sluice_core::{DataSample, Message, RolloutStatus};
use sluice_env::remote::{RemoteEnvFactory, ServerConfig, serve};
use sluice_env::{
    BoxFuture, EnvError, EnvInit, EnvStep, MessageEnv, Next, RewardFn, Rubric, RubricConfig, Task,
    TaskRegistry, TokenEnvLimits, run_episode,
};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// An env that misbehaves on purpose: `panic` panics in step, `hang` never answers, `reward`
/// ends the episode with the sample's `reward` and `component` (a lying reward source).
struct Bad {
    mode: String,
    input: serde_json::Value,
}

impl MessageEnv for Bad {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        Box::pin(async {
            Ok(EnvInit {
                messages: vec![Message::user("go")],
                tools: vec![],
            })
        })
    }
    fn step(&mut self, _m: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        let mode = self.mode.clone();
        let input = self.input.clone();
        Box::pin(async move {
            match mode.as_str() {
                "panic" => panic!("remote env exploded"),
                "reward" => {
                    let mut step = EnvStep::done();
                    step.reward = input["reward"].as_f64();
                    if let Some(c) = input["component"].as_f64() {
                        step.components.insert("passed".into(), c);
                    }
                    Ok(step)
                }
                _ => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok(EnvStep::done())
                }
            }
        })
    }
}

fn server_registry() -> TaskRegistry {
    let mut r = TaskRegistry::builtin();
    let rubric = Rubric::new(
        vec![RewardFn::new("zero", 1.0, |_| 0.0)],
        RubricConfig::default(),
    )
    .unwrap();
    let bad = |s: &DataSample| -> Result<Box<dyn MessageEnv>, EnvError> {
        Ok(Box::new(Bad {
            mode: s.input["mode"].as_str().unwrap_or("panic").to_owned(),
            input: s.input.clone(),
        }))
    };
    r.register(Task::new("bad", bad, rubric)).unwrap();
    r
}

struct Server {
    url: String,
    stop: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<std::io::Result<()>>>,
}

impl Server {
    async fn start() -> Self {
        Self::start_with(ServerConfig {
            max_envs: 4,
            call_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(600),
            token: None,
            http: Default::default(),
        })
        .await
    }

    async fn start_with(config: ServerConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel();
        let handle = tokio::spawn(serve(
            listener,
            Arc::new(server_registry()),
            config,
            async {
                let _ = rx.await;
            },
        ));
        Self {
            url,
            stop: Some(tx),
            handle: Some(handle),
        }
    }

    async fn kill(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.handle.take() {
            h.await.unwrap().unwrap();
        }
    }

    fn remote(&self, task: &str, timeout: Duration) -> RemoteEnvFactory {
        RemoteEnvFactory::new(&self.url, task, timeout).unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtin_tasks_run_remotely() {
    let mut server = Server::start().await;
    let local = TaskRegistry::builtin();
    let arith = local
        .get("arithmetic")
        .unwrap()
        .as_ref()
        .clone()
        .with_env(server.remote("arithmetic", Duration::from_secs(5)));
    let s = sample(sluice_env::tasks::arithmetic::problem_input(6, '*', 7));
    let r = play(&arith, &s, &["42"]).await;
    assert_eq!(r.status, RolloutStatus::Completed);
    assert_eq!(r.reward_components["correct"], 1.0);
    assert_eq!(r.turns[0].situation.as_deref(), Some("answer"));

    let calc = local
        .get("calculator_tool")
        .unwrap()
        .as_ref()
        .clone()
        .with_env(server.remote("calculator_tool", Duration::from_secs(5)));
    let s = sample(serde_json::json!({"expression": "(3 + 4) * 5", "answer": 35}));
    let call =
        r#"<tool_call>{"name": "calc", "arguments": {"expression": "(3 + 4) * 5"}}</tool_call>"#;
    let r = play(&calc, &s, &[call, "[ANSWER] 35"]).await;
    assert_eq!(r.status, RolloutStatus::Completed);
    assert_eq!(r.turns[0].env_messages[0].content.as_deref(), Some("35"));
    assert_eq!(r.reward_components["correct"], 1.0);

    // Every env was closed on the server.
    let health = http_get(&server.url, "/v1/health").await;
    assert!(health.contains("\"envs\":0"), "{health}");
    let tasks = http_get(&server.url, "/v1/tasks").await;
    assert!(tasks.contains("\"calculator_tool\""), "{tasks}");
    server.kill().await;
}

async fn http_get(url: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authority = url.strip_prefix("http://").unwrap();
    let mut s = tokio::net::TcpStream::connect(authority).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

async fn run_remote(
    server: &Server,
    task: &str,
    input: serde_json::Value,
    timeout: Duration,
) -> sluice_core::Rollout {
    let factory = server.remote(task, timeout);
    let mut env = sluice_env::TokenEnv::new(
        sluice_env::EnvFactory::make_env(&factory, &sample(input)).unwrap(),
        renderer(),
        TokenEnvLimits {
            call_timeout: Duration::from_secs(10),
            ..TokenEnvLimits::default()
        },
        None,
    );
    let mut r = rollout(0);
    run_episode(&mut env, &mut Scripted::new(&["x", "y"]), &mut r)
        .await
        .unwrap();
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_side_failures_fail_the_rollout_not_the_server() {
    let mut server = Server::start().await;
    let t = Duration::from_secs(5);
    let r = run_remote(&server, "bad", serde_json::json!({"mode": "panic"}), t).await;
    assert_eq!(r.status, RolloutStatus::Error("env_panic".into()));
    let r = run_remote(
        &server,
        "bad",
        serde_json::json!({"mode": "hang"}),
        Duration::from_millis(300),
    )
    .await;
    assert_eq!(r.status, RolloutStatus::Timeout, "client deadline");
    let r = run_remote(&server, "nope", serde_json::json!({}), t).await;
    assert_eq!(r.status, RolloutStatus::Error("env_remote".into()));
    let r = run_remote(&server, "arithmetic", serde_json::json!({"oops": 1}), t).await;
    assert_eq!(r.status, RolloutStatus::Error("env_bad_input".into()));
    // The server still serves.
    let ok = run_remote(
        &server,
        "arithmetic",
        sluice_env::tasks::arithmetic::problem_input(1, '+', 1),
        t,
    )
    .await;
    assert_eq!(ok.status, RolloutStatus::Completed);
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_fails_its_rollouts_and_callers_continue() {
    let mut server = Server::start().await;
    let factory = server.remote("episodic", Duration::from_secs(2));
    let input = serde_json::json!({"start": 0, "target": 2, "max_steps": 4});
    let mut env = sluice_env::TokenEnv::new(
        sluice_env::EnvFactory::make_env(&factory, &sample(input.clone())).unwrap(),
        renderer(),
        TokenEnvLimits::default(),
        None,
    );
    assert!(
        matches!(env.start().await, Next::Generate(_)),
        "alive: init works"
    );
    server.kill().await;
    let out = env
        .step(
            &sluice_env::ByteRenderer::encode("<|action_start|>inc()<|action_end|>"),
            sluice_env::TurnFinish::Stop,
        )
        .await;
    assert_eq!(
        out.next,
        Next::Done(RolloutStatus::Error("env_remote".into()))
    );
    env.close().await; // must not hang or panic against a dead server

    // A fresh episode against the dead server fails at init, also with Error.
    let r = run_remote(&server, "episodic", input.clone(), Duration::from_secs(2)).await;
    assert_eq!(r.status, RolloutStatus::Error("env_remote".into()));
    assert!(r.turns.is_empty());

    // Another server: work continues.
    let mut second = Server::start().await;
    let short = serde_json::json!({"start": 0, "target": 2, "max_steps": 2});
    let r = run_remote(&second, "episodic", short, Duration::from_secs(2)).await;
    assert_eq!(r.status, RolloutStatus::Completed);
    let situations: Vec<_> = r
        .turns
        .iter()
        .map(|t| t.situation.clone().unwrap())
        .collect();
    assert_eq!(situations, ["invalid", "out_of_steps"]);
    second.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_envs_are_capped_and_idle_ones_dropped() {
    let mut server = Server::start_with(ServerConfig {
        max_envs: 2,
        call_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_millis(300),
        token: None,
        http: Default::default(),
    })
    .await;
    let factory = server.remote("arithmetic", Duration::from_secs(5));
    let input = sluice_env::tasks::arithmetic::problem_input(2, '+', 2);
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut env = sluice_env::EnvFactory::make_env(&factory, &sample(input.clone())).unwrap();
        env.init().await.unwrap();
        open.push(env); // never closed: a client that died
    }
    let mut third = sluice_env::EnvFactory::make_env(&factory, &sample(input.clone())).unwrap();
    let err = third.init().await.unwrap_err();
    assert_eq!(err.kind(), "env_remote");
    assert!(
        err.to_string().contains("server_full") || err.to_string().contains("503"),
        "{err}"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut fourth = sluice_env::EnvFactory::make_env(&factory, &sample(input)).unwrap();
    fourth.init().await.unwrap();
    let health = http_get(&server.url, "/v1/health").await;
    assert!(
        health.contains("\"envs\":1"),
        "idle envs were dropped: {health}"
    );
    fourth.close().await.unwrap();
    server.kill().await;
}

/// A remote env's reward that is not finite or beyond ±`MAX_ENV_REWARD` (the hostile sweep's
/// finding 7: `1e308` overflowed the group advantages and stopped the run, `1e39` was trained)
/// fails that rollout as `env_remote`, its message naming the server and the value; rewards
/// within the bound are trained as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewards_beyond_the_bound_fail_the_rollout_naming_the_server() {
    use serde_json::json;
    use sluice_env::remote::MAX_ENV_REWARD;
    let mut server = Server::start().await;
    let t = Duration::from_secs(5);
    for (input, shown) in [
        (json!({"reward": 1e308}), "reward = 1e308"),
        (json!({"reward": -1e308}), "reward = -1e308"),
        (json!({"reward": 1e39}), "reward = 1e39"),
        (json!({"reward": 1.5e6}), "reward = 1.5e6"),
        (
            json!({"reward": 1.0, "component": -1e300}),
            "components.passed = -1e300",
        ),
    ] {
        let mut input = input;
        input["mode"] = json!("reward");
        let factory = server.remote("bad", t);
        let mut env = sluice_env::EnvFactory::make_env(&factory, &sample(input.clone())).unwrap();
        env.init().await.unwrap();
        let err = env.step(Message::assistant("x")).await.unwrap_err();
        assert_eq!(err.kind(), "env_remote", "{input}: {err}");
        let message = err.to_string();
        assert!(
            message.contains(&server.url) && message.contains(shown),
            "{input}: {message}"
        );
        env.close().await.unwrap();
        let r = run_remote(&server, "bad", input.clone(), t).await;
        assert_eq!(
            r.status,
            RolloutStatus::Error("env_remote".into()),
            "{input}"
        );
    }
    for reward in [MAX_ENV_REWARD, -MAX_ENV_REWARD, 0.25] {
        let input = json!({"mode": "reward", "reward": reward, "component": 1.0});
        let factory = server.remote("bad", t);
        let mut env = sluice_env::EnvFactory::make_env(&factory, &sample(input)).unwrap();
        env.init().await.unwrap();
        let step = env.step(Message::assistant("x")).await.unwrap();
        assert_eq!(step.reward, Some(reward));
        env.close().await.unwrap();
    }
    server.kill().await;
}
