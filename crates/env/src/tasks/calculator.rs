//! `calculator_tool`: multi-turn tool use. The model is asked to compute an expression such as
//! `(37 * 12) - 5`; it may call the `calc` tool with
//! `<tool_call>{"name": "calc", "arguments": {"expression": "37 * 12"}}</tool_call>`, the env
//! evaluates it and replies with a tool message, and the episode ends at the first reply without a
//! tool call, which must carry `[ANSWER] n`. At most [`MAX_TOOL_CALLS`] calls are answered.
//!
//! Situation labels per stage are the tool episode's ([`super::tool_env`]): `tool_call`,
//! `tool_error` (unknown tool, bad arguments, bad expression), `answer`, `tool_budget`. Rewards: `correct` on the final answer (weight 1), `format` (weight 0.1). The env also
//! reports the named component `copied` on the episode's first `calc` call: the share of the
//! asked expression's tokens (numbers, operators, parentheses) the call reproduces in place. The
//! task's own rubric leaves it out; a config may weight it (`env.copied`) to reward a small
//! model for copying the expression before it can ever reach a correct answer.

use serde_json::json;
use sluice_core::message::FunctionSpec;
use sluice_core::{DataSample, ToolSpec};
use sluice_data::rng::Rng;

use crate::error::EnvError;
use crate::protocol::MessageEnv;
use crate::task::{DataGenerator, Task};
use crate::tasks::tool_env::{ToolEnv, Toolbox, answer_tag_rubric, call_text, string_argument};
use crate::tasks::{draw, field, train_eval_specs};

/// Registered name.
pub const NAME: &str = "calculator_tool";

pub use super::tool_env::MAX_TOOL_CALLS;

/// System prompt of the task.
pub const SYSTEM_PROMPT: &str = "You can use the calc tool. End with `[ANSWER] <number>`.";

/// The `calc` tool's declaration.
pub fn calc_tool() -> ToolSpec {
    ToolSpec {
        kind: "function".into(),
        function: FunctionSpec {
            name: "calc".into(),
            description: "Evaluates an integer expression with + - * / and parentheses.".into(),
            parameters: json!({
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"]
            }),
        },
    }
}

/// Longest expression [`evaluate`] accepts, in characters (whitespace included). The expression
/// comes from a model's tool call or a remote client, so its size is bounded before any work.
pub const MAX_EXPRESSION_CHARS: usize = 4096;

/// Deepest nesting [`evaluate`] accepts: parentheses and unary minuses together. The evaluator
/// recurses once per level; without a bound, 10,000 nested parentheses overflow the stack and
/// abort the whole process (the env server, or the run whose model wrote them).
pub const MAX_EXPRESSION_DEPTH: usize = 64;

/// Evaluates an integer expression (`+ - * /`, parentheses, unary minus; `/` truncates). Longer
/// than [`MAX_EXPRESSION_CHARS`] or nested deeper than [`MAX_EXPRESSION_DEPTH`] is an error, like
/// any other bad expression (the tool answers it to the model).
pub fn evaluate(expr: &str) -> Result<i64, String> {
    let chars = expr.chars().count();
    if chars > MAX_EXPRESSION_CHARS {
        return Err(format!(
            "expression too long: {chars} characters, at most {MAX_EXPRESSION_CHARS}"
        ));
    }
    let tokens: Vec<char> = expr.chars().filter(|c| !c.is_whitespace()).collect();
    let mut p = Parser {
        t: &tokens,
        i: 0,
        depth: 0,
    };
    let v = p.sum()?;
    if p.i != tokens.len() {
        return Err(format!("unexpected `{}` at position {}", tokens[p.i], p.i));
    }
    Ok(v)
}

struct Parser<'a> {
    t: &'a [char],
    i: usize,
    /// Nesting levels entered (parentheses and unary minuses) on the current path.
    depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.t.get(self.i).copied()
    }

    fn sum(&mut self) -> Result<i64, String> {
        let mut v = self.product()?;
        while let Some(op @ ('+' | '-')) = self.peek() {
            self.i += 1;
            let r = self.product()?;
            v = if op == '+' {
                v.checked_add(r)
            } else {
                v.checked_sub(r)
            }
            .ok_or("overflow")?;
        }
        Ok(v)
    }

    fn product(&mut self) -> Result<i64, String> {
        let mut v = self.atom()?;
        while let Some(op @ ('*' | '/')) = self.peek() {
            self.i += 1;
            let r = self.atom()?;
            v = if op == '*' {
                v.checked_mul(r).ok_or("overflow")?
            } else if r == 0 {
                return Err("division by zero".into());
            } else {
                v.checked_div(r).ok_or("overflow")?
            };
        }
        Ok(v)
    }

    /// Enters one nesting level, refusing past [`MAX_EXPRESSION_DEPTH`].
    fn descend(&mut self) -> Result<(), String> {
        self.depth += 1;
        if self.depth > MAX_EXPRESSION_DEPTH {
            return Err(format!(
                "expression nested too deeply: more than {MAX_EXPRESSION_DEPTH} levels of parentheses or unary minus"
            ));
        }
        Ok(())
    }

    fn atom(&mut self) -> Result<i64, String> {
        match self.peek() {
            Some('-') => {
                self.i += 1;
                self.descend()?;
                let v = self.atom()?.checked_neg().ok_or("overflow")?;
                self.depth -= 1;
                Ok(v)
            }
            Some('(') => {
                self.i += 1;
                self.descend()?;
                let v = self.sum()?;
                if self.peek() != Some(')') {
                    return Err("missing `)`".into());
                }
                self.i += 1;
                self.depth -= 1;
                Ok(v)
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.i;
                while self.peek().is_some_and(|c| c.is_ascii_digit()) {
                    self.i += 1;
                }
                let s: String = self.t[start..self.i].iter().collect();
                s.parse().map_err(|_| format!("number `{s}` too large"))
            }
            Some(c) => Err(format!("unexpected `{c}` at position {}", self.i)),
            None => Err("unexpected end of expression".into()),
        }
    }
}

/// Generates `(a op b) op c` problems of the `train` / `eval` split.
#[derive(Debug, Clone, Copy, Default)]
pub struct Generator;

impl DataGenerator for Generator {
    fn generate(&self, split: &str, seed: u64, count: usize) -> Result<Vec<DataSample>, EnvError> {
        draw(NAME, split, seed, count, |rng: &mut Rng| {
            let ops = ['+', '-', '*'];
            let a = 2 + rng.below(98) as i64;
            let b = 2 + rng.below(98) as i64;
            let c = 2 + rng.below(98) as i64;
            let o1 = ops[rng.below(3) as usize];
            let o2 = ops[rng.below(3) as usize];
            let expression = format!("({a} {o1} {b}) {o2} {c}");
            let answer = evaluate(&expression).unwrap_or_default();
            (
                expression.clone(),
                json!({"expression": expression, "answer": answer}),
            )
        })
    }
}

/// The `calc` tool of one episode asking for `expression`.
#[derive(Debug)]
struct Calc {
    expression: String,
}

impl Toolbox for Calc {
    fn specs(&self) -> Vec<ToolSpec> {
        vec![calc_tool()]
    }

    fn call(&self, name: &str, arguments: &str) -> Result<String, String> {
        if name != "calc" {
            return Err(format!("unknown tool `{name}`; the only tool is `calc`"));
        }
        evaluate(&string_argument(arguments, "expression")?).map(|v| v.to_string())
    }

    fn first_call_components(&self, arguments: &str) -> Vec<(&'static str, f64)> {
        vec![("copied", self.copied(arguments))]
    }
}

/// An expression's tokens: numbers, operators and parentheses (whitespace dropped).
fn expression_tokens(expr: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = expr.trim_start();
    while let Some(c) = rest.chars().next() {
        let len = if c.is_ascii_digit() {
            rest.find(|ch: char| !ch.is_ascii_digit())
                .unwrap_or(rest.len())
        } else {
            c.len_utf8()
        };
        out.push(&rest[..len]);
        rest = rest[len..].trim_start();
    }
    out
}

impl Calc {
    /// The share of the asked expression's tokens that a call's `arguments` reproduce at the
    /// same place (0 when they are not JSON with a string `expression`).
    fn copied(&self, arguments: &str) -> f64 {
        let called = string_argument(arguments, "expression").unwrap_or_default();
        let want = expression_tokens(&self.expression);
        let got = expression_tokens(&called);
        let same = want.iter().zip(&got).filter(|(a, b)| a == b).count();
        same as f64 / want.len().max(got.len()).max(1) as f64
    }
}

/// The reference episode: one `calc` call on the whole expression, then the tool's result as the
/// answer.
fn reference(sample: &DataSample, turn: u32) -> Option<String> {
    match turn {
        0 => {
            let expression: String = field(sample, "expression").ok()?;
            Some(call_text("calc", json!({ "expression": expression })))
        }
        1 => Some(format!("[ANSWER] {}", field::<i64>(sample, "answer").ok()?)),
        _ => None,
    }
}

fn env(sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
    let expression: String = field(sample, "expression")?;
    Ok(Box::new(ToolEnv::new(
        format!("Compute {expression}."),
        Calc { expression },
    )))
}

/// The task.
pub fn task() -> Task {
    Task::new(NAME, env, answer_tag_rubric())
        .with_system_prompt(SYSTEM_PROMPT)
        .with_datasets(train_eval_specs("tools", "calculator_tool"))
        .with_reference(reference)
        .with_generator(Generator)
}

#[cfg(test)]
mod tests {
    use sluice_core::Message;

    use super::*;

    #[test]
    fn copied_is_the_share_of_the_expression_reproduced_in_place() {
        let env = Calc {
            expression: "(37 * 12) - 5".into(),
        };
        let args = |e: &str| json!({ "expression": e }).to_string();
        assert_eq!(env.copied(&args("(37 * 12) - 5")), 1.0);
        assert_eq!(env.copied(&args("(37*12)-5")), 1.0);
        // Numbers wrong, structure right: 4 of 7 tokens.
        assert!((env.copied(&args("(36 * 23) - 58")) - 4.0 / 7.0).abs() < 1e-12);
        // Extra tokens count against it.
        assert!((env.copied(&args("(37 * 12) - 5 + 1")) - 7.0 / 9.0).abs() < 1e-12);
        assert_eq!(env.copied("not json"), 0.0);
        assert_eq!(env.copied(&json!({ "expression": 3 }).to_string()), 0.0);
    }

    #[test]
    fn evaluates_integer_expressions() {
        assert_eq!(evaluate("(37 * 12) - 5"), Ok(439));
        assert_eq!(evaluate("2+3*4"), Ok(14));
        assert_eq!(evaluate("-(2+3)*-2"), Ok(10));
        assert_eq!(evaluate("7/2"), Ok(3));
        assert_eq!(evaluate("1/0"), Err("division by zero".into()));
        assert!(evaluate("2+").is_err());
        assert!(evaluate("(2").is_err());
        assert!(evaluate("2 x 3").is_err());
        assert!(evaluate("9223372036854775807+1").is_err());
    }

    #[test]
    fn nesting_and_size_are_bounded() {
        let nested = |n: usize| format!("{}1{}", "(".repeat(n), ")".repeat(n));
        assert_eq!(evaluate(&nested(MAX_EXPRESSION_DEPTH)), Ok(1));
        // Sibling parentheses do not add up: only the depth of one path counts.
        let siblings = vec![nested(MAX_EXPRESSION_DEPTH); 10].join("+");
        assert_eq!(evaluate(&siblings), Ok(10));
        let err = evaluate(&nested(MAX_EXPRESSION_DEPTH + 1)).unwrap_err();
        assert!(err.contains("nested too deeply"), "{err}");
        // Unary minus recurses too.
        let minuses = format!("{}1", "-".repeat(MAX_EXPRESSION_DEPTH + 1));
        assert!(
            evaluate(&minuses)
                .unwrap_err()
                .contains("nested too deeply")
        );
        let long = format!("1{}", "+1".repeat(MAX_EXPRESSION_CHARS));
        assert!(evaluate(&long).unwrap_err().contains("too long"));
    }

    /// The reported crash: 10,000 nested parentheses overflowed the stack (the process aborted).
    /// Now the model gets a tool error and the episode goes on.
    #[tokio::test]
    async fn a_deeply_nested_tool_call_answers_a_tool_error() {
        let mut env = ToolEnv::new(
            "Compute 1 + 1.",
            Calc {
                expression: "1 + 1".into(),
            },
        );
        env.init().await.unwrap();
        let expression = format!("{}1{}", "(".repeat(10_000), ")".repeat(10_000));
        let mut assistant = Message::assistant("");
        assistant.tool_calls.push(sluice_core::message::ToolCall {
            id: "call_0".into(),
            kind: "function".into(),
            function: sluice_core::message::FunctionCall {
                name: "calc".into(),
                arguments: json!({ "expression": expression }).to_string(),
            },
        });
        let step = env.step(assistant).await.unwrap();
        assert_eq!(step.situation.as_deref(), Some("tool_error"));
        assert!(!step.done);
        let reply = step.messages[0].content.as_deref().unwrap();
        assert!(reply.starts_with("error: expression too long"), "{reply}");
    }
}
