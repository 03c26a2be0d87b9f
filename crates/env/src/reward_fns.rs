//! Reward functions every task offers to a rubric from config, besides its own (`correct`,
//! `format`, …; a task's own function wins over a generic one of the same name):
//!
//! | name | scores | value |
//! |---|---|---|
//! | `env` | one rollout | the sum of the env's per-turn rewards (0 when there are none) |
//! | `env.<name>` | one rollout | the env's named component `<name>`, summed over the episode (0 when absent) |
//! | `length` | the group | Kimi k1.5's length reward: `λ = 0.5 − (len − min)/(max − min)` over the group's scored rollouts (completion tokens); the group's best-scored rollouts get `λ`, the others `min(0, λ)`; 0 when all lengths are equal |
//! | `math_answer` | one rollout | 1 when the reply's math answer equals the reference's as numbers ([`crate::answer`]), else 0 |
//! | `exact_match` | one rollout | 1 when the reply's final answer text (last `\boxed{}`, else the line after the last `####`, else the whole reply) equals the reference answer, else 0 |
//! | `regex` | one rollout | with `rubric.regex`: when the pattern has a capture group, 1 when its last match's group 1 equals the reference answer; without one, 1 when it matches the reply |
//! | `format` | one rollout | 1 when the reply marks an answer with the answer marker (`#### <number>`, or a non-empty `\boxed{}`) |
//! | `judge` | one rollout | with the rubric's `judge` table: the score a model behind an OpenAI-compatible endpoint gives the reply, in [0, 1] ([`crate::judge`]) |
//! | `reward_model` | one rollout | with the rubric's `reward_model` table: a reward model's score of the conversation ([`crate::reward_model`]) |
//!
//! The answer functions read the reference from the sample's answer field (`answer`, or the
//! `qa` domain's `answer_field`): a string (its answer after the last `####`, else all of it) or
//! a number. A sample without it fails its rollout, naming the field.

use std::sync::Arc;

use regex::Regex;
use sluice_data::config::AnswerMarker;

use crate::answer;
use crate::rubric::{ENV_COMPONENT_PREFIX, GroupMember, RewardFn, ScoreInput};

/// Names of the generic functions (for error messages; `env.<name>` stands for any component).
pub const GENERIC_NAMES: &[&str] = &[
    "env",
    "env.<name>",
    "length",
    "math_answer",
    "exact_match",
    "regex",
    "format",
    "judge",
    "reward_model",
];

/// The components that say whether an answer was right, in the order evaluations look for one
/// to report as accuracy: a task's own `correct`, else a generic answer check.
pub const ACCURACY_COMPONENTS: &[&str] = &["correct", "math_answer", "exact_match", "regex"];

/// Where the answer-checking functions find the reference and how replies mark their answer.
#[derive(Debug, Clone)]
pub struct AnswerOptions {
    /// The sample input's field holding the reference answer.
    pub answer_field: String,
    /// The marker `format` looks for.
    pub marker: AnswerMarker,
    /// The `regex` function's pattern (`None`: the function is unavailable).
    pub regex: Option<Arc<Regex>>,
    /// The `judge` function's model (`None`: the function is unavailable).
    pub judge: Option<Arc<crate::judge::Judge>>,
    /// The `reward_model` function over its model (`None`: the function is unavailable).
    pub reward_model: Option<RewardFn>,
}

impl Default for AnswerOptions {
    /// Reference in `answer`, marker `####`, no pattern.
    fn default() -> Self {
        Self {
            answer_field: "answer".into(),
            marker: AnswerMarker::Hashes,
            regex: None,
            judge: None,
            reward_model: None,
        }
    }
}

/// The field `path` of a sample's input: the key itself when the row has it (a key may hold
/// dots), else a dotted path through nested objects (`reward_model.ground_truth`, verl's rows).
pub fn sample_field<'a>(input: &'a serde_json::Value, path: &str) -> Option<&'a serde_json::Value> {
    if let Some(v) = input.get(path) {
        return Some(v);
    }
    path.split('.').try_fold(input, |v, key| v.get(key))
}

/// How much of a value an error quotes.
const EXCERPT_CHARS: usize = 120;

/// `value` as JSON for an error message: its first 120 characters, with `…` and
/// the whole length when cut (a 10 MB field must not become a 10 MB log line).
pub fn excerpt(value: &serde_json::Value) -> String {
    let text = value.to_string();
    let chars = text.chars().count();
    if chars <= EXCERPT_CHARS {
        return text;
    }
    let cut: String = text.chars().take(EXCERPT_CHARS).collect();
    format!("{cut}… ({chars} characters)")
}

/// The reference answer of `input`'s sample: its `field` as text (a number is written out).
pub fn reference_text(input: &ScoreInput, field: &str) -> Result<String, String> {
    let id = &input.sample.id;
    match sample_field(&input.sample.input, field) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(serde_json::Value::Number(n)) => Ok(answer::number_text(n)),
        Some(other) => Err(format!(
            "sample `{id}`: the reference answer `{field}` must be a string or a number, got {}",
            excerpt(other)
        )),
        None => Err(format!(
            "sample `{id}` has no reference answer field `{field}`"
        )),
    }
}

/// 1.0 for true, 0.0 for false.
fn score(ok: bool) -> f64 {
    f64::from(u8::from(ok))
}

/// The answer-checking function `name` with `weight`, if it is one; `regex` only with a pattern.
fn answer_fn(name: &str, weight: f64, options: &AnswerOptions) -> Option<RewardFn> {
    let field = options.answer_field.clone();
    let reply = |input: &ScoreInput| input.final_text().unwrap_or("").to_owned();
    match name {
        "math_answer" => Some(RewardFn::inline_fallible(name, weight, move |input| {
            let reference = reference_text(input, &field)?;
            Ok(score(answer::math_answer_matches(
                &reply(input),
                &reference,
            )))
        })),
        "exact_match" => Some(RewardFn::inline_fallible(name, weight, move |input| {
            let reference = reference_text(input, &field)?;
            let expected = answer::collapse_whitespace(answer::reference_answer(&reference));
            Ok(score(answer::final_answer_text(&reply(input)) == expected))
        })),
        "regex" => {
            let pattern = Arc::clone(options.regex.as_ref()?);
            Some(RewardFn::inline_fallible(name, weight, move |input| {
                regex_score(&pattern, &reply(input), || reference_text(input, &field))
            }))
        }
        "format" => {
            let marker = options.marker;
            Some(RewardFn::inline(name, weight, move |input| {
                score(answer::has_marker(&reply(input), marker))
            }))
        }
        _ => None,
    }
}

/// The `regex` function: with a capture group, whether the last match's group 1 equals the
/// reference (read only then); without one, whether the pattern matches.
pub fn regex_score(
    pattern: &Regex,
    reply: &str,
    reference: impl FnOnce() -> Result<String, String>,
) -> Result<f64, String> {
    if pattern.captures_len() < 2 {
        return Ok(score(pattern.is_match(reply)));
    }
    let Some(captured) = pattern
        .captures_iter(reply)
        .last()
        .and_then(|c| c.get(1).map(|m| m.as_str().to_owned()))
    else {
        return Ok(0.0);
    };
    Ok(score(answer::answers_equal(&captured, &reference()?)))
}

/// The generic function called `name` with `weight`, if there is one (`regex` needs
/// `options.regex`, `judge` `options.judge`, `reward_model` `options.reward_model`).
pub fn generic(name: &str, weight: f64, options: &AnswerOptions) -> Option<RewardFn> {
    match name {
        "env" => Some(RewardFn::env_reward(weight)),
        "length" => Some(RewardFn::group("length", weight, |m| Ok(length_reward(m)))),
        "math_answer" | "exact_match" | "regex" | "format" => answer_fn(name, weight, options),
        "judge" => Some(crate::judge::reward_fn(
            Arc::clone(options.judge.as_ref()?),
            weight,
        )),
        "reward_model" => Some(options.reward_model.clone()?.with_weight(weight)),
        _ => {
            let component = name.strip_prefix(ENV_COMPONENT_PREFIX)?;
            if component.is_empty() {
                return None;
            }
            let key = name.to_owned();
            Some(RewardFn::inline(name, weight, move |input| {
                input
                    .rollout
                    .reward_components
                    .get(&key)
                    .copied()
                    .unwrap_or(0.0)
            }))
        }
    }
}

/// Kimi k1.5's group length reward (see the module table). Members without a score get 0.
pub fn length_reward(members: &[GroupMember]) -> Vec<f64> {
    let len = |m: &GroupMember| m.input.rollout.completion_tokens() as f64;
    let scored: Vec<&GroupMember> = members.iter().filter(|m| m.score.is_some()).collect();
    let (min, max) = scored
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), m| {
            (lo.min(len(m)), hi.max(len(m)))
        });
    let best = scored
        .iter()
        .filter_map(|m| m.score)
        .fold(f64::NEG_INFINITY, f64::max);
    members
        .iter()
        .map(|m| match m.score {
            Some(score) if max > min => {
                let lambda = 0.5 - (len(m) - min) / (max - min);
                if score >= best {
                    lambda
                } else {
                    lambda.min(0.0)
                }
            }
            _ => 0.0,
        })
        .collect()
}
