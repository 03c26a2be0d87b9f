//! The message-level environment protocol (seed 003): an environment speaks chat messages, never
//! tokens. [`crate::TokenEnv`] wraps it and owns every message ↔ token concern.
//!
//! Lifecycle: `init` once → `step` once per assistant turn until a step says `done` → `close`
//! (always called, also after failures, so remote or sandboxed envs release resources).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use serde::{Deserialize, Serialize};
use sluice_core::{Message, ToolSpec};

use crate::error::EnvError;

/// A boxed, sendable future (what trait methods return, so envs can be `Box<dyn MessageEnv>`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Distinct named reward components one episode may report.
pub const MAX_ENV_COMPONENTS: usize = 16;

/// What an environment opens an episode with.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EnvInit {
    /// Opening messages (usually a user message with the problem). A system prompt given by the
    /// task or the sample is prepended by [`crate::TokenEnv`] unless these start with one.
    pub messages: Vec<Message>,
    /// Tools the model may call during the episode.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolSpec>,
}

/// The environment's answer to one assistant turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EnvStep {
    /// Reply messages (tool results, a new user message); appended to the history.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub messages: Vec<Message>,
    /// Reward for this turn, if the environment gives per-turn rewards. Kept on the turn
    /// (`RolloutTurn::env_reward`); the rubric decides whether it counts toward the final reward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<f64>,
    /// Named parts of this turn's reward (`passed`, `compiled`): summed over the episode, they
    /// become the rollout's `env.<name>` reward components, which a rubric may weight. Names are
    /// `[A-Za-z0-9_-]`, at most [`MAX_ENV_COMPONENTS`] per episode (they label metrics).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub components: BTreeMap<String, f64>,
    /// The episode is over.
    #[serde(default)]
    pub done: bool,
    /// Situation label of the turn just taken (for situational advantages, seed 002).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub situation: Option<String>,
}

impl EnvStep {
    /// The episode ends here, with no reply.
    pub fn done() -> Self {
        Self {
            done: true,
            ..Self::default()
        }
    }

    /// The episode continues with `messages`.
    pub fn reply(messages: Vec<Message>) -> Self {
        Self {
            messages,
            ..Self::default()
        }
    }

    /// Sets the situation label.
    pub fn with_situation(mut self, situation: impl Into<String>) -> Self {
        self.situation = Some(situation.into());
        self
    }

    /// Adds the named reward component `name` (see [`EnvStep::components`]).
    pub fn with_component(mut self, name: impl Into<String>, value: f64) -> Self {
        self.components.insert(name.into(), value);
        self
    }

    /// Sets the per-turn reward.
    pub fn with_reward(mut self, reward: f64) -> Self {
        self.reward = Some(reward);
        self
    }
}

/// A chat environment. Implementations are driven by one rollout at a time; they run on tokio
/// tasks, so they must be `Send + 'static`, and should never block (use `spawn_blocking` for
/// heavy work). A panic or a hang fails only the rollout.
///
/// ```
/// use sluice_core::Message;
/// use sluice_env::{BoxFuture, EnvError, EnvInit, EnvStep, MessageEnv};
///
/// struct Echo;
/// impl MessageEnv for Echo {
///     fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
///         Box::pin(async { Ok(EnvInit { messages: vec![Message::user("say hi")], tools: vec![] }) })
///     }
///     fn step(&mut self, _reply: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
///         Box::pin(async { Ok(EnvStep::done()) })
///     }
/// }
/// ```
pub trait MessageEnv: Send + 'static {
    /// Starts the episode.
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>>;

    /// Answers one parsed assistant message.
    fn step(&mut self, assistant: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>>;

    /// Releases resources; called once when the episode ends for any reason.
    fn close(&mut self) -> BoxFuture<'_, Result<(), EnvError>> {
        Box::pin(async { Ok(()) })
    }
}
