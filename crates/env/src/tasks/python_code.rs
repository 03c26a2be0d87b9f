//! `python_code`: the model answers with a Python program; the env runs it in the
//! sandbox ([`crate::sandbox`]: `python3 -I`, no network, CPU/memory/process/time limits) and
//! checks what it prints. One turn.
//!
//! A sample is `{"problem": "…", "expected_output": "…"}`; the generator asks for sums, products
//! and counts over small ranges. The reply may wrap the program in a ```` ```python ```` fence.
//! Rewards: `correct` (stdout, trimmed, equals `expected_output`, weight 1) and the env's
//! components `env.ran` (the program exited 0) and `env.passed` (it printed the answer).
//!
//! A program that the sandbox kills (CPU, wall clock), that runs out of memory, or that cannot
//! fork fails its rollout (`Error("env_failed")`, the rubric's `error_reward`): the env server
//! and the run go on.

use serde_json::json;
use sluice_core::{DataSample, Message};
use sluice_data::rng::Rng;

use crate::error::EnvError;
use crate::protocol::{BoxFuture, EnvInit, EnvStep, MessageEnv};
use crate::rubric::ScoreInput;
use crate::sandbox::{self, Ending, SandboxLimits};
use crate::task::{DataGenerator, Task};
use crate::tasks::{answer_rubric, draw, field, train_eval_specs};

/// Registered name.
pub const NAME: &str = "python_code";

/// System prompt of the task.
pub const SYSTEM_PROMPT: &str = "Answer with a Python 3 program that prints the answer.";

/// The interpreter, isolated from the user's site-packages and environment (`-I`), reading the
/// program from stdin.
const PYTHON: (&str, &[&str]) = ("python3", &["-I", "-"]);

/// Generates problems of the `train` / `eval` split.
#[derive(Debug, Clone, Copy, Default)]
pub struct Generator;

impl DataGenerator for Generator {
    fn generate(&self, split: &str, seed: u64, count: usize) -> Result<Vec<DataSample>, EnvError> {
        draw(NAME, split, seed, count, |rng: &mut Rng| {
            let a = 1 + rng.below(50) as i64;
            let b = a + 1 + rng.below(50) as i64;
            let (problem, answer) = match rng.below(3) {
                0 => (
                    format!("Print the sum of the integers from {a} to {b}."),
                    (a..=b).sum::<i64>(),
                ),
                1 => (
                    format!("Print how many integers from {a} to {b} are even."),
                    (a..=b).filter(|n| n % 2 == 0).count() as i64,
                ),
                _ => (format!("Print {a} times {b}."), a * b),
            };
            (
                problem.clone(),
                json!({"problem": problem, "expected_output": answer.to_string()}),
            )
        })
    }
}

/// The program in a reply: the body of its first ```` ``` ```` fence, else the whole reply.
pub fn program_of(reply: &str) -> &str {
    let Some((_, after)) = reply.split_once("```") else {
        return reply;
    };
    let body = after.split_once('\n').map_or(after, |(lang, rest)| {
        if lang.trim().chars().all(char::is_alphanumeric) {
            rest
        } else {
            after
        }
    });
    body.split_once("```").map_or(body, |(code, _)| code)
}

/// The env of one episode.
#[derive(Debug)]
pub struct CodeEnv {
    problem: String,
    expected_output: String,
    limits: SandboxLimits,
}

impl CodeEnv {
    /// An episode asking for `problem`, whose program must print `expected_output`.
    pub fn new(problem: String, expected_output: String, limits: SandboxLimits) -> Self {
        Self {
            problem,
            expected_output,
            limits,
        }
    }
}

impl MessageEnv for CodeEnv {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        let messages = vec![Message::user(self.problem.clone())];
        Box::pin(async move {
            Ok(EnvInit {
                messages,
                tools: Vec::new(),
            })
        })
    }

    fn step(&mut self, assistant: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        Box::pin(async move {
            let reply = assistant.content.unwrap_or_default();
            let program = program_of(&reply);
            let (python, args) = PYTHON;
            let run = sandbox::run(python, args, program.as_bytes(), &self.limits)
                .await
                .map_err(|e| EnvError::Failed(e.to_string()))?;
            // The program exceeded a limit: the rollout fails (error reward), it is not scored.
            let killed = match run.ending {
                Ending::Signaled(_) | Ending::WallTimeout => true,
                Ending::Exited(_) => resource_error(&run.stderr),
            };
            if killed {
                return Err(EnvError::Failed(format!("sandbox: {}", run.failure())));
            }
            let passed = run.succeeded() && run.stdout.trim() == self.expected_output.trim();
            let ran = f64::from(u8::from(run.succeeded()));
            let passed = f64::from(u8::from(passed));
            Ok(EnvStep::done()
                .with_reward(passed)
                .with_component("ran", ran)
                .with_component("passed", passed)
                .with_situation("answer"))
        })
    }
}

/// Whether a program that exited on its own did so because a limit refused it something
/// (memory, processes): those end the rollout as failed, like a kill.
fn resource_error(stderr: &str) -> bool {
    // Any line: a fork bomb's processes interleave their tracebacks.
    stderr.lines().any(|l| {
        l.starts_with("MemoryError") || l.starts_with("BlockingIOError") && l.contains("Errno 11")
    })
}

fn env(sample: &DataSample, limits: &SandboxLimits) -> Result<Box<dyn MessageEnv>, EnvError> {
    let problem: String = field(sample, "problem")?;
    let expected: String = field(sample, "expected_output")?;
    Ok(Box::new(CodeEnv::new(problem, expected, limits.clone())))
}

fn correct(input: &ScoreInput) -> f64 {
    input
        .rollout
        .reward_components
        .get("env.passed")
        .copied()
        .or_else(|| input.env_reward_sum())
        .unwrap_or(0.0)
}

fn format(input: &ScoreInput) -> f64 {
    f64::from(u8::from(
        input.final_text().is_some_and(|t| t.contains("print")),
    ))
}

/// The reference reply: a program that computes the answer the direct way.
fn reference(sample: &DataSample, turn: u32) -> Option<String> {
    if turn > 0 {
        return None;
    }
    let expected: String = field(sample, "expected_output").ok()?;
    Some(format!("print({expected})"))
}

/// The task, its programs run under the default [`SandboxLimits`].
pub fn task() -> Task {
    task_with(SandboxLimits::default())
}

/// The task, its programs run under `limits` (a domain's `sandbox` table).
pub fn task_with(limits: SandboxLimits) -> Task {
    let env_fn = move |sample: &DataSample| env(sample, &limits);
    Task::new(NAME, env_fn, answer_rubric(correct, format, Some(0.0)))
        .with_system_prompt(SYSTEM_PROMPT)
        .with_datasets(train_eval_specs("code", NAME))
        .with_generator(Generator)
        .with_reference(reference)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_come_out_of_fences() {
        assert_eq!(program_of("print(1)"), "print(1)");
        assert_eq!(
            program_of("Here:\n```python\nprint(2)\n```\ndone"),
            "print(2)\n"
        );
        assert_eq!(program_of("```\nprint(3)\n```"), "print(3)\n");
    }
}
