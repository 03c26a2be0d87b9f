//! [`TokenEnv`]: a [`MessageEnv`] seen through a [`Renderer`]. It keeps the message history,
//! renders each prompt to token ids, parses completions back into assistant messages, and owns the
//! limits that end an episode early — prompt too long, too many turns, an env call that panics,
//! fails or exceeds its deadline — setting the [`RolloutStatus`] accordingly:
//!
//! | what happened | status |
//! |---|---|
//! | the env said `done` | `Completed` |
//! | the completion hit `max_tokens` (finish reason `Length`) | `Truncated` (env not stepped) |
//! | `max_turns` assistant turns without `done` | `Truncated` |
//! | the next prompt exceeds `max_prompt_tokens` (or, before rendering, 32 characters per allowed token) | `PromptTooLong` |
//! | an env call exceeded `call_timeout` | `Timeout` |
//! | an env call panicked or failed; rendering failed | `Error(kind)` |
//! | the env replied with an assistant message (only the policy writes those) | `Error("env_protocol")` |
//!
//! With `max_history_turns = N`, a prompt is rendered from the opening messages (the system
//! prompt and what `init` returned) and the last N turns (each an assistant message and the env's
//! reply), not the whole history: long episodes stay within `max_prompt_tokens` instead of
//! ending `PromptTooLong`. [`TokenEnv::history`] still holds everything.
//!
//! A completion whose structure does not parse (bad tool-call JSON) is *not* an error: the env
//! receives the raw text as a plain assistant message and decides (that is a training signal).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sluice_core::metrics::ENV_STEP_SECONDS;
use sluice_core::{Message, Role, RolloutStatus, RolloutTurn, ToolSpec};
use tokio::sync::Mutex;

use crate::error::EnvError;
use crate::guard::run_guarded;
use crate::protocol::{EnvInit, EnvStep, MAX_ENV_COMPONENTS, MessageEnv};
use crate::renderer::{ParseError, Renderer};
use crate::rubric::ENV_COMPONENT_PREFIX;

/// Characters a prompt may hold per allowed token before it is `PromptTooLong` without being
/// rendered: tokens of real text average 3–5 characters, so no prompt that fits in tokens is
/// cut, while one dataset row of 100 MB is refused before the template copies it and the
/// tokenizer expands it into memory many times its size.
pub const MAX_PROMPT_CHARS_PER_TOKEN: usize = 32;

/// Characters of what a prompt is rendered from (message texts, tool-call arguments, tool
/// specs); each text is counted at most to `limit + 1`, so a huge one costs no more than that.
fn prompt_chars(history: &[Message], tools: &[ToolSpec], limit: usize) -> usize {
    let mut total = 0usize;
    let mut add = |s: &str| {
        total = total.saturating_add(s.chars().take(limit.saturating_add(1)).count());
    };
    for m in history {
        add(m.content.as_deref().unwrap_or_default());
        add(m.reasoning_content.as_deref().unwrap_or_default());
        for call in &m.tool_calls {
            add(&call.function.name);
            add(&call.function.arguments);
        }
    }
    for tool in tools {
        add(&serde_json::to_string(tool).unwrap_or_default());
    }
    total
}

/// Limits one episode runs under.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenEnvLimits {
    /// Longest prompt (in tokens) that may be sent to the engine.
    pub max_prompt_tokens: usize,
    /// Assistant turns before the episode is cut (`Truncated`).
    pub max_turns: u32,
    /// Deadline of each env call (`init`, `step`, `close`).
    #[serde(with = "seconds")]
    pub call_timeout: Duration,
    /// Turns a prompt keeps after the opening messages (`None`: all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_history_turns: Option<u32>,
}

mod seconds {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}

impl Default for TokenEnvLimits {
    fn default() -> Self {
        Self {
            max_prompt_tokens: 4096,
            max_turns: 8,
            call_timeout: Duration::from_secs(30),
            max_history_turns: None,
        }
    }
}

/// The prompt of the next assistant turn.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnPrompt {
    /// Rendered prompt, ending with the generation prompt.
    pub prompt_token_ids: Vec<u32>,
    /// The history it was rendered from.
    pub prompt_messages: Vec<Message>,
}

/// What comes after `start` or a `step`.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Generate the next assistant turn from this prompt.
    Generate(TurnPrompt),
    /// The episode is over with this (terminal) status.
    Done(RolloutStatus),
}

/// Why the engine stopped generating a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnFinish {
    /// A stop token or stop sequence: the turn is complete.
    Stop,
    /// `max_tokens` or the context ran out: the turn is cut.
    Length,
}

/// The result of one assistant turn.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnOutcome {
    /// The parsed completion (the raw text as content when it did not parse).
    pub assistant: Message,
    /// Set when the completion's structure did not parse.
    pub parse_error: Option<ParseError>,
    /// The env's reply messages.
    pub env_messages: Vec<Message>,
    /// The env's reward for this turn.
    pub env_reward: Option<f64>,
    /// The env's situation label for this turn.
    pub situation: Option<String>,
    /// The env's named reward components so far, summed over the episode, as `env.<name>`.
    pub env_components: BTreeMap<String, f64>,
    /// What to do next.
    pub next: Next,
}

impl TurnOutcome {
    /// Copies the message-level results into the turn that produced the completion.
    pub fn apply_to(&self, turn: &mut RolloutTurn) {
        turn.completion_message = Some(self.assistant.clone());
        turn.env_messages = self.env_messages.clone();
        turn.env_reward = self.env_reward;
        turn.situation = self.situation.clone();
    }
}

/// A message environment driven at the token level. One per rollout.
pub struct TokenEnv {
    env: Arc<Mutex<Box<dyn MessageEnv>>>,
    renderer: Arc<dyn Renderer>,
    limits: TokenEnvLimits,
    system_prompt: Option<String>,
    history: Vec<Message>,
    /// Messages of `history` that open the episode (system prompt and `init`'s): always rendered.
    opening: usize,
    /// Where each turn starts in `history` (its assistant message).
    turn_starts: Vec<usize>,
    tools: Vec<ToolSpec>,
    turns: u32,
    parse_errors: u32,
    /// The env's named reward components, summed over the turns so far (`env.<name>`).
    env_components: BTreeMap<String, f64>,
    status: RolloutStatus,
    started: bool,
    closed: bool,
    /// `domain` label of `sluice_env_step_seconds`; no timing is recorded without one.
    metrics_domain: Option<String>,
}

impl std::fmt::Debug for TokenEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenEnv")
            .field("limits", &self.limits)
            .field("turns", &self.turns)
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

/// The messages an episode opens with: the env's opening `messages`, after `system_prompt`
/// (the row's, the domain's or the task's) unless it is empty or the env opens with a system
/// message of its own (anywhere among them: a second system block would contradict it).
pub fn opening_messages(system_prompt: Option<&str>, messages: Vec<Message>) -> Vec<Message> {
    let has_system = messages.iter().any(|m| m.role == Role::System);
    let prompt = system_prompt.filter(|p| !p.is_empty() && !has_system);
    prompt
        .map(Message::system)
        .into_iter()
        .chain(messages)
        .collect()
}

impl TokenEnv {
    /// Wraps `env`. `system_prompt` is prepended to the opening messages unless they already
    /// start with a system message or it is empty (an empty per-domain prompt removes the
    /// task's).
    pub fn new(
        env: Box<dyn MessageEnv>,
        renderer: Arc<dyn Renderer>,
        limits: TokenEnvLimits,
        system_prompt: Option<String>,
    ) -> Self {
        Self {
            env: Arc::new(Mutex::new(env)),
            renderer,
            limits,
            system_prompt,
            history: Vec::new(),
            opening: 0,
            turn_starts: Vec::new(),
            tools: Vec::new(),
            turns: 0,
            parse_errors: 0,
            env_components: BTreeMap::new(),
            status: RolloutStatus::Ongoing,
            started: false,
            closed: false,
            metrics_domain: None,
        }
    }

    /// Records the duration of every `init` and `step` in `sluice_env_step_seconds{domain}`.
    pub fn with_metrics_domain(mut self, domain: impl Into<String>) -> Self {
        self.metrics_domain = Some(domain.into());
        self
    }

    fn observe(&self, started: std::time::Instant) {
        if let Some(domain) = &self.metrics_domain {
            metrics::histogram!(ENV_STEP_SECONDS, "domain" => domain.clone())
                .record(started.elapsed().as_secs_f64());
        }
    }

    /// The status so far (`Ongoing` until the episode ends).
    pub fn status(&self) -> &RolloutStatus {
        &self.status
    }

    /// The full message history.
    pub fn history(&self) -> &[Message] {
        &self.history
    }

    /// The tools the env declared.
    pub fn tools(&self) -> &[ToolSpec] {
        &self.tools
    }

    /// Assistant turns taken.
    pub fn turns(&self) -> u32 {
        self.turns
    }

    /// Completions whose structure did not parse.
    pub fn parse_errors(&self) -> u32 {
        self.parse_errors
    }

    fn finish(&mut self, status: RolloutStatus) -> Next {
        self.status = status.clone();
        Next::Done(status)
    }

    fn fail(&mut self, err: &EnvError) -> Next {
        tracing::debug!(error = %err, "episode failed");
        self.finish(match err {
            EnvError::Timeout { .. } => RolloutStatus::Timeout,
            other => RolloutStatus::Error(other.kind().to_owned()),
        })
    }

    /// Renders the history as the next prompt, unless it is too long: first in characters
    /// ([`MAX_PROMPT_CHARS_PER_TOKEN`] per allowed token, before anything is rendered or
    /// tokenized), then in tokens.
    fn next_prompt(&mut self) -> Next {
        let max_chars = self
            .limits
            .max_prompt_tokens
            .saturating_mul(MAX_PROMPT_CHARS_PER_TOKEN);
        let messages = self.prompt_messages();
        if prompt_chars(&messages, &self.tools, max_chars) > max_chars {
            return self.finish(RolloutStatus::PromptTooLong);
        }
        match self.renderer.render_prompt(&messages, &self.tools) {
            Ok(ids) if ids.len() > self.limits.max_prompt_tokens => {
                self.finish(RolloutStatus::PromptTooLong)
            }
            Ok(prompt_token_ids) => Next::Generate(TurnPrompt {
                prompt_token_ids,
                prompt_messages: messages,
            }),
            Err(e) => self.fail(&e),
        }
    }

    /// What the next prompt is rendered from: the whole history, or with `max_history_turns`,
    /// the opening messages and the last turns.
    fn prompt_messages(&self) -> Vec<Message> {
        let keep = self
            .limits
            .max_history_turns
            .map_or(usize::MAX, |n| n as usize);
        let dropped = self.turn_starts.len().saturating_sub(keep);
        match self.turn_starts.get(dropped) {
            Some(&from) if dropped > 0 => {
                let mut messages = self.history[..self.opening].to_vec();
                messages.extend_from_slice(&self.history[from..]);
                messages
            }
            _ => self.history.clone(),
        }
    }

    /// Calls `init` and returns the first prompt.
    pub async fn start(&mut self) -> Next {
        if self.started {
            return self.fail(&EnvError::Protocol("start called twice".into()));
        }
        self.started = true;
        let env = self.env.clone();
        let t0 = std::time::Instant::now();
        let init = run_guarded("init", self.limits.call_timeout, async move {
            env.lock().await.init().await
        })
        .await;
        self.observe(t0);
        let EnvInit { messages, tools } = match init {
            Ok(init) => init,
            Err(e) => return self.fail(&e),
        };
        self.history
            .extend(opening_messages(self.system_prompt.as_deref(), messages));
        self.opening = self.history.len();
        self.tools = tools;
        self.next_prompt()
    }

    /// Feeds one completion (token ids as generated, stop tokens included or not) and returns
    /// what the env made of it.
    pub async fn step(&mut self, completion: &[u32], finish: TurnFinish) -> TurnOutcome {
        let (assistant, parse_error) = match self.renderer.parse_completion(completion) {
            Ok(m) => (m, None),
            Err(e) => {
                self.parse_errors += 1;
                (Message::assistant(e.raw_text.clone()), Some(e))
            }
        };
        let mut outcome = TurnOutcome {
            assistant: assistant.clone(),
            parse_error,
            env_messages: Vec::new(),
            env_reward: None,
            situation: None,
            env_components: self.env_components.clone(),
            next: Next::Done(self.status.clone()),
        };
        if !self.started || self.status.is_terminal() {
            outcome.next = self.fail(&EnvError::Protocol(
                "step called before start or after the episode ended".into(),
            ));
            return outcome;
        }
        self.turns += 1;
        self.turn_starts.push(self.history.len());
        self.history.push(assistant.clone());
        if finish == TurnFinish::Length {
            outcome.next = self.finish(RolloutStatus::Truncated);
            return outcome;
        }
        let env = self.env.clone();
        let t0 = std::time::Instant::now();
        let step = run_guarded("step", self.limits.call_timeout, async move {
            env.lock().await.step(assistant).await
        })
        .await;
        self.observe(t0);
        let EnvStep {
            messages,
            reward,
            components,
            done,
            situation,
        } = match step {
            Ok(s) => s,
            Err(e) => {
                outcome.next = self.fail(&e);
                return outcome;
            }
        };
        if let Some(at) = messages.iter().position(|m| m.role == Role::Assistant) {
            outcome.next = self.fail(&EnvError::Protocol(format!(
                "the env's reply holds an assistant message (message {at} of {}): only the \
                 policy writes assistant turns; an env replies as user, tool or system",
                messages.len()
            )));
            return outcome;
        }
        if let Err(e) = self.add_components(components) {
            outcome.next = self.fail(&e);
            return outcome;
        }
        outcome.env_components = self.env_components.clone();
        self.history.extend(messages.iter().cloned());
        outcome.env_messages = messages;
        outcome.env_reward = reward;
        outcome.situation = situation;
        outcome.next = if done {
            self.finish(RolloutStatus::Completed)
        } else if self.turns >= self.limits.max_turns {
            self.finish(RolloutStatus::Truncated)
        } else {
            self.next_prompt()
        };
        outcome
    }

    /// Adds one turn's named components to the episode's sums. Names and values come from the
    /// env (maybe a remote server) and become metric labels: a name outside `[A-Za-z0-9_-]{1,64}`,
    /// a non-finite value or more than [`MAX_ENV_COMPONENTS`] names fail the episode.
    fn add_components(&mut self, components: BTreeMap<String, f64>) -> Result<(), EnvError> {
        for (name, value) in components {
            let valid = !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
            if !valid || !value.is_finite() {
                return Err(EnvError::Protocol(format!(
                    "reward component `{name}` = {value}: names are [A-Za-z0-9_-]{{1,64}}, values finite"
                )));
            }
            let key = format!("{ENV_COMPONENT_PREFIX}{name}");
            if !self.env_components.contains_key(&key)
                && self.env_components.len() >= MAX_ENV_COMPONENTS
            {
                return Err(EnvError::Protocol(format!(
                    "more than {MAX_ENV_COMPONENTS} reward components in one episode"
                )));
            }
            *self.env_components.entry(key).or_insert(0.0) += value;
        }
        Ok(())
    }

    /// Calls the env's `close` (once; errors are logged, never raised: the episode's status is
    /// already decided).
    pub async fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let env = self.env.clone();
        if let Err(e) = run_guarded("close", self.limits.call_timeout, async move {
            env.lock().await.close().await
        })
        .await
        {
            tracing::warn!(error = %e, "env close failed");
        }
    }
}
