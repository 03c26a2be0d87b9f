//! `[data]` and `[data.domains.<domain>]` as serde reads them: the datasets, and the options of
//! one domain, its rubric and the env server that runs its episodes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `[data.domains.<domain>]`: options of one domain.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawDomain {
    /// System prompt for the domain's rows that have none of their own.
    pub system_prompt: Option<String>,
    /// Registered task that runs the domain's rows (default: the task named like the dataset).
    pub task: Option<String>,
    /// Base URL of an env server that runs the domain's episodes (`http://host:port`).
    pub env_url: Option<String>,
    /// The domain's episodes run on the env nodes that join the head (a head only).
    pub env_nodes: bool,
    /// `[data.domains.<domain>.rubric]`: how the domain's rollouts are scored (default: the
    /// task's own rubric).
    pub rubric: Option<RawRubric>,
    /// Tokens per model turn in this domain (default `rollout.max_new_tokens`).
    pub max_new_tokens: Option<i64>,
    /// Discount per turn back from the end of this domain's episodes, in (0, 1] (default: the
    /// task's own discount, else `trainer.gamma`).
    pub gamma: Option<f64>,
    /// Held-out set the domain is evaluated on: a dataset `name[@split]` (default: the task's
    /// generated held-out split).
    pub eval_dataset: Option<String>,
    /// Warm-start probe accuracy this domain must reach (default `warmup.target_accuracy`).
    pub warmup_target_accuracy: Option<f64>,
    /// The `qa` task: the row field holding the question (default `question`).
    pub question_field: Option<String>,
    /// The `qa` task: the row field holding the reference answer (default `answer`).
    pub answer_field: Option<String>,
    /// The `qa` task: the row field holding a per-row system prompt (default `system_prompt`).
    pub system_prompt_field: Option<String>,
    /// The `qa` task: how replies mark their final answer, `####` or `boxed` (default `####`).
    pub answer_marker: Option<String>,
    /// `[data.domains.<domain>.sandbox]`: the `python_code` task's limits on each program.
    pub sandbox: Option<RawSandbox>,
}

/// `[data.domains.<domain>.sandbox]`: limits of each sandboxed program run (unset keys keep the
/// task's defaults).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSandbox {
    /// CPU seconds (`RLIMIT_CPU`).
    pub cpu_seconds: Option<i64>,
    /// Wall-clock deadline of one run, seconds.
    pub wall_s: Option<f64>,
    /// Address space, MiB (`RLIMIT_AS`).
    pub memory_mib: Option<i64>,
    /// Processes of the sandbox user (`RLIMIT_NPROC`).
    pub max_processes: Option<i64>,
    /// KiB kept of stdout and of stderr each.
    pub max_output_kib: Option<i64>,
}

/// `[data.domains.<domain>.rubric]`: weighted reward functions and the overrides of failed and
/// truncated rollouts.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRubric {
    /// Reward function name → weight (normalized to sum to 1).
    pub weights: BTreeMap<String, f64>,
    /// Reward of truncated rollouts, replacing the functions' score.
    pub truncation_reward: Option<f64>,
    /// Reward of failed rollouts (error, timeout, prompt too long) and of failed scoring.
    pub error_reward: Option<f64>,
    /// Deadline of each reward function call, seconds.
    pub timeout_s: Option<f64>,
    /// Pattern of the `regex` reward function.
    pub regex: Option<String>,
    /// `[data.domains.<domain>.rubric.judge]`: the `judge` reward function's model.
    pub judge: Option<super::judge::RawJudge>,
    /// `[data.domains.<domain>.rubric.reward_model]`: the `reward_model` function's model.
    pub reward_model: Option<super::reward_model::RawRewardModel>,
}

/// `[data]`: datasets.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawData {
    /// Dataset specs, `domain::name[@split]`.
    pub datasets: Vec<String>,
    /// Directory holding `<domain>/<name>[.<split>].jsonl` files.
    pub data_dir: String,
    /// `skip` or `fail` on a line that does not parse.
    pub on_bad_line: String,
    /// Longest dataset line, bytes; a longer one is a bad line.
    pub max_line_bytes: i64,
    /// Largest dataset file, bytes; a larger one is refused.
    pub max_file_bytes: i64,
    /// Correct domain weights by completed/target ratios (seed 000's adaptive sampling).
    pub adaptive_mix: bool,
    /// Per-domain options, `[data.domains.<domain>]`.
    pub domains: BTreeMap<String, RawDomain>,
}

impl Default for RawData {
    fn default() -> Self {
        Self {
            datasets: Vec::new(),
            data_dir: "data".into(),
            on_bad_line: "skip".into(),
            max_line_bytes: crate::dataset::DEFAULT_MAX_LINE_BYTES as i64,
            max_file_bytes: crate::dataset::DEFAULT_MAX_FILE_BYTES as i64,
            adaptive_mix: true,
            domains: BTreeMap::new(),
        }
    }
}
