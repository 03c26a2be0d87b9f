//! Errors of the env crate. Each variant has a short stable `kind()`, which becomes the payload of
//! `RolloutStatus::Error(kind)` and the `kind` label of `sluice_env_failures_total`.

use std::time::Duration;

/// Anything an environment, a reward function or the env plumbing can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EnvError {
    /// The data sample does not carry what the environment needs.
    #[error("bad env input: {0}")]
    BadInput(String),
    /// The environment failed for a reason of its own.
    #[error("env failed: {0}")]
    Failed(String),
    /// The environment panicked; the payload is the panic message.
    #[error("env panicked: {0}")]
    Panic(String),
    /// An env call did not return within its deadline.
    #[error("env call `{call}` timed out after {after:?}")]
    Timeout {
        /// `init`, `step`, `close` or a reward function's name.
        call: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// A remote env server could not be reached or answered with an error.
    #[error("remote env at {url}: {message}")]
    Remote {
        /// Server base URL.
        url: String,
        /// What went wrong (connection refused, HTTP status and body, …).
        message: String,
    },
    /// No task is registered under this name.
    #[error("unknown task `{name}`; registered tasks: {known}")]
    UnknownTask {
        /// The name asked for.
        name: String,
        /// The registered names, comma-separated.
        known: String,
    },
    /// A task, rubric or env was configured inconsistently.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Rendering messages to tokens failed.
    #[error("render failed: {0}")]
    Render(String),
    /// The inference backend failed while an episode was being driven (infrastructure, not a
    /// bad rollout: callers should fail fast, `DESIGN.md` §9).
    #[error("generation failed: {0}")]
    Generate(String),
    /// The env was used out of order (step before init, step after done).
    #[error("protocol misuse: {0}")]
    Protocol(String),
}

impl EnvError {
    /// Short stable name, used as `RolloutStatus::Error(kind)` and as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            EnvError::BadInput(_) => "env_bad_input",
            EnvError::Failed(_) => "env_failed",
            EnvError::Panic(_) => "env_panic",
            EnvError::Timeout { .. } => "env_timeout",
            EnvError::Remote { .. } => "env_remote",
            EnvError::UnknownTask { .. } => "unknown_task",
            EnvError::Config(_) => "env_config",
            EnvError::Render(_) => "render",
            EnvError::Generate(_) => "generate",
            EnvError::Protocol(_) => "env_protocol",
        }
    }
}
