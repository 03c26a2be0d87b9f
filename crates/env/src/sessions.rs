//! [`EnvSessions`]: the token envs of every live rollout, keyed by rollout id, behind `&self`
//! methods so env workers can share one set (`Arc<EnvSessions>`). It is the seam between the
//! pipeline (which sees rollout ids, prompts and completion tokens) and the message-level world of
//! tasks: `start` dispatches the sample to its task and returns the first prompt, `step` feeds a
//! completion and returns the next prompt or the final status, and a session is closed and
//! forgotten as soon as its episode ends (or is abandoned). Open sessions are capped.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sluice_core::{DataSample, RolloutId, RolloutStatus};
use tokio::sync::Mutex;

use crate::error::EnvError;
use crate::renderer::{ParseError, Renderer};
use crate::task::TaskRegistry;
use crate::token_env::{Next, TokenEnv, TokenEnvLimits, TurnFinish, TurnOutcome};

type Session = Arc<Mutex<TokenEnv>>;

/// Live token envs by rollout id.
pub struct EnvSessions {
    registry: Arc<TaskRegistry>,
    renderer: Arc<dyn Renderer>,
    limits: TokenEnvLimits,
    /// Changeable while running: the node raises it when its concurrency knobs grow.
    max_sessions: AtomicUsize,
    sessions: std::sync::Mutex<HashMap<RolloutId, Session>>,
}

impl std::fmt::Debug for EnvSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvSessions")
            .field("open", &self.open())
            .field("max_sessions", &self.max_sessions())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl EnvSessions {
    /// Sessions over the tasks of `registry`, at most `max_sessions` open at once.
    pub fn new(
        registry: Arc<TaskRegistry>,
        renderer: Arc<dyn Renderer>,
        limits: TokenEnvLimits,
        max_sessions: usize,
    ) -> Self {
        Self {
            registry,
            renderer,
            limits,
            max_sessions: AtomicUsize::new(max_sessions.max(1)),
            sessions: std::sync::Mutex::new(HashMap::new()),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<RolloutId, Session>> {
        // Every critical section is one insert/remove/get: a poisoned map is still consistent.
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cap on open sessions.
    pub fn max_sessions(&self) -> usize {
        self.max_sessions.load(Ordering::Relaxed)
    }

    /// Sets the cap on open sessions (at least 1). Lowering it closes nothing: sessions already
    /// open run to their end, and new ones are refused until fewer than `n` are open.
    pub fn set_max_sessions(&self, n: usize) {
        self.max_sessions.store(n.max(1), Ordering::Relaxed);
    }

    /// Open sessions.
    pub fn open(&self) -> usize {
        self.map().len()
    }

    /// Whether rollout `id` has an open session.
    pub fn contains(&self, id: RolloutId) -> bool {
        self.map().contains_key(&id)
    }

    /// Starts rollout `id` of `sample` on the task named `task` and returns its first prompt, or
    /// `Done` with the status when it cannot start (unknown task → `Error("unknown_task")`, bad
    /// input, init failure, prompt too long, too many sessions → `Error("env_sessions_full")`).
    pub async fn start(&self, id: RolloutId, sample: &DataSample, task: &str) -> Next {
        let fail = |e: &EnvError| Next::Done(RolloutStatus::Error(e.kind().to_owned()));
        let task = match self.registry.get(task) {
            Ok(t) => t,
            Err(e) => return fail(&e),
        };
        let env = match task.token_env(sample, self.renderer.clone(), self.limits.clone()) {
            Ok(env) => env,
            Err(e) => return fail(&e),
        };
        let session = Arc::new(Mutex::new(env));
        {
            let mut map = self.map();
            if map.len() >= self.max_sessions() {
                return Next::Done(RolloutStatus::Error("env_sessions_full".into()));
            }
            if map.contains_key(&id) {
                return fail(&EnvError::Protocol(format!("rollout {id} already started")));
            }
            map.insert(id, session.clone());
        }
        let mut env = session.lock().await;
        let next = env.start().await;
        if matches!(next, Next::Done(_)) {
            env.close().await;
            self.map().remove(&id);
        }
        next
    }

    /// Feeds rollout `id`'s completion; when the episode ends the session is closed and removed.
    pub async fn step(&self, id: RolloutId, completion: &[u32], finish: TurnFinish) -> TurnOutcome {
        let Some(session) = self.map().get(&id).cloned() else {
            return TurnOutcome {
                assistant: sluice_core::Message::assistant(String::new()),
                parse_error: Some(ParseError {
                    raw_text: String::new(),
                    reason: format!("no open session for rollout {id}"),
                }),
                env_messages: Vec::new(),
                env_reward: None,
                situation: None,
                env_components: std::collections::BTreeMap::new(),
                next: Next::Done(RolloutStatus::Error("env_protocol".into())),
            };
        };
        let mut env = session.lock().await;
        let outcome = env.step(completion, finish).await;
        if matches!(outcome.next, Next::Done(_)) {
            env.close().await;
            self.map().remove(&id);
        }
        outcome
    }

    /// Closes and forgets rollout `id` (expired, dropped, or aborted without resume). Unknown ids
    /// are ignored.
    pub async fn abandon(&self, id: RolloutId) {
        let session = self.map().remove(&id);
        if let Some(session) = session {
            session.lock().await.close().await;
        }
    }
}
