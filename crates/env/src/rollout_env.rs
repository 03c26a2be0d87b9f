//! The seam between the rollout pipeline and an environment, at the token level: [`RolloutEnv`]
//! starts a rollout (its first prompt) and answers each finished turn ([`EnvReply`]: the next
//! prompt, or the end with a reward), noting what it learned about the turn ([`TurnNote`]). The
//! env worker pool of `sluice-actors` drives it; the simulated task ([`crate::simulated`]) and the
//! native pipeline's registered tasks implement it.

use std::collections::BTreeMap;

use sluice_core::{DataSample, Message, Rollout, RolloutGroup, RolloutId, RolloutStatus};

use crate::BoxFuture;

/// What the environment answers.
#[derive(Debug, Clone, PartialEq)]
pub enum EnvReply {
    /// Another model turn with this full prompt.
    Continue {
        /// Prompt token ids of the next turn.
        next_prompt: Vec<u32>,
    },
    /// The episode is over.
    Done {
        /// Final reward.
        reward: f64,
        /// Final status (`Completed`, `Truncated`, `PromptTooLong`, `Timeout`, …).
        status: RolloutStatus,
        /// The reward's named components (e.g. `correct`, `format`).
        components: BTreeMap<String, f64>,
    },
    /// The environment failed; the payload is a short stable kind.
    Failed {
        /// Error kind.
        kind: String,
    },
    /// A settled group, scored as a whole ([`RolloutEnv::score_group`]): its rewards replace
    /// the ones its rollouts ended with.
    Scored(Box<RolloutGroup>),
}

impl EnvReply {
    /// A completed episode with `reward` and no components.
    pub fn done(reward: f64) -> Self {
        Self::Done {
            reward,
            status: RolloutStatus::Completed,
            components: BTreeMap::new(),
        }
    }
}

/// What the env learned about the turn it just answered (recorded on the rollout's last turn).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnNote {
    /// The completion parsed into a message.
    pub completion_message: Option<Message>,
    /// The env's reply messages.
    pub env_messages: Vec<Message>,
    /// Per-turn reward.
    pub env_reward: Option<f64>,
    /// Situation label of the turn.
    pub situation: Option<String>,
}

/// An environment at the token level. Besides `start` and `step`, every call is written out:
/// a wrapper forwards with [`forward_env!`](crate::forward_env), an env with nothing behind a
/// call answers with [`no_env_state!`](crate::no_env_state) (no defaults, so nothing is
/// forgotten silently).
pub trait RolloutEnv: Send + Sync + 'static {
    /// Starts rollout `id` of `sample`: its first prompt as `Continue`, or why it cannot start.
    fn start<'a>(&'a self, sample: &'a DataSample, id: RolloutId) -> BoxFuture<'a, EnvReply>;

    /// Answers the rollout's last turn. `truncated`: the completion hit `max_tokens`, so the
    /// episode ends as `Truncated` (the env scores it without stepping).
    fn step<'a>(
        &'a self,
        sample: &'a DataSample,
        rollout: &'a Rollout,
        truncated: bool,
    ) -> BoxFuture<'a, (EnvReply, TurnNote)>;

    /// Forgets rollout `id` (its group was dropped).
    fn abandon(&self, id: RolloutId) -> BoxFuture<'_, ()>;

    /// Whether settled groups go through [`RolloutEnv::score_group`] before they are stored
    /// (a rubric with group reward functions).
    fn scores_groups(&self) -> bool;

    /// Scores a settled (not aborted) group as a whole.
    fn score_group<'a>(
        &'a self,
        sample: &'a DataSample,
        group: RolloutGroup,
    ) -> BoxFuture<'a, RolloutGroup>;

    /// Sets how many sessions may be open at once (the env worker pool calls it at start and
    /// whenever its concurrency knobs change).
    fn set_session_cap(&self, sessions: usize);
}
