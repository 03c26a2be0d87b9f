//! `[data.domains.<domain>]`, validated: the task that runs a domain's rows, its system prompt,
//! the rubric that scores them and the env server that runs their episodes.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Serialize, Serializer};

/// `[data.domains.<domain>]`
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DomainConfig {
    /// System prompt for rows without their own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// Task that runs the domain's rows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// Env server that runs the domain's episodes (`http://` or `https://` base URL).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub env_url: Option<String>,
    /// The domain's episodes run on the env nodes joined to this head, spread by their load.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub env_nodes: bool,
    /// The rubric replacing the task's own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rubric: Option<DomainRubric>,
    /// Tokens per model turn (`None`: `rollout.max_new_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<std::num::NonZeroU32>,
    /// Held-out dataset, `name[@split]` (`None`: the task's generated held-out split).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_dataset: Option<String>,
    /// Warm-start target of this domain's probe (`None`: `warmup.target_accuracy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_target_accuracy: Option<f64>,
}

/// `[data.domains.<domain>.rubric]`: reward functions by name with their weights (finite, ≥ 0,
/// summing to more than 0; normalized where the rubric is built), and the overrides.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DomainRubric {
    /// Reward function name → weight, at least one.
    pub weights: BTreeMap<String, f64>,
    /// Reward of truncated rollouts (absent: the functions score them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub truncation_reward: Option<f64>,
    /// Reward of failed rollouts and failed scoring (absent: 0 for failed scoring, the functions
    /// score failed rollouts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_reward: Option<f64>,
    /// Deadline of each reward function call (absent: the env step's deadline bounds it).
    #[serde(
        rename = "timeout_s",
        serialize_with = "seconds",
        skip_serializing_if = "Option::is_none"
    )]
    pub timeout: Option<Duration>,
}

fn seconds<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(d.as_secs_f64()),
        None => s.serialize_none(),
    }
}
