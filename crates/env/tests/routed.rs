//! Episodes on a changing set of env servers (`RoutedEnv`): a server killed mid-episode (its
//! runtime dropped, as a `kill -9` drops its sockets) and the episode goes on on another one,
//! replayed there; with no server left the call waits for one to join; a server that replays
//! differently fails the episode instead of mixing two histories. Real servers on 127.0.0.1:0.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_core::{DataSample, Message};
use sluice_env::remote::{
    EnvServer, EnvServers, OpenEnvs, RoutedEnvFactory, ServerConfig, ServerId, ServerStats,
    serve_with_stats,
};
use sluice_env::{
    BoxFuture, EnvError, EnvFactory, EnvInit, EnvStep, MessageEnv, RewardFn, Rubric, RubricConfig,
    Task, TaskRegistry,
};
use tokio::sync::watch;

/// Counts the assistant's turns; done after three. `tag` shows in its opening message, so two
/// servers with different tags replay an episode differently.
struct Count {
    tag: String,
    turns: u32,
}

impl MessageEnv for Count {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        let tag = self.tag.clone();
        Box::pin(async move {
            Ok(EnvInit {
                messages: vec![Message::user(format!("count ({tag})"))],
                tools: vec![],
            })
        })
    }
    fn step(&mut self, m: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        self.turns += 1;
        let n = self.turns;
        Box::pin(async move {
            let said = m.content.unwrap_or_default();
            let step = EnvStep::reply(vec![Message::user(format!("{n}: heard {said}"))]);
            Ok(if n >= 3 {
                EnvStep { done: true, ..step }
            } else {
                step
            })
        })
    }
}

/// A server in its own runtime: dropping the runtime drops its listener and connections.
struct Server {
    id: ServerId,
    url: String,
    stats: Arc<ServerStats>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Server {
    fn start(name: &str, incarnation: u64, tag: &str) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Bound here, served there (a runtime cannot be blocked on from inside the test's).
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let rubric = Rubric::new(
            vec![RewardFn::new("zero", 1.0, |_| 0.0)],
            RubricConfig::default(),
        )
        .unwrap();
        let tag = tag.to_owned();
        let count = move |_: &DataSample| -> Result<Box<dyn MessageEnv>, EnvError> {
            Ok(Box::new(Count {
                tag: tag.clone(),
                turns: 0,
            }))
        };
        let mut registry = TaskRegistry::new();
        registry
            .register(Task::new("count", count, rubric))
            .unwrap();
        let stats = Arc::new(ServerStats::default());
        let counted = Arc::clone(&stats);
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            serve_with_stats(
                listener,
                Arc::new(registry),
                ServerConfig::default(),
                counted,
                std::future::pending(),
            )
            .await
        });
        Self {
            id: ServerId {
                name: name.into(),
                incarnation,
            },
            url,
            stats,
            runtime: Some(runtime),
        }
    }

    fn kill(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The set: servers in order, each live or gone, and the change channel.
#[derive(Default)]
struct Set {
    servers: Mutex<Vec<(ServerId, String, OpenEnvs, bool)>>,
    changes: watch::Sender<u64>,
    gone_calls: Mutex<Vec<String>>,
}

impl Set {
    fn add(&self, s: &Server) {
        self.servers
            .lock()
            .unwrap()
            .push((s.id.clone(), s.url.clone(), OpenEnvs::default(), true));
        self.changes.send_modify(|n| *n += 1);
    }
}

impl EnvServers for Set {
    fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
    fn pick(&self, task: &str, avoid: &[ServerId]) -> Option<EnvServer> {
        assert_eq!(task, "count");
        let servers = self.servers.lock().unwrap();
        servers
            .iter()
            .filter(|(id, _, _, live)| *live && !avoid.contains(id))
            .min_by_key(|(_, _, open, _)| open.get())
            .map(|(id, url, open, _)| EnvServer::new(id.clone(), url.clone(), open))
    }
    fn gone(&self, server: &ServerId) {
        self.gone_calls.lock().unwrap().push(server.name.clone());
        for s in self.servers.lock().unwrap().iter_mut() {
            if s.0 == *server {
                s.3 = false;
            }
        }
    }
}

fn sample() -> DataSample {
    DataSample {
        id: "s0".into(),
        domain: "test".into(),
        dataset: "count".into(),
        input: serde_json::json!({}),
        system_prompt: None,
    }
}

fn factory(set: &Arc<Set>) -> RoutedEnvFactory {
    RoutedEnvFactory::new(
        Arc::clone(set) as Arc<dyn EnvServers>,
        "count",
        Duration::from_secs(5),
        None,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_episode_moves_off_a_killed_server_and_replays_its_turns() {
    let set = Arc::new(Set::default());
    let mut a = Server::start("a", 1, "same");
    let b = Server::start("b", 1, "same");
    set.add(&a);
    set.add(&b);
    let mut first = factory(&set).make_env(&sample()).unwrap();
    let mut second = factory(&set).make_env(&sample()).unwrap();
    first.init().await.unwrap();
    second.init().await.unwrap();
    // The least loaded first: one episode on each server.
    assert_eq!((a.stats.created(), b.stats.created()), (1, 1));
    let one = first.step(Message::assistant("one")).await.unwrap();
    assert_eq!(one.messages[0].content.as_deref(), Some("1: heard one"));
    second.step(Message::assistant("uno")).await.unwrap();

    // kill -9 of `a`: whichever episode was there moves to `b`, replays its turn, goes on.
    a.kill();
    let two = first.step(Message::assistant("two")).await.unwrap();
    assert_eq!(two.messages[0].content.as_deref(), Some("2: heard two"));
    let dos = second.step(Message::assistant("dos")).await.unwrap();
    assert_eq!(dos.messages[0].content.as_deref(), Some("2: heard dos"));
    let three = first.step(Message::assistant("three")).await.unwrap();
    assert!(three.done);
    assert_eq!(*set.gone_calls.lock().unwrap(), ["a"]);
    // `b` served both episodes' later turns: its own two, the moved one's replay and its rest.
    assert_eq!(b.stats.created(), 2);
    assert_eq!(b.stats.steps(), 2 + 1 + 2);
    first.close().await.unwrap();
    second.close().await.unwrap();
    assert_eq!(b.stats.open(), 0, "closed envs are deleted on the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_server_left_the_call_waits_for_one_to_join() {
    let set = Arc::new(Set::default());
    let mut a = Server::start("a", 1, "same");
    set.add(&a);
    let mut env = factory(&set).make_env(&sample()).unwrap();
    env.init().await.unwrap();
    env.step(Message::assistant("one")).await.unwrap();
    a.kill();
    let step = tokio::spawn(async move {
        let r = env.step(Message::assistant("two")).await;
        (env, r)
    });
    // The call waits (no server is live) until `a` comes back as a new incarnation.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!step.is_finished(), "no server to run on yet");
    let back = Server::start("a", 2, "same");
    set.add(&back);
    let (_env, r) = step.await.unwrap();
    assert_eq!(
        r.unwrap().messages[0].content.as_deref(),
        Some("2: heard two")
    );
    assert_eq!(back.stats.steps(), 2, "the replayed turn and the new one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_replays_differently_fails_the_episode() {
    let set = Arc::new(Set::default());
    let mut a = Server::start("a", 1, "one way");
    set.add(&a);
    let mut env = factory(&set).make_env(&sample()).unwrap();
    env.init().await.unwrap();
    env.step(Message::assistant("one")).await.unwrap();
    a.kill();
    let b = Server::start("b", 1, "another way");
    set.add(&b);
    let err = env.step(Message::assistant("two")).await.unwrap_err();
    assert_eq!(err.kind(), "env_failed", "{err}");
    assert!(err.to_string().contains("answered turn 0"), "{err}");
}
