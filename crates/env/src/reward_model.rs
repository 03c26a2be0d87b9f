//! The `reward_model` reward function: a reward model (a Hugging Face sequence classifier with
//! one label, as OpenRLHF and TRL train them) scores each rollout's conversation, as verl's
//! `reward_model.enable` does. The rubric's `[reward_model]` table
//! ([`sluice_data::config::RewardModelConfig`]) names the model; this crate does not load
//! models, so whoever builds the registry passes a [`RewardModelLoader`] (the `sluice` binary's
//! loads the model once per directory and device, in process).
//!
//! - the conversation is the last turn's prompt messages (system prompt, question, earlier
//!   turns and the env's replies) followed by the final reply, which the scorer renders with the
//!   reward model's own chat template;
//! - the score is the model's raw output, or its logistic `1 / (1 + e^−s)` with `sigmoid = true`;
//! - a rollout without a reply, a conversation longer than `max_tokens` or a failed forward fails
//!   the rollout's scoring with the reason (the rubric's `error_reward` applies;
//!   `sluice_env_failures_total` counts it). `sluice_env_reward_model_seconds` times each score.

use std::sync::Arc;
use std::time::Instant;

use sluice_core::Message;
use sluice_core::metrics::ENV_REWARD_MODEL_SECONDS;
use sluice_data::config::{REWARD_MODEL_FN, RewardModelConfig};

use crate::rubric::{RewardFn, ScoreInput};

/// A model that scores conversations. Called on the blocking pool: it may take long.
pub trait ConversationScorer: Send + Sync {
    /// The score of `messages`, whose last message is the reply scored, or why there is none.
    fn score(&self, messages: &[Message]) -> Result<f64, String>;
}

/// Makes the scorer of a rubric's `reward_model` table, or says why it cannot (the error is
/// reported under the table's key).
pub type RewardModelLoader =
    dyn Fn(&RewardModelConfig) -> Result<Arc<dyn ConversationScorer>, String> + Send + Sync;

/// The conversation `input`'s reward model scores: the last turn's prompt messages, then its
/// reply.
pub fn conversation(input: &ScoreInput) -> Result<Vec<Message>, String> {
    let turn = input
        .rollout
        .turns
        .iter()
        .rev()
        .find(|t| t.completion_message.is_some())
        .ok_or("the rollout has no reply to score")?;
    let mut messages = turn.prompt_messages.clone();
    messages.extend(turn.completion_message.clone());
    Ok(messages)
}

/// The logistic function.
pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The `reward_model` function over `scorer`, weighted `weight`.
pub fn reward_fn(scorer: Arc<dyn ConversationScorer>, weight: f64, squash: bool) -> RewardFn {
    RewardFn::fallible(REWARD_MODEL_FN, weight, move |input| {
        let started = Instant::now();
        let score = scorer.score(&conversation(input)?);
        metrics::histogram!(ENV_REWARD_MODEL_SECONDS).record(started.elapsed().as_secs_f64());
        let score = score?;
        Ok(if squash { sigmoid(score) } else { score })
    })
}
