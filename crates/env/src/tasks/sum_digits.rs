//! `sum_digits`: single turn; sum the digits of a 2–6 digit number and end with `[ANSWER] n`.
//! Rewards: `correct` (the last `[ANSWER]` equals the digit sum, weight 1) and `format` (an
//! `[ANSWER]` tag with an integer is present, weight 0.1).

use serde_json::json;
use sluice_core::DataSample;
use sluice_data::rng::Rng;

use crate::error::EnvError;
use crate::protocol::MessageEnv;
use crate::rubric::ScoreInput;
use crate::task::{DataGenerator, Task};
use crate::tasks::{
    SingleTurnEnv, answer_matches, answer_rubric, draw, field, has_answer, parse_answer_tag,
    train_eval_specs,
};

/// Registered name.
pub const NAME: &str = "sum_digits";

/// System prompt of the task.
pub const SYSTEM_PROMPT: &str = "Think briefly, then end your reply with `[ANSWER] <number>`.";

/// Digit sum of a decimal string.
pub fn digit_sum(number: &str) -> i64 {
    number
        .bytes()
        .filter(u8::is_ascii_digit)
        .map(|b| i64::from(b - b'0'))
        .sum()
}

/// Generates numbers of the `train` / `eval` split.
#[derive(Debug, Clone, Copy, Default)]
pub struct Generator;

impl DataGenerator for Generator {
    fn generate(&self, split: &str, seed: u64, count: usize) -> Result<Vec<DataSample>, EnvError> {
        draw(NAME, split, seed, count, |rng: &mut Rng| {
            let digits = 2 + rng.below(5) as u32;
            let lo = 10u64.pow(digits - 1);
            let n = lo + rng.below(9 * lo);
            let number = n.to_string();
            let input = json!({"number": number, "answer": digit_sum(&number)});
            (number, input)
        })
    }
}

fn env(sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
    let number: String = field(sample, "number")?;
    Ok(Box::new(SingleTurnEnv {
        prompt: format!("What is the sum of the digits of {number}?"),
    }))
}

fn correct(input: &ScoreInput) -> f64 {
    answer_matches(input, parse_answer_tag)
}

fn format(input: &ScoreInput) -> f64 {
    has_answer(input, parse_answer_tag)
}

/// The reference reply: the digits added up, then the tag.
fn reference(sample: &DataSample, turn: u32) -> Option<String> {
    if turn > 0 {
        return None;
    }
    let number: String = field(sample, "number").ok()?;
    let digits: Vec<String> = number.chars().map(String::from).collect();
    Some(format!(
        "{} = {}\n[ANSWER] {}",
        digits.join(" + "),
        digit_sum(&number),
        digit_sum(&number)
    ))
}

/// The task.
pub fn task() -> Task {
    Task::new(NAME, env, answer_rubric(correct, format, None))
        .with_system_prompt(SYSTEM_PROMPT)
        .with_datasets(train_eval_specs("math", "sum_digits"))
        .with_generator(Generator)
        .with_reference(reference)
}
