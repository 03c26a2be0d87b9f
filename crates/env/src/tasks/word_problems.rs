//! `word_problems`: single-turn grade-school word problems with whole-number answers, written
//! as sentences ("Ana has 20 pens and gets 9 more. How many pens does Ana have now?") for
//! instruct models that reason in words and end with `#### <answer>`.
//!
//! Problems come from templates of four kinds — addition, subtraction, multiplication and two
//! steps — over small name and item lists, with operands 2–20 (addition, subtraction) and 2–12
//! (multiplication), so a 135M-parameter model has a chance. Answers are integers ≥ 0.
//!
//! The held-out `eval` split is disjoint from `train` by construction: a problem's split is a
//! hash of its *numbers* (those of its text, in order, and its answer), so a held-out problem's
//! numbers never appear in training under any name, item or wording.
//!
//! Rewards: `correct` (weight 1: the reply's math answer — last `\boxed{}`, else after the last
//! `####`, else its last number — equals the answer, [`crate::answer`]) and `format` (weight 0.1:
//! the reply ends its reasoning with `#### <number>`). Truncated replies score 0.

use serde_json::json;
use sluice_core::DataSample;
use sluice_data::config::AnswerMarker;
use sluice_data::rng::Rng;

use crate::answer;
use crate::error::EnvError;
use crate::protocol::MessageEnv;
use crate::rubric::ScoreInput;
use crate::task::{DataGenerator, Task};
use crate::tasks::{SingleTurnEnv, answer_rubric, draw, field, is_heldout, train_eval_specs};

/// Registered name.
pub const NAME: &str = "word_problems";

/// System prompt of the task.
pub const SYSTEM_PROMPT: &str = "Solve the problem. Write the final answer as a number after ####.";

const NAMES: &[&str] = &[
    "Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kemi", "Liam",
    "Mia", "Noah", "Omar", "Priya",
];

const ITEMS: &[&str] = &[
    "pens", "apples", "stickers", "marbles", "books", "cookies", "shells", "cards", "coins",
    "balloons", "pencils", "stamps",
];

/// (container, its plural, what it holds).
const CONTAINERS: &[(&str, &str, &str)] = &[
    ("box", "boxes", "eggs"),
    ("bag", "bags", "apples"),
    ("pack", "packs", "cards"),
    ("jar", "jars", "cookies"),
    ("shelf", "shelves", "books"),
    ("row", "rows", "chairs"),
    ("basket", "baskets", "oranges"),
    ("tray", "trays", "cupcakes"),
];

/// One problem: its text, its answer, and the reference solution's working (`20 + 9 = 29.`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The question.
    pub question: String,
    /// The answer, ≥ 0.
    pub answer: u64,
    /// The steps of the reference solution, before the `#### answer` line.
    pub working: String,
}

fn pick<'a, T>(rng: &mut Rng, items: &'a [T]) -> &'a T {
    &items[rng.below(items.len() as u64) as usize]
}

/// A number in `lo..=hi`.
fn between(rng: &mut Rng, lo: u64, hi: u64) -> u64 {
    lo + rng.below(hi - lo + 1)
}

/// Two different names.
fn two_names(rng: &mut Rng) -> (&'static str, &'static str) {
    let a = *pick(rng, NAMES);
    loop {
        let b = *pick(rng, NAMES);
        if b != a {
            return (a, b);
        }
    }
}

/// Draws one problem: addition, subtraction, multiplication or two steps, equally often.
pub fn problem(rng: &mut Rng) -> Problem {
    let (n, m) = two_names(rng);
    let item = *pick(rng, ITEMS);
    let &(one, many, held) = pick(rng, CONTAINERS);
    let wording = rng.below(2) == 0;
    match rng.below(4) {
        0 => {
            let (a, b) = (between(rng, 2, 20), between(rng, 2, 20));
            let question = if wording {
                format!("{n} has {a} {item} and gets {b} more. How many {item} does {n} have now?")
            } else {
                format!(
                    "{n} has {a} {item}. {m} gives {n} {b} more. How many {item} does {n} have now?"
                )
            };
            Problem {
                question,
                answer: a + b,
                working: format!("{a} + {b} = {}.", a + b),
            }
        }
        1 => {
            let a = between(rng, 2, 20);
            let b = between(rng, 2, a);
            let question = if wording {
                format!(
                    "{n} has {a} {item} and gives {b} to {m}. How many {item} does {n} have left?"
                )
            } else {
                format!(
                    "There are {a} {item} on the table. {n} takes {b} of them. How many {item} are left on the table?"
                )
            };
            Problem {
                question,
                answer: a - b,
                working: format!("{a} - {b} = {}.", a - b),
            }
        }
        2 => {
            let (a, b) = (between(rng, 2, 12), between(rng, 2, 12));
            let (question, working) = if wording {
                (
                    format!("A {one} holds {a} {held}. How many {held} are in {b} {many}?"),
                    format!("{b} * {a} = {}.", a * b),
                )
            } else {
                (
                    format!(
                        "{n} buys {b} {many} of {held}. Each {one} has {a} {held}. How many {held} does {n} buy?"
                    ),
                    format!("{b} * {a} = {}.", a * b),
                )
            };
            Problem {
                question,
                answer: a * b,
                working,
            }
        }
        _ if wording => {
            let (a, b) = (between(rng, 2, 20), between(rng, 2, 20));
            let c = between(rng, 2, (a + b).min(20));
            let s = a + b;
            Problem {
                question: format!(
                    "{n} has {a} {item}, buys {b} more, then gives {c} to {m}. How many {item} does {n} have now?"
                ),
                answer: s - c,
                working: format!("{a} + {b} = {s}. {s} - {c} = {}.", s - c),
            }
        }
        _ => {
            let (a, b, c) = (
                between(rng, 2, 12),
                between(rng, 2, 12),
                between(rng, 2, 20),
            );
            let p = a * b;
            Problem {
                question: format!(
                    "A {one} holds {a} {held}. {n} has {b} full {many} and {c} more {held}. How many {held} does {n} have in all?"
                ),
                answer: p + c,
                working: format!("{b} * {a} = {p}. {p} + {c} = {}.", p + c),
            }
        }
    }
}

/// The split key of a problem: the numbers of its question, in order, and its answer
/// (`20,9=29`). Problems sharing their numbers share their split, whatever their wording.
pub fn split_key(question: &str, answer: u64) -> String {
    let numbers: Vec<String> = answer::numbers(question)
        .iter()
        .map(|n| n.to_string())
        .collect();
    format!("{}={answer}", numbers.join(","))
}

/// Whether a problem belongs to the held-out `eval` split.
pub fn is_heldout_problem(question: &str, answer: u64) -> bool {
    is_heldout(&split_key(question, answer))
}

/// Generates problems of the `train` / `eval` split.
#[derive(Debug, Clone, Copy, Default)]
pub struct Generator;

impl DataGenerator for Generator {
    fn generate(&self, split: &str, seed: u64, count: usize) -> Result<Vec<DataSample>, EnvError> {
        draw(NAME, split, seed, count, |rng: &mut Rng| {
            let p = problem(rng);
            let key = split_key(&p.question, p.answer);
            let input = json!({"question": p.question, "answer": p.answer, "working": p.working});
            (key, input)
        })
    }
}

/// The reference reply: the working, then `#### answer` (`20 + 9 = 29.\n#### 29`).
fn reference(sample: &DataSample, turn: u32) -> Option<String> {
    if turn > 0 {
        return None;
    }
    let answer: u64 = field(sample, "answer").ok()?;
    let working: String = field(sample, "working").unwrap_or_default();
    let last = answer::with_marker(&answer.to_string(), AnswerMarker::Hashes);
    Some(if working.is_empty() {
        last
    } else {
        format!("{working}\n{last}")
    })
}

fn env(sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
    let question: String = field(sample, "question")?;
    let _: u64 = field(sample, "answer")?;
    Ok(Box::new(SingleTurnEnv { prompt: question }))
}

fn correct(input: &ScoreInput) -> f64 {
    let expected: Option<u64> = field(&input.sample, "answer").ok();
    let got = input.final_text().and_then(answer::math_answer);
    f64::from(u8::from(matches!(
        (got, expected),
        (Some(g), Some(e)) if answer::numbers_equal(g, e as f64)
    )))
}

fn format(input: &ScoreInput) -> f64 {
    let marked = input
        .final_text()
        .is_some_and(|t| answer::has_marker(t, AnswerMarker::Hashes));
    f64::from(u8::from(marked))
}

/// The task.
pub fn task() -> Task {
    Task::new(NAME, env, answer_rubric(correct, format, Some(0.0)))
        .with_system_prompt(SYSTEM_PROMPT)
        .with_datasets(train_eval_specs("math", NAME))
        .with_generator(Generator)
        .with_reference(reference)
}
