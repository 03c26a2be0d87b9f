//! `qa`: single-turn question answering over dataset rows (JSONL under `data_dir`), the generic
//! task of other frameworks: each row holds a question, a reference answer and optionally its own
//! system prompt; the model answers once and is scored on its final answer.
//!
//! Field names come from the domain (`question_field`, `answer_field`, `system_prompt_field`;
//! default `question`, `answer`, `system_prompt`), so a GSM8K file
//! (`{"question": …, "answer": "…reasoning…\n#### 72"}`) loads as it is: the reference answer is
//! the text after the last `####` of the answer field, else the whole field ([`crate::answer`]).
//! A row's system prompt field wins over the domain's and the task's.
//!
//! verl's rows load as they are too: a field name may be a dotted path into nested objects
//! (`answer_field = "reward_model.ground_truth"`), and the question field may hold the chat
//! messages of the prompt (`"prompt": [{"role": "user", "content": …}]`, a system message of its
//! own included) instead of one question.
//!
//! Rewards: `correct` (weight 1: the reply's math answer equals the reference's, as numbers — a
//! reference without a number must match as text) and `format` (weight 0.1: the reply marks its
//! answer with the domain's `answer_marker`, `#### <number>` or `\boxed{}`); truncated replies
//! score 0. The generic `math_answer`, `exact_match`, `regex` read the same answer field.
//! Reference reply (warm-start): the answer field's reasoning with GSM8K's calculator notes
//! (`<<48/2=24>>`) removed, then the marked answer.
//!
//! The task has no data of its own: name it as a domain's `task` and list that domain's files.

use std::sync::Arc;

use serde_json::Value;
use sluice_core::{DataSample, Message, Role};
use sluice_data::config::{AnswerMarker, DomainConfig};

use crate::answer;
use crate::error::EnvError;
use crate::protocol::{BoxFuture, EnvInit, EnvStep, MessageEnv};
use crate::reward_fns::{AnswerOptions, reference_text, sample_field};
use crate::rubric::{RewardFn, Rubric, RubricConfig};
use crate::task::Task;
use crate::token_env::opening_messages;

/// Registered name.
pub const NAME: &str = "qa";

/// Where a row's parts are, and how replies mark their answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QaOptions {
    /// The row field holding the question.
    pub question_field: String,
    /// The row field holding the reference answer.
    pub answer_field: String,
    /// The row field holding a per-row system prompt.
    pub system_prompt_field: String,
    /// How replies mark their final answer.
    pub marker: AnswerMarker,
}

impl Default for QaOptions {
    /// `question`, `answer`, `system_prompt`, `####`.
    fn default() -> Self {
        Self {
            question_field: "question".into(),
            answer_field: "answer".into(),
            system_prompt_field: "system_prompt".into(),
            marker: AnswerMarker::Hashes,
        }
    }
}

impl QaOptions {
    /// The options a domain's keys set (the defaults for those it leaves out).
    pub fn from_domain(domain: &DomainConfig) -> Self {
        let d = Self::default();
        Self {
            question_field: domain.question_field.clone().unwrap_or(d.question_field),
            answer_field: domain.answer_field.clone().unwrap_or(d.answer_field),
            system_prompt_field: domain
                .system_prompt_field
                .clone()
                .unwrap_or(d.system_prompt_field),
            marker: domain.answer_marker.unwrap_or(d.marker),
        }
    }

    /// What the generic answer functions read on this task's rows.
    pub fn answer_options(&self) -> AnswerOptions {
        AnswerOptions {
            answer_field: self.answer_field.clone(),
            marker: self.marker,
            regex: None,
            judge: None,
            reward_model: None,
        }
    }
}

/// The task's system prompt for `marker`.
pub fn system_prompt(marker: AnswerMarker) -> &'static str {
    match marker {
        AnswerMarker::Hashes => "Answer the question. Write the final answer after ####.",
        AnswerMarker::Boxed => "Answer the question. Put the final answer in \\boxed{}.",
    }
}

/// The string field `key` of a row, `None` when absent or null.
fn text_field(sample: &DataSample, key: &str) -> Result<Option<String>, EnvError> {
    match sample_field(&sample.input, key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(EnvError::BadInput(format!(
            "sample `{}`: `{key}` must be a string, got {}",
            sample.id,
            crate::reward_fns::excerpt(other)
        ))),
    }
}

/// The question field of a row as the messages it opens with: a string (one user message), or a
/// list of `{role, content}` messages of the roles `system`, `user` and `assistant` with text
/// content, ending with the user's (verl's `prompt`).
fn question(sample: &DataSample, key: &str) -> Result<Vec<Message>, EnvError> {
    let bad = |what: String| EnvError::BadInput(format!("sample `{}`: `{key}` {what}", sample.id));
    match sample_field(&sample.input, key) {
        None | Some(Value::Null) => Err(EnvError::BadInput(format!(
            "sample `{}` has no question field `{key}`",
            sample.id
        ))),
        Some(Value::String(s)) => Ok(vec![Message::user(s.clone())]),
        Some(list @ Value::Array(_)) => {
            let messages: Vec<Message> = serde_json::from_value(list.clone()).map_err(|e| {
                bad(format!(
                    "must be a string or a list of {{role, content}} messages: {e}"
                ))
            })?;
            for (i, m) in messages.iter().enumerate() {
                if m.role == Role::Tool || m.content.is_none() || !m.tool_calls.is_empty() {
                    return Err(bad(format!(
                        "message {i}: expected a system, user or assistant message with text content"
                    )));
                }
            }
            match messages.last() {
                Some(m) if m.role == Role::User => Ok(messages),
                _ => Err(bad("must end with a user message".into())),
            }
        }
        Some(other) => Err(bad(format!(
            "must be a string or a list of messages, got {}",
            crate::reward_fns::excerpt(other)
        ))),
    }
}

/// A one-turn env opening with the row's own system prompt (when its field holds one, and the
/// question's messages bring none of their own) and the question.
struct QaEnv {
    system: Option<String>,
    question: Vec<Message>,
}

impl MessageEnv for QaEnv {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        let messages = opening_messages(self.system.as_deref(), self.question.clone());
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

/// The env of one row: its question is required, and so is its reference answer (a row without
/// one could only score 0).
fn make_env(options: &QaOptions, sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
    let question = question(sample, &options.question_field)?;
    match sample_field(&sample.input, &options.answer_field) {
        Some(Value::String(_) | Value::Number(_)) => {}
        _ => {
            return Err(EnvError::BadInput(format!(
                "sample `{}` has no reference answer `{}` (a string or a number)",
                sample.id, options.answer_field
            )));
        }
    }
    // The data crate already moved a `system_prompt` field into the sample; another field name
    // is read here, and wins over the domain's and the task's prompt as a row's own does.
    let system = match sample.system_prompt {
        Some(_) => None,
        None => text_field(sample, &options.system_prompt_field)?.filter(|p| !p.is_empty()),
    };
    Ok(Box::new(QaEnv { system, question }))
}

/// `text` without GSM8K's calculator notes (`48/2 = <<48/2=24>>24` → `48/2 = 24`).
pub fn strip_calculator_notes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find("<<") {
        let Some(close) = rest[open..].find(">>") else {
            break;
        };
        out.push_str(&rest[..open]);
        rest = &rest[open + close + 2..];
    }
    out.push_str(rest);
    out
}

/// The reference reply of a row: the answer field's reasoning (before its last `####`, without
/// calculator notes), then the reference answer with the marker; a field without `####` that
/// boxes its answer is the reply as it is; a bare answer (`4`) gets the marker alone.
pub fn reference_reply(answer_field: &str, marker: AnswerMarker) -> String {
    let working = match answer_field.rsplit_once("####") {
        Some((before, _)) => strip_calculator_notes(before).trim().to_owned(),
        // A solution that already boxes its answer (the MATH dataset's) is its own reply.
        None if answer::last_boxed(answer_field).is_some() => {
            return strip_calculator_notes(answer_field).trim().to_owned();
        }
        None => String::new(),
    };
    let last = answer::with_marker(answer::reference_answer(answer_field), marker);
    if working.is_empty() {
        last
    } else {
        format!("{working}\n{last}")
    }
}

/// The rubric: `correct` (math answer, 1) and `format` (the marker, 0.1); truncated replies 0.
fn rubric(options: &QaOptions) -> Rubric {
    let field = options.answer_field.clone();
    let marker = options.marker;
    let correct = RewardFn::inline_fallible("correct", 1.0, move |input| {
        let reference = reference_text(input, &field)?;
        let reply = input.final_text().unwrap_or("");
        Ok(f64::from(u8::from(answer::math_answer_matches(
            reply, &reference,
        ))))
    });
    let format = RewardFn::inline("format", 0.1, move |input| {
        let reply = input.final_text().unwrap_or("");
        f64::from(u8::from(answer::has_marker(reply, marker)))
    });
    Rubric::new(
        vec![correct, format],
        RubricConfig {
            truncation_reward: Some(0.0),
            error_reward: Some(0.0),
            ..RubricConfig::default()
        },
    )
    .expect("static rubric is valid")
}

/// The task with the default options (registered as `qa`).
pub fn task() -> Task {
    task_with(QaOptions::default())
}

/// The task reading rows as `options` says.
pub fn task_with(options: QaOptions) -> Task {
    let options = Arc::new(options);
    let env_options = Arc::clone(&options);
    let reference_options = Arc::clone(&options);
    Task::new(
        NAME,
        move |sample: &DataSample| make_env(&env_options, sample),
        rubric(&options),
    )
    .with_system_prompt(system_prompt(options.marker))
    .with_reference(move |sample: &DataSample, turn: u32| {
        if turn > 0 {
            return None;
        }
        let answer = match sample_field(&sample.input, &reference_options.answer_field)? {
            Value::String(s) => s.clone(),
            Value::Number(n) => crate::answer::number_text(n),
            _ => return None,
        };
        Some(reference_reply(&answer, reference_options.marker))
    })
}
