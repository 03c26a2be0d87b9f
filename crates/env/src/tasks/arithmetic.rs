//! `arithmetic`: single-turn small-integer arithmetic (`a+b=` and `a-b=` with operands 0–9,
//! written compactly so a character-level model reads it in a few tokens). The model answers
//! with the number alone. Rewards: `correct` (exact integer match, weight 1) and `format` (the
//! reply is one integer, weight 0.1).
//!
//! The problem space is small (200 problems) so a tiny model learns it in minutes on a CPU;
//! about a tenth is held out as the `eval` split and never appears in `train`, so evaluation
//! measures generalization, not recall.

use serde_json::json;
use sluice_core::DataSample;
use sluice_data::rng::Rng;

use crate::error::EnvError;
use crate::protocol::MessageEnv;
use crate::rubric::ScoreInput;
use crate::task::{DataGenerator, Task};
use crate::tasks::{
    SingleTurnEnv, answer_matches, answer_rubric, draw, field, has_answer, is_heldout,
    train_eval_specs,
};

/// Registered name.
pub const NAME: &str = "arithmetic";

/// System prompt of the task.
pub const SYSTEM_PROMPT: &str = "Answer with the number only.";

/// One problem: `(a, op, b)` and its answer.
pub fn answer(a: i64, op: char, b: i64) -> i64 {
    match op {
        '+' => a + b,
        '-' => a - b,
        _ => a * b,
    }
}

/// Every problem of the task, in a fixed order (for exhaustive evaluation).
pub fn all_problems() -> Vec<(i64, char, i64)> {
    let mut out = Vec::new();
    for op in ['+', '-'] {
        for a in 0..=9 {
            for b in 0..=9 {
                out.push((a, op, b));
            }
        }
    }
    out
}

/// The input JSON of a problem.
pub fn problem_input(a: i64, op: char, b: i64) -> serde_json::Value {
    json!({"question": format!("{a}{op}{b}="), "answer": answer(a, op, b)})
}

/// The whole held-out split, each problem once, in a fixed order: the evaluation set whose
/// accuracy a run reports (it never appears in `train`, whatever the seed).
pub fn heldout_samples() -> Vec<DataSample> {
    all_problems()
        .into_iter()
        .filter(|&(a, op, b)| is_heldout(&format!("{a}{op}{b}")))
        .enumerate()
        .map(|(i, (a, op, b))| DataSample {
            id: format!("heldout-{i}"),
            domain: "math".into(),
            dataset: "arithmetic@eval".into(),
            input: problem_input(a, op, b),
            system_prompt: None,
        })
        .collect()
}

/// Generates problems of the `train` / `eval` split.
#[derive(Debug, Clone, Copy, Default)]
pub struct Generator;

impl DataGenerator for Generator {
    fn generate(&self, split: &str, seed: u64, count: usize) -> Result<Vec<DataSample>, EnvError> {
        let problems = all_problems();
        draw(NAME, split, seed, count, |rng: &mut Rng| {
            let (a, op, b) = problems[rng.below(problems.len() as u64) as usize];
            (format!("{a}{op}{b}"), problem_input(a, op, b))
        })
    }

    fn heldout(&self) -> Option<Vec<DataSample>> {
        Some(heldout_samples())
    }
}

/// The reference reply: the answer alone.
fn reference(sample: &DataSample, turn: u32) -> Option<String> {
    if turn > 0 {
        return None;
    }
    field::<i64>(sample, "answer").ok().map(|a| a.to_string())
}

/// The reply parsed as one integer.
pub fn parse_reply(text: &str) -> Option<i64> {
    text.trim().parse().ok()
}

fn env(sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
    let question: String = field(sample, "question")?;
    let _: i64 = field(sample, "answer")?;
    Ok(Box::new(SingleTurnEnv { prompt: question }))
}

fn correct(input: &ScoreInput) -> f64 {
    answer_matches(input, parse_reply)
}

fn format(input: &ScoreInput) -> f64 {
    has_answer(input, parse_reply)
}

/// The task.
pub fn task() -> Task {
    Task::new(NAME, env, answer_rubric(correct, format, Some(0.0)))
        .with_system_prompt(SYSTEM_PROMPT)
        .with_datasets(train_eval_specs("math", "arithmetic"))
        .with_generator(Generator)
        .with_reference(reference)
}
