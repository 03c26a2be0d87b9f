//! [`Rubric`]: weighted reward functions scored after an episode ends (seed 003).
//!
//! - Weights are normalized to sum to 1 when the rubric is built; the reward is
//!   `Σ wᵢ · fᵢ(rollout)`, and every `fᵢ` is kept in `Rollout::reward_components` under its name.
//! - Env-provided per-turn rewards are kept as the component `env` (their sum). They count toward
//!   the reward only through a function that reads them, e.g. [`RewardFn::env_reward`].
//! - `truncation_reward` / `error_reward`, when set, replace the score of truncated / failed
//!   rollouts (`Error`, `Timeout`, `PromptTooLong`, `Expired`) without running the functions; when
//!   unset the functions score whatever partial output exists.
//! - Scoring a group runs every (rollout, function) pair concurrently, each on its own task under
//!   a deadline: a function that panics fails its rollout with `Error("env_panic")`, one that
//!   hangs with `Timeout`; such a rollout gets `error_reward` (or 0). The group and the pipeline go
//!   on.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use serde::{Deserialize, Serialize};
use sluice_core::{DataSample, Rollout, RolloutGroup, RolloutStatus};

use crate::error::EnvError;

mod reward_fn;

pub use reward_fn::{GroupMember, RewardFn};

/// What a reward function sees: the data sample and the finished rollout.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreInput {
    /// The dataset row.
    pub sample: DataSample,
    /// The rollout, with its turns and status.
    pub rollout: Rollout,
}

impl ScoreInput {
    /// Content of the last assistant message (`None` when there is none).
    pub fn final_text(&self) -> Option<&str> {
        self.rollout
            .turns
            .iter()
            .rev()
            .find_map(|t| t.completion_message.as_ref())
            .and_then(|m| m.content.as_deref())
    }

    /// Sum of the env's per-turn rewards (`None` when no turn has one).
    pub fn env_reward_sum(&self) -> Option<f64> {
        let rewards: Vec<f64> = self
            .rollout
            .turns
            .iter()
            .filter_map(|t| t.env_reward)
            .collect();
        (!rewards.is_empty()).then(|| rewards.iter().sum())
    }
}

/// Overrides and limits of a rubric.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RubricConfig {
    /// Reward of truncated rollouts, replacing the functions' score.
    #[serde(default)]
    pub truncation_reward: Option<f64>,
    /// Reward of failed rollouts (and of rollouts whose scoring failed).
    #[serde(default)]
    pub error_reward: Option<f64>,
    /// Deadline of each reward function call, in seconds. `None` (the default): no deadline of
    /// the rubric's own; the caller's bounds the call (in a run, the whole env step is bounded by
    /// `supervision.env_step_timeout_s`, so a fixed inner default would cap a longer setting).
    #[serde(default)]
    pub timeout_s: Option<f64>,
}

/// The score of one rollout.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    /// Final scalar reward.
    pub reward: f64,
    /// Per-function scores and the `env` component.
    pub components: BTreeMap<String, f64>,
    /// Set when scoring itself failed: the rollout's new status.
    pub failed: Option<RolloutStatus>,
}

impl Score {
    /// Writes reward, components and (on scoring failure) the status into `rollout`.
    pub fn apply_to(self, rollout: &mut Rollout) {
        rollout.reward = self.reward;
        rollout.reward_components = self.components;
        if let Some(status) = self.failed {
            rollout.status = status;
        }
    }
}

/// Weighted reward functions with overrides. Cheap to share behind an `Arc`.
#[derive(Debug, Clone)]
pub struct Rubric {
    fns: Vec<RewardFn>,
    config: RubricConfig,
    timeout: Duration,
}

impl Rubric {
    /// Builds a rubric; weights must be finite and ≥ 0 with a positive sum, names unique.
    pub fn new(mut fns: Vec<RewardFn>, config: RubricConfig) -> Result<Self, EnvError> {
        if fns.is_empty() {
            return Err(EnvError::Config(
                "a rubric needs at least one reward function".into(),
            ));
        }
        for (i, f) in fns.iter().enumerate() {
            if !f.weight.is_finite() || f.weight < 0.0 {
                return Err(EnvError::Config(format!(
                    "reward `{}`: weight must be finite and ≥ 0, got {}",
                    f.name, f.weight
                )));
            }
            if fns[..i].iter().any(|g| g.name == f.name) {
                return Err(EnvError::Config(format!(
                    "reward `{}` appears twice",
                    f.name
                )));
            }
        }
        let total: f64 = fns.iter().map(|f| f.weight).sum();
        if total <= 0.0 {
            return Err(EnvError::Config("reward weights sum to 0".into()));
        }
        for f in &mut fns {
            f.weight /= total;
        }
        // No deadline of its own: `Duration::MAX` (tokio's timeout saturates it to "never").
        let timeout = match config.timeout_s {
            None => Duration::MAX,
            Some(secs) => Duration::try_from_secs_f64(secs)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| EnvError::Config(format!("timeout_s must be > 0, got {secs}")))?,
        };
        Ok(Self {
            fns,
            config,
            timeout,
        })
    }

    /// (name, normalized weight) of each function.
    pub fn weights(&self) -> Vec<(&str, f64)> {
        self.fns
            .iter()
            .map(|f| (f.name.as_str(), f.weight))
            .collect()
    }

    /// The functions, with their normalized weights.
    pub fn functions(&self) -> &[RewardFn] {
        &self.fns
    }

    /// The overrides and limits.
    pub fn config(&self) -> &RubricConfig {
        &self.config
    }

    /// Whether some function scores whole groups (then only [`Rubric::score_group`] gives the
    /// full reward).
    pub fn has_group_fns(&self) -> bool {
        self.fns.iter().any(RewardFn::is_group)
    }

    /// Scores one finished rollout with the per-rollout functions (non-terminal rollouts score 0
    /// with no components). Group functions need the whole group: see [`Rubric::score_group`].
    pub async fn score(&self, sample: &DataSample, rollout: &Rollout) -> Score {
        self.score_one(sample, rollout).await.0
    }

    /// The score, and whether the functions produced it (not an override, not a failure).
    async fn score_one(&self, sample: &DataSample, rollout: &Rollout) -> (Score, bool) {
        let input = Arc::new(ScoreInput {
            sample: sample.clone(),
            rollout: rollout.clone(),
        });
        // The env's named components (`env.<name>`, summed over the episode) stay.
        let mut components: BTreeMap<String, f64> = rollout
            .reward_components
            .iter()
            .filter(|(k, _)| k.starts_with(ENV_COMPONENT_PREFIX))
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        if let Some(env) = input.env_reward_sum() {
            components.insert("env".to_owned(), env);
        }
        let override_reward = match &rollout.status {
            RolloutStatus::Ongoing | RolloutStatus::Aborted => {
                let score = Score {
                    reward: 0.0,
                    components,
                    failed: None,
                };
                return (score, false);
            }
            RolloutStatus::Completed => None,
            RolloutStatus::Truncated => self.config.truncation_reward,
            RolloutStatus::PromptTooLong
            | RolloutStatus::Expired
            | RolloutStatus::Timeout
            | RolloutStatus::Error(_) => self.config.error_reward,
        };
        if let Some(reward) = override_reward {
            let score = Score {
                reward,
                components,
                failed: None,
            };
            return (score, false);
        }
        let fns: Vec<&RewardFn> = self.fns.iter().filter(|f| !f.is_group()).collect();
        let results = join_all(fns.iter().map(|f| f.score(input.clone(), self.timeout))).await;
        let mut reward = 0.0;
        let mut failed = None;
        for (f, result) in fns.iter().zip(results) {
            match result {
                Ok(v) => {
                    reward += f.weight * v;
                    components.insert(f.name.clone(), v);
                }
                Err(e) => {
                    tracing::warn!(reward_fn = %f.name, error = %e, "reward function failed");
                    failed.get_or_insert(failure_status(e));
                }
            }
        }
        if failed.is_some() {
            reward = self.config.error_reward.unwrap_or(0.0);
        }
        let by_functions = failed.is_none();
        let score = Score {
            reward,
            components,
            failed,
        };
        (score, by_functions)
    }

    /// Scores every rollout of `group` and writes the results into it: the per-rollout
    /// functions concurrently, then each group function over the whole group (it sees every
    /// member's per-rollout score). A group function that fails fails the members it scores,
    /// like a per-rollout one.
    pub async fn score_group(&self, group: &mut RolloutGroup) {
        let sample: &sluice_core::DataSample = &group.sample;
        let scored = join_all(group.rollouts.iter().map(|r| self.score_one(sample, r))).await;
        let (mut scores, by_functions): (Vec<Score>, Vec<bool>) = scored.into_iter().unzip();
        let group_fns: Vec<&RewardFn> = self.fns.iter().filter(|f| f.is_group()).collect();
        if !group_fns.is_empty() {
            let members: Arc<Vec<GroupMember>> = Arc::new(
                group
                    .rollouts
                    .iter()
                    .zip(&scores)
                    .zip(&by_functions)
                    .map(|((r, s), &ok)| GroupMember {
                        input: Arc::new(ScoreInput {
                            sample: sample.clone(),
                            rollout: r.clone(),
                        }),
                        score: ok.then_some(s.reward),
                    })
                    .collect(),
            );
            for f in group_fns {
                let result = match f.score_members(members.clone(), self.timeout).await {
                    Ok(values) if values.len() == members.len() => Ok(values),
                    Ok(values) => Err(EnvError::Failed(format!(
                        "reward `{}` returned {} values for {} rollouts",
                        f.name,
                        values.len(),
                        members.len()
                    ))),
                    Err(e) => Err(e),
                };
                for (i, score) in scores.iter_mut().enumerate() {
                    if !by_functions[i] || score.failed.is_some() {
                        continue;
                    }
                    match &result {
                        Ok(values) => {
                            score.reward += f.weight * values[i];
                            score.components.insert(f.name.clone(), values[i]);
                        }
                        Err(e) => {
                            tracing::warn!(reward_fn = %f.name, error = %e, "group reward function failed");
                            score.failed = Some(failure_status(e.clone()));
                            score.reward = self.config.error_reward.unwrap_or(0.0);
                        }
                    }
                }
            }
        }
        for (rollout, score) in group.rollouts.iter_mut().zip(scores) {
            score.apply_to(rollout);
        }
    }
}

/// Prefix of the env's named reward components in `Rollout::reward_components` (`env.passed`).
pub const ENV_COMPONENT_PREFIX: &str = "env.";

/// The status of a rollout whose scoring failed with `e`.
fn failure_status(e: EnvError) -> RolloutStatus {
    match e {
        EnvError::Timeout { .. } => RolloutStatus::Timeout,
        other => RolloutStatus::Error(other.kind().to_owned()),
    }
}
