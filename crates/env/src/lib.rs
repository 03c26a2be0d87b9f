//! Environments, rubrics and tasks of Sluice (`DESIGN.md` §1, §5; seeds 001 and 003).
//!
//! | module | what it holds |
//! |---|---|
//! | [`protocol`] | [`MessageEnv`]: `init` → opening messages + tools; `step(assistant message)` → replies, reward, done, situation |
//! | [`renderer`] | [`Renderer`]: messages ↔ token ids; [`ByteRenderer`] (dependency-free ChatML over bytes); completion parsing |
//! | [`token_env`] | [`TokenEnv`]: a `MessageEnv` at the token level, owning prompt-length, max-turn and timeout checks and the rollout status |
//! | [`rubric`] | [`Rubric`]: weighted reward functions, truncation/error overrides, concurrent group scoring |
//! | [`sandbox`] | untrusted programs in a child process: CPU/memory/process/wall limits, no network |
//! | [`sessions`] | [`EnvSessions`]: the token envs of live rollouts by rollout id — start, step, abandon — for env workers |
//! | [`configured`] | the run's tasks as its config sets them up: per-domain rubrics and env servers |
//! | [`reward_fns`] | reward functions every task offers a rubric from config: `env`, `env.<name>`, `length` (group), `math_answer`, `exact_match`, `regex`, `format`, `judge` |
//! | [`judge`] | the `judge` reward function: a model behind an OpenAI-compatible chat endpoint grades each reply |
//! | [`answer`] | final answers of free-form replies: `\boxed{}`, `####`, numbers, comparison |
//! | [`task`] | [`Task`] = datasets + env + rubric + system prompt; [`TaskRegistry`] |
//! | [`tasks`] | built-in tasks: `arithmetic`, `sum_digits`, `calculator_tool`, `stock_tool`, `episodic`, `word_problems`, `qa` (question/answer rows from files) |
//! | [`datasets`] | `[data] datasets` → rows: JSONL under `data_dir`, or a built-in task's generator |
//! | [`discount`] | episode-aware discounting of outcome rewards (seed 001) |
//! | [`overlong`] | DAPO's soft overlong punishment: replies in the last tokens of their budget lose reward |
//! | [`stats`] | running outcome EMA and balance fractions (seed 001) |
//! | [`episode`] | a minimal driver: one episode from a [`Generate`] implementation into a `Rollout` |
//! | [`eval`] | play a task on a fixed sample set and summarize: mean reward, accuracy, statuses |
//! | [`remote`] | the JSON-over-HTTP env protocol: server (axum) and client env |
//! | [`guard`] | panic/timeout containment for user code |
//! | [`error`] | [`EnvError`] and its stable `kind()` names |
//!
//! A panicking, failing or hanging env or reward function fails its rollout (`Error(kind)` or
//! `Timeout`), never the caller.

pub mod answer;
pub mod configured;
pub mod datasets;
pub mod discount;
pub mod episode;
pub mod error;
pub mod eval;
pub mod forward;
pub mod guard;
pub mod judge;
pub mod overlong;
pub mod protocol;
pub mod remote;
pub mod renderer;
pub mod reward_fns;
pub mod reward_model;
pub mod rollout_env;
pub mod rubric;
#[cfg(target_os = "linux")]
pub mod sandbox;
pub mod sessions;
pub mod simulated;
pub mod stats;
pub mod task;
pub mod tasks;
pub mod token_env;

pub use discount::EpisodeDiscount;
pub use episode::{Generate, Generated, run_episode};
pub use error::EnvError;
pub use eval::{EvalReport, SampledScores, evaluate};
pub use overlong::OverlongShaping;
pub use protocol::{BoxFuture, EnvInit, EnvStep, MessageEnv};
pub use renderer::{ByteRenderer, ParseError, Renderer};
pub use rollout_env::{EnvReply, RolloutEnv, TurnNote};
pub use rubric::{GroupMember, RewardFn, Rubric, RubricConfig, Score, ScoreInput};
pub use sessions::EnvSessions;
pub use simulated::SimTask;
pub use stats::OutcomeStats;
pub use task::{DataGenerator, EnvFactory, Task, TaskRegistry};
pub use token_env::{
    MAX_PROMPT_CHARS_PER_TOKEN, Next, TokenEnv, TokenEnvLimits, TurnFinish, TurnOutcome, TurnPrompt,
};
