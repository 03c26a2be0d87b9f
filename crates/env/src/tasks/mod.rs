//! Built-in tasks. Each but `qa` (which reads dataset files) generates its own data (no
//! downloads), with a `train` and a disjoint held-out `eval` split:
//!
//! | task | episode | reward |
//! |---|---|---|
//! | [`arithmetic`] (`arithmetic`, `arithmetic_wide`) | one turn: `7+5=` | exact match of the number (+ format) |
//! | [`sum_digits`] | one turn, answer as `[ANSWER] n` | exact match (+ format) |
//! | [`calculator`] (`calculator_tool`) | multi-turn, may call `calc` via `<tool_call>` | final answer |
//! | [`stock`] (`stock_tool`) | multi-turn, must call `stock` for a count the prompt never shows | final answer |
//! | [`python_code`] | one turn: a Python program, run in the [`crate::sandbox`] | its output matches |
//! | [`episodic`] | multi-step walk, actions in `<|action_start|>…<|action_end|>` | outcome, discounted by γ |
//! | [`qa`] | one turn: a dataset row's question (no data of its own) | math answer of the row's answer (+ format) |
//! | [`word_problems`] | one turn: a word problem in sentences, answer after `####` | math answer (+ format) |

pub mod arithmetic;
pub mod calculator;
pub mod episodic;
#[cfg(target_os = "linux")]
pub mod python_code;
pub mod qa;
pub mod stock;
pub mod sum_digits;
pub mod tool_env;
pub mod word_problems;

use serde::de::DeserializeOwned;
use serde_json::Value;
use sluice_core::{DataSample, Message};
use sluice_data::rng::{Rng, derive_seed, hash_str};

use crate::error::EnvError;
use crate::protocol::{BoxFuture, EnvInit, EnvStep, MessageEnv};
use crate::rubric::{RewardFn, Rubric, RubricConfig, ScoreInput};
use crate::task::Task;

/// Every built-in task, freshly built.
pub fn builtin_tasks() -> Vec<Task> {
    vec![
        arithmetic::task(),
        arithmetic::wide_task(),
        sum_digits::task(),
        calculator::task(),
        stock::task(),
        episodic::task(),
        word_problems::task(),
        qa::task(),
        #[cfg(target_os = "linux")]
        python_code::task(),
    ]
}

/// The rubric the answer-checking tasks share: `correct` (weight 1) plus a small `format` bonus
/// (weight 0.1); failed rollouts score 0, truncated ones `truncation_reward`.
pub(crate) fn answer_rubric(
    correct: fn(&ScoreInput) -> f64,
    format: fn(&ScoreInput) -> f64,
    truncation_reward: Option<f64>,
) -> Rubric {
    Rubric::new(
        vec![
            // Text checks of the final answer: cheap, run inline.
            RewardFn::inline("correct", 1.0, correct),
            RewardFn::inline("format", 0.1, format),
        ],
        RubricConfig {
            truncation_reward,
            error_reward: Some(0.0),
            ..RubricConfig::default()
        },
    )
    .expect("static rubric is valid")
}

/// The `train` and held-out `eval` dataset specs of a built-in task.
pub(crate) fn train_eval_specs(domain: &str, name: &str) -> Vec<sluice_data::config::DatasetSpec> {
    ["train", "eval"]
        .into_iter()
        .map(|split| {
            format!("{domain}::{name}@{split}")
                .parse()
                .expect("built-in dataset specs are valid")
        })
        .collect()
}

/// 1 when `parse` finds an answer in the final reply, else 0.
pub(crate) fn has_answer(input: &ScoreInput, parse: fn(&str) -> Option<i64>) -> f64 {
    f64::from(u8::from(input.final_text().and_then(parse).is_some()))
}

/// 1 when `parse` finds the sample's `answer` in the final reply, else 0.
pub(crate) fn answer_matches(input: &ScoreInput, parse: fn(&str) -> Option<i64>) -> f64 {
    let expected: Option<i64> = field(&input.sample, "answer").ok();
    let got = input.final_text().and_then(parse);
    f64::from(u8::from(got.is_some() && got == expected))
}

/// Reads field `key` of a sample's input.
pub(crate) fn field<T: DeserializeOwned>(sample: &DataSample, key: &str) -> Result<T, EnvError> {
    let v = sample
        .input
        .get(key)
        .ok_or_else(|| EnvError::BadInput(format!("sample `{}` has no `{key}`", sample.id)))?;
    serde_json::from_value(v.clone())
        .map_err(|e| EnvError::BadInput(format!("sample `{}`: `{key}`: {e}", sample.id)))
}

/// The integer after the last `[ANSWER]` tag.
pub fn parse_answer_tag(text: &str) -> Option<i64> {
    let (_, after) = text.rsplit_once("[ANSWER]")?;
    let digits: String = after
        .trim_start()
        .chars()
        .enumerate()
        .take_while(|&(i, c)| c.is_ascii_digit() || (i == 0 && c == '-'))
        .map(|(_, c)| c)
        .collect();
    digits.parse().ok()
}

/// A problem belongs to the held-out split when its key hashes to 0 mod 10 (about a tenth): the
/// rule of every task but `arithmetic_wide`.
pub(crate) fn is_heldout(key: &str) -> bool {
    hash_str(key).is_multiple_of(10)
}

/// A problem belongs to the held-out split when its key, hashed and mixed, is 0 mod `one_in`
/// (about one in `one_in`). Deterministic in the key alone, so no seed ever moves a problem
/// across splits. The FNV hash is mixed first: its low bits depend only on the low bits of each
/// byte, so `hash_str(key) % 4` would hold out a pattern of digits rather than a random quarter.
pub(crate) fn is_heldout_one_in(key: &str, one_in: u64) -> bool {
    derive_seed(&[hash_str(key)]).is_multiple_of(one_in)
}

/// Draws `count` problems of `split` from `make` (called with a fresh RNG until a problem of the
/// right split comes up), holding out by [`is_heldout`]. Deterministic in (`task`, `split`, `seed`).
pub(crate) fn draw<F>(
    task: &str,
    split: &str,
    seed: u64,
    count: usize,
    make: F,
) -> Result<Vec<DataSample>, EnvError>
where
    F: FnMut(&mut Rng) -> (String, Value),
{
    draw_split(task, split, seed, count, is_heldout, make)
}

/// [`draw`] with the task's own held-out rule: a key is held out when `heldout(key)`.
pub(crate) fn draw_split<F>(
    task: &str,
    split: &str,
    seed: u64,
    count: usize,
    heldout: fn(&str) -> bool,
    mut make: F,
) -> Result<Vec<DataSample>, EnvError>
where
    F: FnMut(&mut Rng) -> (String, Value),
{
    let want_heldout = match split {
        "train" => false,
        "eval" | "test" => true,
        other => {
            return Err(EnvError::Config(format!(
                "task `{task}` has splits `train` and `eval`, not `{other}`"
            )));
        }
    };
    let mut rng = Rng::new(derive_seed(&[seed, hash_str(task), hash_str(split)]));
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let (key, input) = make(&mut rng);
        if heldout(&key) == want_heldout {
            out.push(DataSample {
                id: format!("{split}-{}", out.len()),
                domain: String::new(),
                dataset: String::new(),
                input,
                system_prompt: None,
            });
        }
    }
    Ok(out)
}

/// A one-turn env: opens with one user message, ends after the first answer.
pub(crate) struct SingleTurnEnv {
    pub(crate) prompt: String,
}

impl MessageEnv for SingleTurnEnv {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        let messages = vec![Message::user(self.prompt.clone())];
        Box::pin(async move {
            Ok(EnvInit {
                messages,
                tools: Vec::new(),
            })
        })
    }

    fn step(&mut self, _assistant: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        Box::pin(async { Ok(EnvStep::done().with_situation("answer")) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_tags() {
        assert_eq!(parse_answer_tag("so [ANSWER] 18"), Some(18));
        assert_eq!(parse_answer_tag("[ANSWER] 3 then [ANSWER]-7."), Some(-7));
        assert_eq!(parse_answer_tag("[ANSWER] x"), None);
        assert_eq!(parse_answer_tag("18"), None);
    }
}
