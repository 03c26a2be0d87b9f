//! `[data]` and `[data.domains.<domain>]`, validated: the datasets, and per domain the task that
//! runs its rows, its system prompt, the rubric that scores them and the env server that runs
//! their episodes.

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize, Serializer};

use crate::dataset::ReadLimits;

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
    /// Discount per turn back from the end of an episode, in (0, 1] (`None`: the task's own
    /// discount, else `trainer.gamma`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gamma: Option<f64>,
    /// Held-out dataset, `name[@split]` (`None`: the task's generated held-out split).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_dataset: Option<String>,
    /// Warm-start target of this domain's probe (`None`: `warmup.target_accuracy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_target_accuracy: Option<f64>,
    /// The `qa` task's row field holding the question (`None`: `question`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub question_field: Option<String>,
    /// The `qa` task's row field holding the reference answer (`None`: `answer`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer_field: Option<String>,
    /// The `qa` task's row field holding a per-row system prompt (`None`: `system_prompt`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_prompt_field: Option<String>,
    /// How the `qa` task's replies mark their final answer (`None`: `####`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer_marker: Option<AnswerMarker>,
    /// The `python_code` task's limits on each program (`None`: the task's defaults).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<DomainSandbox>,
}

/// `[data.domains.<domain>.sandbox]`, validated: each limit set, or `None` for the task's
/// default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DomainSandbox {
    /// CPU seconds, 1–3600.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_seconds: Option<u64>,
    /// Wall-clock deadline, seconds in (0, 3600].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wall_s: Option<f64>,
    /// Address space, MiB, 16–65536.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Processes of the sandbox user, 1–4096.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_processes: Option<u64>,
    /// KiB kept of stdout and of stderr each, 1–65536.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_output_kib: Option<u64>,
}

impl DomainConfig {
    /// The held-out dataset of `domain`, when `eval_dataset` names one: `name[@split]`, the split
    /// `eval` when unnamed.
    pub fn eval_dataset_spec(&self, domain: &str) -> Option<DatasetSpec> {
        let spec = self.eval_dataset.as_deref()?;
        let (name, split) = spec.split_once('@').unwrap_or((spec, "eval"));
        Some(DatasetSpec {
            domain: domain.to_owned(),
            name: name.to_owned(),
            split: Some(split.to_owned()),
        })
    }

    /// Whether the domain sets one of the `qa` task's keys (`question_field`, `answer_field`,
    /// `system_prompt_field`, `answer_marker`).
    pub fn sets_qa_keys(&self) -> bool {
        self.question_field.is_some()
            || self.answer_field.is_some()
            || self.system_prompt_field.is_some()
            || self.answer_marker.is_some()
    }
}

sluice_core::impl_choice!(AnswerMarker);

/// How a reply marks its final answer (`data.domains.<domain>.answer_marker`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum AnswerMarker {
    /// `#### 72` (GSM8K's way).
    #[default]
    #[serde(rename = "####")]
    Hashes,
    /// `\boxed{72}` (the MATH dataset's way).
    #[serde(rename = "boxed")]
    Boxed,
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
    /// Pattern of the `regex` reward function (checked to compile).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    /// The `judge` reward function's model and how its answer is read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub judge: Option<super::judge::JudgeConfig>,
    /// The `reward_model` reward function's model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reward_model: Option<super::reward_model::RewardModelConfig>,
}

fn seconds<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// A dataset reference, `domain::name[@split]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DatasetSpec {
    /// Domain.
    pub domain: String,
    /// Dataset name.
    pub name: String,
    /// Split, if given.
    pub split: Option<String>,
}

impl fmt::Display for DatasetSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}::{}", self.domain, self.name)?;
        if let Some(split) = &self.split {
            write!(f, "@{split}")?;
        }
        Ok(())
    }
}

impl FromStr for DatasetSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let err =
            || format!("expected `domain::name[@split]` with parts of [A-Za-z0-9_.-], got `{s}`");
        let ok = |p: &str| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        };
        let (domain, rest) = s.split_once("::").ok_or_else(err)?;
        let (name, split) = match rest.split_once('@') {
            Some((n, sp)) => (n, Some(sp)),
            None => (rest, None),
        };
        if !ok(domain) || !ok(name) || split.is_some_and(|sp| !ok(sp)) {
            return Err(err());
        }
        Ok(Self {
            domain: domain.to_owned(),
            name: name.to_owned(),
            split: split.map(str::to_owned),
        })
    }
}

impl Serialize for DatasetSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

sluice_core::impl_choice!(BadLinePolicy);

/// What to do with a dataset line that does not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BadLinePolicy {
    /// Report it with file and line, count it, go on.
    Skip,
    /// Report it and stop.
    Fail,
}

/// `[data]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DataConfig {
    /// Datasets.
    pub datasets: Vec<DatasetSpec>,
    /// Where JSONL files live.
    pub data_dir: PathBuf,
    /// Bad-line policy.
    pub on_bad_line: BadLinePolicy,
    /// Size caps of dataset files and lines (`max_file_bytes`, `max_line_bytes`).
    #[serde(flatten)]
    pub read_limits: ReadLimits,
    /// Adaptive domain mix (completed/target correction, clamped to [0.1, 10]).
    pub adaptive_mix: bool,
    /// Per-domain options (`[data.domains.<domain>]`), only for domains some dataset belongs to.
    #[serde(
        rename = "domains",
        skip_serializing_if = "std::collections::BTreeMap::is_empty"
    )]
    pub domain_options: std::collections::BTreeMap<String, DomainConfig>,
}

impl DataConfig {
    /// The distinct domains, in first-mention order.
    pub fn domains(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for d in &self.datasets {
            if !out.contains(&d.domain) {
                out.push(d.domain.clone());
            }
        }
        out
    }

    /// Tokens per model turn in `domain`: its `max_new_tokens`, else `default`
    /// (`rollout.max_new_tokens`).
    pub fn turn_tokens(&self, domain: &str, default: NonZeroU32) -> NonZeroU32 {
        self.domain_options
            .get(domain)
            .and_then(|d| d.max_new_tokens)
            .unwrap_or(default)
    }

    /// The per-domain turn budgets that differ from the default (what the controller applies).
    pub fn turn_token_overrides(&self) -> std::collections::BTreeMap<String, u32> {
        self.domain_options
            .iter()
            .filter_map(|(d, o)| o.max_new_tokens.map(|n| (d.clone(), n.get())))
            .collect()
    }
}
