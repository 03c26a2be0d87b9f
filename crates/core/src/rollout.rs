//! The data units of `DESIGN.md` §2: a dataset row, the turns of a rollout with per-token
//! log-probabilities and policy versions, rollouts, their status, and groups.
//!
//! Invariant kept by every mutator here: within a turn, `completion_token_ids`, `logprobs` and
//! `token_versions` have the same length (one entry per generated token). Training always uses the
//! token ids the engine produced, never re-tokenized text.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::ids::{GroupId, PolicyVersion, RolloutId};
use crate::message::Message;

/// One dataset row, as the sampler hands it to the rollout controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataSample {
    /// Row id, unique within its dataset (e.g. the line number or the row's own `id`).
    pub id: String,
    /// Domain (`math`, `code`, …): selects the task and the domain-mix bucket.
    pub domain: String,
    /// Dataset name (`domain::name[@split]` without the domain).
    pub dataset: String,
    /// Whatever the environment needs to start an episode.
    pub input: serde_json::Value,
    /// Per-domain system prompt, when the domain has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
}

impl DataSample {
    /// The dataset's name without its split (`arithmetic@train` → `arithmetic`): the task that
    /// serves the sample unless its domain names another.
    pub fn dataset_name(&self) -> &str {
        self.dataset
            .split_once('@')
            .map_or(self.dataset.as_str(), |(name, _)| name)
    }
}

/// Where a rollout stands. Only `Ongoing` and `Aborted` can still produce tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutStatus {
    /// Being generated or waiting for the environment.
    Ongoing,
    /// The episode ended normally.
    Completed,
    /// Generation hit `max_tokens` (or the context) before the episode ended.
    Truncated,
    /// The next prompt no longer fits the context; no request was sent.
    PromptTooLong,
    /// Interrupted by a weight update; the partial output is saved and can resume.
    Aborted,
    /// Its oldest token fell more than `max_version_lag` versions behind.
    Expired,
    /// The environment or a reward function did not answer in time.
    Timeout,
    /// The environment, a reward function or the engine failed; the payload is a short stable kind.
    Error(String),
}

impl RolloutStatus {
    /// No more tokens will be generated for this attempt (everything except `Ongoing` and
    /// `Aborted`).
    pub fn is_terminal(&self) -> bool {
        !matches!(self, Self::Ongoing | Self::Aborted)
    }

    /// The rollout ended with model output that can be trained on.
    pub fn is_trainable(&self) -> bool {
        matches!(self, Self::Completed | Self::Truncated)
    }

    /// Short stable name, used as a metric label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::Ongoing => "ongoing",
            Self::Completed => "completed",
            Self::Truncated => "truncated",
            Self::PromptTooLong => "prompt_too_long",
            Self::Aborted => "aborted",
            Self::Expired => "expired",
            Self::Timeout => "timeout",
            Self::Error(_) => "error",
        }
    }
}

/// Generated tokens did not line up with their log-probabilities or versions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "turn has {tokens} completion tokens but {logprobs} logprobs and {versions} versions; they must match"
)]
pub struct TokenLengthMismatch {
    /// Number of token ids.
    pub tokens: usize,
    /// Number of log-probabilities.
    pub logprobs: usize,
    /// Number of versions.
    pub versions: usize,
}

/// One model turn: the prompt it saw, the tokens it produced, and the environment's answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutTurn {
    /// Token ids of the full prompt sent to the engine (chat-templated history).
    pub prompt_token_ids: Vec<u32>,
    /// The messages that prompt was rendered from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_messages: Vec<Message>,
    /// Token ids the engine generated, across resumes.
    pub completion_token_ids: Vec<u32>,
    /// Behaviour log-probability of each generated token.
    pub logprobs: Vec<f32>,
    /// Policy version of the weights that generated each token.
    pub token_versions: Vec<PolicyVersion>,
    /// The completion parsed back into a message (content, reasoning, tool calls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_message: Option<Message>,
    /// Messages the environment replied with after this turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env_messages: Vec<Message>,
    /// Reward the environment gave for this turn, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_reward: Option<f64>,
    /// Situation label for situational advantages (seed 002).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub situation: Option<String>,
}

impl RolloutTurn {
    /// A turn that has not generated anything yet.
    pub fn new(prompt_token_ids: Vec<u32>) -> Self {
        Self {
            prompt_token_ids,
            ..Self::default()
        }
    }

    /// Appends generated tokens (a whole completion, or the part produced before an abort).
    /// Appending keeps earlier tokens and their versions, which is what a resumed turn needs.
    pub fn append_tokens(
        &mut self,
        tokens: &[u32],
        logprobs: &[f32],
        versions: &[PolicyVersion],
    ) -> Result<(), TokenLengthMismatch> {
        if tokens.len() != logprobs.len() || tokens.len() != versions.len() {
            return Err(TokenLengthMismatch {
                tokens: tokens.len(),
                logprobs: logprobs.len(),
                versions: versions.len(),
            });
        }
        self.completion_token_ids.extend_from_slice(tokens);
        self.logprobs.extend_from_slice(logprobs);
        self.token_versions.extend_from_slice(versions);
        Ok(())
    }

    /// Forgets generated tokens (regeneration after an abort without partial rollout).
    /// Returns how many tokens were discarded.
    pub fn discard_completion(&mut self) -> usize {
        let n = self.completion_token_ids.len();
        self.completion_token_ids.clear();
        self.logprobs.clear();
        self.token_versions.clear();
        self.completion_message = None;
        n
    }

    /// Checks the one-entry-per-token invariant (for data that came from outside, e.g. disk).
    pub fn check(&self) -> Result<(), TokenLengthMismatch> {
        let (t, l, v) = (
            self.completion_token_ids.len(),
            self.logprobs.len(),
            self.token_versions.len(),
        );
        if t == l && t == v {
            Ok(())
        } else {
            Err(TokenLengthMismatch {
                tokens: t,
                logprobs: l,
                versions: v,
            })
        }
    }

    /// Number of generated tokens.
    pub fn completion_tokens(&self) -> usize {
        self.completion_token_ids.len()
    }

    /// Oldest version among the generated tokens.
    pub fn min_version(&self) -> Option<PolicyVersion> {
        self.token_versions.iter().copied().min()
    }

    /// Newest version among the generated tokens.
    pub fn max_version(&self) -> Option<PolicyVersion> {
        self.token_versions.iter().copied().max()
    }
}

/// One trajectory of a group: its turns, status and reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rollout {
    /// Globally unique id.
    pub id: RolloutId,
    /// Turns in order; the last one may be partial while `Ongoing` or `Aborted`.
    pub turns: Vec<RolloutTurn>,
    /// Where it stands.
    pub status: RolloutStatus,
    /// Final scalar reward (weighted rubric score, or an override).
    pub reward: f64,
    /// Named reward components, as the rubric and the environment reported them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reward_components: BTreeMap<String, f64>,
    /// How many times a weight update interrupted it (drives the tail batch).
    pub abort_count: u32,
}

impl Rollout {
    /// A rollout that has not started.
    pub fn new(id: RolloutId) -> Self {
        Self {
            id,
            turns: Vec::new(),
            status: RolloutStatus::Ongoing,
            reward: 0.0,
            reward_components: BTreeMap::new(),
            abort_count: 0,
        }
    }

    /// Total generated tokens over all turns.
    pub fn completion_tokens(&self) -> usize {
        self.turns.iter().map(RolloutTurn::completion_tokens).sum()
    }

    /// Oldest version of any generated token (`None` before the first token).
    pub fn min_version(&self) -> Option<PolicyVersion> {
        self.turns.iter().filter_map(RolloutTurn::min_version).min()
    }

    /// Newest version of any generated token.
    pub fn max_version(&self) -> Option<PolicyVersion> {
        self.turns.iter().filter_map(RolloutTurn::max_version).max()
    }

    /// See [`RolloutStatus::is_terminal`].
    pub fn is_terminal(&self) -> bool {
        self.status.is_terminal()
    }
}

/// The `group_size` rollouts of one data sample, scored together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutGroup {
    /// Globally unique id.
    pub id: GroupId,
    /// The dataset row every rollout of the group answers. Shared: the controller, the env
    /// workers and the replay store hold the same row, never a copy of it.
    #[serde(with = "shared_sample")]
    pub sample: Arc<DataSample>,
    /// The rollouts, indexed by `RolloutId::index`.
    pub rollouts: Vec<Rollout>,
    /// Policy version when the group was admitted (admission accounting).
    pub admitted_at: PolicyVersion,
}

impl RolloutGroup {
    /// A group of `group_size` fresh rollouts.
    pub fn new(
        id: GroupId,
        sample: impl Into<Arc<DataSample>>,
        group_size: u32,
        admitted_at: PolicyVersion,
    ) -> Self {
        Self {
            id,
            sample: sample.into(),
            rollouts: (0..group_size)
                .map(|i| Rollout::new(id.rollout(i)))
                .collect(),
            admitted_at,
        }
    }

    /// The largest abort count of the group's rollouts (tail-batch candidacy, DESIGN §4.3).
    pub fn max_aborts(&self) -> u32 {
        self.rollouts
            .iter()
            .map(|r| r.abort_count)
            .max()
            .unwrap_or(0)
    }

    /// Oldest version of any generated token in the group.
    pub fn min_version(&self) -> Option<PolicyVersion> {
        self.rollouts.iter().filter_map(Rollout::min_version).min()
    }

    /// Newest version of any generated token in the group.
    pub fn max_version(&self) -> Option<PolicyVersion> {
        self.rollouts.iter().filter_map(Rollout::max_version).max()
    }

    /// Total generated tokens.
    pub fn completion_tokens(&self) -> usize {
        self.rollouts.iter().map(Rollout::completion_tokens).sum()
    }

    /// Every rollout has reached a terminal status.
    pub fn is_terminal(&self) -> bool {
        self.rollouts.iter().all(Rollout::is_terminal)
    }

    /// Mean of each named reward component over the group's finished rollouts that carry it
    /// (`correct`, `env`, `env.passed`, …).
    pub fn reward_component_means(&self) -> BTreeMap<String, f64> {
        reward_component_means(self.rollouts.iter().filter(|r| r.is_terminal()))
    }

    /// All rewards are equal, so group-relative advantages are all zero.
    pub fn has_uniform_reward(&self) -> bool {
        let mut rewards = self.rollouts.iter().map(|r| r.reward);
        match rewards.next() {
            Some(first) => rewards.all(|r| r == first),
            None => true,
        }
    }
}

/// Mean of each named reward component over the `rollouts` that carry it.
pub fn reward_component_means<'a>(
    rollouts: impl IntoIterator<Item = &'a Rollout>,
) -> BTreeMap<String, f64> {
    let mut sums: BTreeMap<&str, (f64, u32)> = BTreeMap::new();
    for r in rollouts {
        for (name, v) in &r.reward_components {
            let e = sums.entry(name.as_str()).or_default();
            e.0 += v;
            e.1 += 1;
        }
    }
    sums.into_iter()
        .map(|(name, (sum, n))| (name.to_owned(), sum / f64::from(n)))
        .collect()
}

/// The shared sample is written and read as the plain row (the record format is unchanged).
mod shared_sample {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::DataSample;

    pub fn serialize<S: Serializer>(sample: &Arc<DataSample>, s: S) -> Result<S::Ok, S::Error> {
        sample.as_ref().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<DataSample>, D::Error> {
        DataSample::deserialize(d).map(Arc::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{NodeId, RunId};

    fn gid() -> GroupId {
        GroupId {
            run: RunId::from_name("t"),
            node: NodeId(0),
            counter: 1,
        }
    }

    #[test]
    fn append_keeps_versions_across_resume() {
        let mut turn = RolloutTurn::new(vec![1, 2, 3]);
        let v0 = PolicyVersion(0);
        let v1 = PolicyVersion(1);
        turn.append_tokens(&[10, 11], &[-0.1, -0.2], &[v0, v0])
            .unwrap();
        turn.append_tokens(&[12], &[-0.3], &[v1]).unwrap();
        assert_eq!(turn.completion_token_ids, [10, 11, 12]);
        assert_eq!(turn.token_versions, [v0, v0, v1]);
        assert_eq!(
            (turn.min_version(), turn.max_version()),
            (Some(v0), Some(v1))
        );
        let err = turn.append_tokens(&[1, 2], &[0.0], &[v1, v1]).unwrap_err();
        assert_eq!((err.tokens, err.logprobs), (2, 1));
        assert_eq!(
            turn.completion_tokens(),
            3,
            "a failed append changes nothing"
        );
        assert_eq!(turn.discard_completion(), 3);
        assert!(turn.check().is_ok());
    }

    #[test]
    fn group_helpers() {
        let sample = DataSample {
            id: "0".into(),
            domain: "math".into(),
            dataset: "arith".into(),
            input: serde_json::json!({"q": "1+1"}),
            system_prompt: None,
        };
        let mut g = RolloutGroup::new(gid(), sample, 3, PolicyVersion(2));
        assert_eq!(g.rollouts[2].id, gid().rollout(2));
        assert!(!g.is_terminal());
        assert!(g.has_uniform_reward());
        assert_eq!(g.min_version(), None);
        for (i, r) in g.rollouts.iter_mut().enumerate() {
            let mut t = RolloutTurn::new(vec![1]);
            let v = PolicyVersion(i as u64 + 2);
            t.append_tokens(&[5, 6], &[0.0, 0.0], &[v, v]).unwrap();
            r.turns.push(t);
            r.status = RolloutStatus::Completed;
            r.reward = i as f64;
        }
        assert!(g.is_terminal());
        assert!(!g.has_uniform_reward());
        assert_eq!(g.completion_tokens(), 6);
        assert_eq!(g.min_version(), Some(PolicyVersion(2)));
        assert_eq!(g.max_version(), Some(PolicyVersion(4)));
    }

    #[test]
    fn status_classes() {
        use RolloutStatus::*;
        assert!(!Ongoing.is_terminal() && !Aborted.is_terminal());
        for s in [
            Completed,
            Truncated,
            PromptTooLong,
            Expired,
            Timeout,
            Error("x".into()),
        ] {
            assert!(s.is_terminal(), "{s:?}");
        }
        assert!(Completed.is_trainable() && Truncated.is_trainable());
        assert!(!Timeout.is_trainable());
        assert_eq!(Error("env_panic".into()).as_label(), "error");
    }

    #[test]
    fn component_means_cover_finished_rollouts_that_carry_each_component() {
        let sample = DataSample {
            id: "s".into(),
            domain: "math".into(),
            dataset: "a".into(),
            input: serde_json::Value::Null,
            system_prompt: None,
        };
        let mut g = RolloutGroup::new(gid(), sample, 3, PolicyVersion(0));
        g.rollouts[0].status = RolloutStatus::Completed;
        g.rollouts[0].reward_components = BTreeMap::from([("correct".into(), 1.0)]);
        g.rollouts[1].status = RolloutStatus::Completed;
        g.rollouts[1].reward_components =
            BTreeMap::from([("correct".into(), 0.0), ("env.ran".into(), 1.0)]);
        // Still generating: not counted.
        g.rollouts[2].reward_components = BTreeMap::from([("correct".into(), 1.0)]);
        let means = g.reward_component_means();
        assert_eq!(means["correct"], 0.5);
        assert_eq!(means["env.ran"], 1.0);
        assert_eq!(means.len(), 2);
    }
}
