//! The episode the tool tasks share: one user question, then turns that either call tools (each
//! call answered by a tool message) or answer, ending at the first reply without a call. A task
//! supplies its `Toolbox`: the tools it declares and how a call is answered.
//!
//! Situation labels per stage: `tool_call` (every call of the turn succeeded), `tool_error`
//! (unknown tool, bad arguments, a failed call: the tool answers the error text), `answer` (the
//! final reply), `tool_budget` (more calls than [`MAX_TOOL_CALLS`]; the episode ends).

use sluice_core::{Message, ToolSpec};

use crate::error::EnvError;
use crate::protocol::{BoxFuture, EnvInit, EnvStep, MessageEnv};
use crate::rubric::{Rubric, ScoreInput};
use crate::tasks::{answer_matches, answer_rubric, has_answer, parse_answer_tag};

/// Tool calls answered per episode.
pub const MAX_TOOL_CALLS: u32 = 4;

/// A task's tools: what the episode declares and how it answers a call.
pub(crate) trait Toolbox: Send + std::fmt::Debug + 'static {
    /// The tools declared to the model.
    fn specs(&self) -> Vec<ToolSpec>;

    /// The tool's reply to a call of `name` with JSON `arguments`; an error is answered to the
    /// model as `error: …`.
    fn call(&self, name: &str, arguments: &str) -> Result<String, String>;

    /// Named reward components reported on the episode's first call, from its `arguments`.
    fn first_call_components(&self, _arguments: &str) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
}

/// One episode: `question` as the user's message, calls answered by `tools`.
#[derive(Debug)]
pub(crate) struct ToolEnv<T> {
    question: String,
    tools: T,
    calls: u32,
}

impl<T: Toolbox> ToolEnv<T> {
    pub(crate) fn new(question: impl Into<String>, tools: T) -> Self {
        Self {
            question: question.into(),
            tools,
            calls: 0,
        }
    }
}

impl<T: Toolbox> MessageEnv for ToolEnv<T> {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        Box::pin(async move {
            Ok(EnvInit {
                messages: vec![Message::user(self.question.clone())],
                tools: self.tools.specs(),
            })
        })
    }

    fn step(&mut self, assistant: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        Box::pin(async move {
            if assistant.tool_calls.is_empty() {
                return Ok(EnvStep::done().with_situation("answer"));
            }
            let first_call = self.calls == 0;
            let mut replies = Vec::new();
            let mut any_error = false;
            for call in &assistant.tool_calls {
                if self.calls >= MAX_TOOL_CALLS {
                    return Ok(EnvStep {
                        messages: replies,
                        done: true,
                        ..EnvStep::default()
                    }
                    .with_situation("tool_budget"));
                }
                self.calls += 1;
                let text = match self
                    .tools
                    .call(&call.function.name, &call.function.arguments)
                {
                    Ok(v) => v,
                    Err(e) => {
                        any_error = true;
                        format!("error: {e}")
                    }
                };
                let mut reply = Message::tool(call.id.clone(), text);
                reply.name = Some(call.function.name.clone());
                replies.push(reply);
            }
            let situation = if any_error { "tool_error" } else { "tool_call" };
            let mut step = EnvStep::reply(replies).with_situation(situation);
            if first_call {
                let arguments = assistant.tool_calls[0].function.arguments.as_str();
                for (name, value) in self.tools.first_call_components(arguments) {
                    step = step.with_component(name, value);
                }
            }
            Ok(step)
        })
    }
}

/// The string argument `key` of a call's JSON `arguments`.
pub(crate) fn string_argument(arguments: &str, key: &str) -> Result<String, String> {
    let args: serde_json::Value =
        serde_json::from_str(arguments).map_err(|e| format!("arguments are not JSON: {e}"))?;
    args.get(key)
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| format!("missing string argument `{key}`"))
}

/// The reference text of a call: what a model writes to call `name` with `arguments`.
pub(crate) fn call_text(name: &str, arguments: serde_json::Value) -> String {
    let call = serde_json::json!({"name": name, "arguments": arguments});
    format!("<tool_call>{call}</tool_call>")
}

/// The tool tasks' rubric: `correct` when the episode ended on an answer (not a call or the call
/// budget) whose `[ANSWER] n` is the sample's `answer` (weight 1), `format` when the final reply
/// has an `[ANSWER]` tag (0.1); a truncated episode scores 0.
pub(crate) fn answer_tag_rubric() -> Rubric {
    answer_rubric(correct, format, Some(0.0))
}

fn correct(input: &ScoreInput) -> f64 {
    let ended_on_answer = input
        .rollout
        .turns
        .last()
        .and_then(|t| t.situation.as_deref())
        == Some("answer");
    if ended_on_answer {
        answer_matches(input, parse_answer_tag)
    } else {
        0.0
    }
}

fn format(input: &ScoreInput) -> f64 {
    has_answer(input, parse_answer_tag)
}
