//! [`RoutedEnv`]: an env on one of a changing set of env servers ([`EnvServers`]: a head's
//! joined env nodes, `docs/cluster.md`), picked per episode by the set, the least loaded first.
//!
//! When the episode's server is gone (a call is refused or reset: the process died; it answers
//! `unknown_env`: it restarted; it is full), the episode moves: the set is told (it stops
//! picking that server until the server shows it is alive), another server is picked, and the
//! episode is replayed there — `init`, then every assistant message stepped so far — before
//! the call that failed is made again. The turns already generated are kept, as a resumed
//! partial rollout keeps its tokens (`DESIGN.md` §4.2), and the rollout never sees the move.
//! Replaying needs an env that answers the same sample and messages the same way (the
//! built-in tasks do, as a resume after a restart already relies on); a server that answers a
//! replayed turn differently fails the rollout (`env_failed`) instead of training on an
//! episode that mixes two histories.
//!
//! With no live server for the task, the call waits for the set to change (a server joins or
//! comes back), within the call's deadline: the env call guard bounds the whole call
//! (`supervision.env_step_timeout_s`), so an episode whose servers stay gone fails alone, as a
//! timed-out env does (`DESIGN.md` §9), and the run goes on.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sluice_core::config::Secret;
use sluice_core::metrics::ENV_FAILOVER_ROLLOUTS;
use sluice_core::{DataSample, Message};
use tokio::sync::watch;

use super::client::RemoteEnv;
use super::http::CallError;
use crate::error::EnvError;
use crate::protocol::{BoxFuture, EnvInit, EnvStep, MessageEnv};
use crate::task::EnvFactory;

/// Moves one call may make before it gives up (each to a server the set offered as live).
const MAX_MOVES_PER_CALL: usize = 8;

/// A server as the set names it: a restarted server is a new incarnation, never mistaken for
/// the old one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerId {
    /// Its name in the set.
    pub name: String,
    /// Which life of it.
    pub incarnation: u64,
}

/// Envs of this process open on one server: the set's measure of its load. Cloning is
/// shallow (the set keeps one per server and hands clones to [`EnvServer::new`]).
#[derive(Debug, Clone, Default)]
pub struct OpenEnvs(Arc<AtomicUsize>);

impl OpenEnvs {
    /// Envs open now.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// A server picked for one env; while the env holds it, it counts in the server's
/// [`OpenEnvs`].
#[derive(Debug)]
pub struct EnvServer {
    /// Which server.
    pub id: ServerId,
    /// Its base URL (`http://host:port`).
    pub url: String,
    open: OpenEnvs,
}

impl EnvServer {
    /// `id` at `url`, counted as one more env open in `open`.
    pub fn new(id: ServerId, url: String, open: &OpenEnvs) -> Self {
        open.0.fetch_add(1, Ordering::Relaxed);
        Self {
            id,
            url,
            open: open.clone(),
        }
    }
}

impl Drop for EnvServer {
    fn drop(&mut self) {
        self.open.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A set of env servers that may change while envs run on it.
pub trait EnvServers: Send + Sync {
    /// Changes of the set (a server joined, came back, left or was lost). Subscribe before
    /// [`EnvServers::pick`], so that a change between the two is not missed.
    fn subscribe(&self) -> watch::Receiver<u64>;

    /// A live server serving `task`, not in `avoid`, the least loaded first; `None` when there
    /// is none.
    fn pick(&self, task: &str, avoid: &[ServerId]) -> Option<EnvServer>;

    /// A call found `server` gone: stop picking it until it shows it is alive again.
    fn gone(&self, server: &ServerId);
}

/// An env on a server of an [`EnvServers`] set (see the module docs).
pub struct RoutedEnv {
    servers: Arc<dyn EnvServers>,
    task: String,
    sample: DataSample,
    timeout: Duration,
    token: Option<Secret>,
    /// The server the episode runs on, and the env there.
    current: Option<(EnvServer, RemoteEnv)>,
    /// What `init` answered (a replay must answer the same).
    opened: Option<EnvInit>,
    /// Every assistant message stepped so far, with what the step answered.
    turns: Vec<(Message, EnvStep)>,
}

impl std::fmt::Debug for RoutedEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutedEnv")
            .field("task", &self.task)
            .field("server", &self.current.as_ref().map(|(s, _)| &s.id))
            .field("turns", &self.turns.len())
            .finish_non_exhaustive()
    }
}

impl RoutedEnv {
    /// The server the episode runs on now.
    pub fn server(&self) -> Option<&ServerId> {
        self.current.as_ref().map(|(s, _)| &s.id)
    }

    /// Opens the episode on a server of the set and replays its turns there, moving on while
    /// servers turn out gone and waiting for the set to change while it has none.
    async fn place(&mut self) -> Result<EnvInit, EnvError> {
        let mut avoid: Vec<ServerId> = Vec::new();
        let mut moves = 0;
        loop {
            let mut changes = self.servers.subscribe();
            let Some(server) = self.servers.pick(&self.task, &avoid) else {
                // Nothing to pick: wait for a server to join or come back. The env call guard
                // bounds the wait (see the module docs).
                if changes.changed().await.is_err() {
                    return Err(EnvError::Remote {
                        url: "env nodes".into(),
                        message: format!("no env server serves task `{}`", self.task),
                    });
                }
                avoid.clear();
                continue;
            };
            let mut env = RemoteEnv::new(
                &server.url,
                self.task.clone(),
                self.sample.clone(),
                self.timeout,
            )?
            .with_token(self.token.clone());
            match self.replay(&mut env).await {
                Ok(init) => {
                    self.current = Some((server, env));
                    return Ok(init);
                }
                Err(e) if e.server_gone && moves < MAX_MOVES_PER_CALL => {
                    moves += 1;
                    tracing::warn!(server = %server.id.name, error = %e.error, "env server gone while opening an episode; trying another");
                    self.servers.gone(&server.id);
                    avoid.push(server.id.clone());
                }
                Err(e) => return Err(e.error),
            }
        }
    }

    /// Opens `env` and steps it through the episode's turns so far; a different answer is a
    /// failure of the env, not of the server.
    async fn replay(&mut self, env: &mut RemoteEnv) -> Result<EnvInit, CallError> {
        let init = env.open().await?;
        if let Some(first) = &self.opened
            && *first != init
        {
            return Err(CallError::env(diverged(&self.task, 0)));
        }
        for (i, (message, answered)) in self.turns.iter().enumerate() {
            let again = env.step_call(message.clone()).await?;
            if again != *answered {
                return Err(CallError::env(diverged(&self.task, i + 1)));
            }
        }
        Ok(init)
    }

    /// The episode's server is gone: forget it, count the move.
    fn lose_server(&mut self, error: &EnvError) {
        if let Some((server, _)) = self.current.take() {
            tracing::warn!(server = %server.id.name, %error, turns = self.turns.len(), "env server gone; the episode moves to another");
            self.servers.gone(&server.id);
            metrics::counter!(ENV_FAILOVER_ROLLOUTS).increment(1);
        }
    }
}

fn diverged(task: &str, turn: usize) -> EnvError {
    EnvError::Failed(format!(
        "task `{task}`: another env server answered turn {turn} of the replayed episode differently; an episode moves between env servers only when its env answers the same sample and messages the same way"
    ))
}

impl MessageEnv for RoutedEnv {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        Box::pin(async move {
            if self.opened.is_some() {
                return Err(EnvError::Protocol("remote env initialised twice".into()));
            }
            let init = self.place().await?;
            self.opened = Some(init.clone());
            Ok(init)
        })
    }

    fn step(&mut self, assistant: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        Box::pin(async move {
            if self.opened.is_none() {
                return Err(EnvError::Protocol("remote env used before init".into()));
            }
            let mut moves = 0;
            loop {
                if self.current.is_none() {
                    self.place().await?;
                }
                let (_, env) = self.current.as_mut().expect("placed above");
                match env.step_call(assistant.clone()).await {
                    Ok(step) => {
                        self.turns.push((assistant, step.clone()));
                        return Ok(step);
                    }
                    Err(e) if e.server_gone && moves < MAX_MOVES_PER_CALL => {
                        moves += 1;
                        self.lose_server(&e.error);
                    }
                    Err(e) => return Err(e.error),
                }
            }
        })
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), EnvError>> {
        Box::pin(async move {
            let Some((_server, mut env)) = self.current.take() else {
                return Ok(());
            };
            match env.close_call().await {
                // A server that is gone holds nothing to release.
                Err(e) if e.server_gone => Ok(()),
                other => Ok(other?),
            }
        })
    }
}

/// Makes a [`RoutedEnv`] of one task per rollout.
#[derive(Clone)]
pub struct RoutedEnvFactory {
    servers: Arc<dyn EnvServers>,
    task: String,
    timeout: Duration,
    token: Option<Secret>,
}

impl std::fmt::Debug for RoutedEnvFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutedEnvFactory")
            .field("task", &self.task)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RoutedEnvFactory {
    /// Envs of `task` (the name the servers register it under) on `servers`, each call with
    /// `timeout`, carrying `token` as a bearer token when given.
    pub fn new(
        servers: Arc<dyn EnvServers>,
        task: impl Into<String>,
        timeout: Duration,
        token: Option<Secret>,
    ) -> Self {
        Self {
            servers,
            task: task.into(),
            timeout,
            token,
        }
    }
}

impl EnvFactory for RoutedEnvFactory {
    fn make_env(&self, sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
        Ok(Box::new(RoutedEnv {
            servers: Arc::clone(&self.servers),
            task: self.task.clone(),
            sample: sample.clone(),
            timeout: self.timeout,
            token: self.token.clone(),
            current: None,
            opened: None,
            turns: Vec::new(),
        }))
    }
}
