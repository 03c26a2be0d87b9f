//! Completion text → assistant [`Message`]: `<think>…</think>` reasoning and Hermes/Qwen-style
//! `<tool_call>{"name": …, "arguments": …}</tool_call>` calls. The one parser every renderer uses:
//! the model's chat templates, the env crate's byte renderer and the OpenAI server's replies.
//!
//! Malformed output (an unclosed tag, a call that is not a JSON object with a string `name`) is a
//! [`CompletionParseError`] for that turn; nothing here panics on model output.

use crate::message::FunctionCall;
use crate::{Message, Role, ToolCall};

/// Tags the parser looks for (Qwen / Hermes defaults).
#[derive(Debug, Clone)]
pub struct CompletionParser {
    /// Opens reasoning.
    pub think_open: String,
    /// Closes reasoning.
    pub think_close: String,
    /// Opens a tool call.
    pub tool_open: String,
    /// Closes a tool call.
    pub tool_close: String,
}

impl Default for CompletionParser {
    fn default() -> Self {
        Self {
            think_open: "<think>".into(),
            think_close: "</think>".into(),
            tool_open: "<tool_call>".into(),
            tool_close: "</tool_call>".into(),
        }
    }
}

/// Why a completion could not be turned into a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompletionParseError {
    /// `<think>` without `</think>`.
    #[error("reasoning opened with {0} is never closed")]
    UnclosedReasoning(String),
    /// A tool call opened but not closed.
    #[error("tool call {index} is never closed")]
    UnclosedToolCall {
        /// 0-based index of the call in the completion.
        index: usize,
    },
    /// A closing tool tag without an opening one.
    #[error("`{tag}` at byte {at} closes no tool call")]
    StrayClose {
        /// The tag.
        tag: String,
        /// Byte offset in the completion.
        at: usize,
    },
    /// The body of a call is not valid JSON of the right shape.
    #[error("tool call {index}: {reason}")]
    InvalidToolCall {
        /// 0-based index of the call.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
}

impl CompletionParseError {
    /// Short stable name for metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::UnclosedReasoning(_) => "unclosed_reasoning",
            Self::UnclosedToolCall { .. } => "unclosed_tool_call",
            Self::StrayClose { .. } => "stray_tool_call_close",
            Self::InvalidToolCall { .. } => "invalid_tool_call",
        }
    }
}

impl CompletionParser {
    /// Parses a completion (the generated text, special tokens removed except the tags).
    /// Call ids are `{call_id_prefix}{index}`; pass something unique per turn.
    pub fn parse(&self, text: &str, call_id_prefix: &str) -> Result<Message, CompletionParseError> {
        self.parse_only(text, call_id_prefix, true, true)
    }

    /// [`parse`](Self::parse) looking for `reasoning` only when asked, and for tool calls
    /// only when `tools` were offered: the tags of the other are then plain content.
    pub fn parse_only(
        &self,
        text: &str,
        call_id_prefix: &str,
        reasoning: bool,
        tools: bool,
    ) -> Result<Message, CompletionParseError> {
        let (reasoning, rest) = if reasoning {
            self.split_reasoning(text)?
        } else {
            (None, text)
        };
        let (content, tool_calls) = if tools {
            self.split_tool_calls(rest, call_id_prefix)?
        } else {
            (rest.to_owned(), Vec::new())
        };
        let content = content.trim();
        Ok(Message {
            role: Role::Assistant,
            content: if content.is_empty() && !tool_calls.is_empty() {
                None
            } else {
                Some(content.to_owned())
            },
            reasoning_content: reasoning,
            tool_calls,
            tool_call_id: None,
            name: None,
        })
    }

    /// Reasoning is everything before `</think>` (after an optional `<think>`: templates with
    /// thinking enabled put the opening tag in the prompt), trimmed of newlines.
    fn split_reasoning<'t>(
        &self,
        text: &'t str,
    ) -> Result<(Option<String>, &'t str), CompletionParseError> {
        match text.find(&self.think_close) {
            Some(close) => {
                let before = &text[..close];
                let before = match before.find(&self.think_open) {
                    Some(open) if before[..open].trim().is_empty() => {
                        &before[open + self.think_open.len()..]
                    }
                    _ => before,
                };
                let reasoning = before.trim_matches('\n').to_owned();
                Ok((Some(reasoning), &text[close + self.think_close.len()..]))
            }
            None if text.contains(&self.think_open) => Err(
                CompletionParseError::UnclosedReasoning(self.think_open.clone()),
            ),
            None => Ok((None, text)),
        }
    }

    fn split_tool_calls(
        &self,
        text: &str,
        call_id_prefix: &str,
    ) -> Result<(String, Vec<ToolCall>), CompletionParseError> {
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut rest = text;
        let mut offset = 0;
        loop {
            let open = rest.find(&self.tool_open);
            let close = rest.find(&self.tool_close);
            match (open, close) {
                (None, None) => {
                    content.push_str(rest);
                    break;
                }
                (None, Some(c)) => {
                    return Err(CompletionParseError::StrayClose {
                        tag: self.tool_close.clone(),
                        at: offset + c,
                    });
                }
                (Some(o), Some(c)) if c < o => {
                    return Err(CompletionParseError::StrayClose {
                        tag: self.tool_close.clone(),
                        at: offset + c,
                    });
                }
                (Some(o), _) => {
                    content.push_str(&rest[..o]);
                    let body_start = o + self.tool_open.len();
                    let index = calls.len();
                    let Some(len) = rest[body_start..].find(&self.tool_close) else {
                        return Err(CompletionParseError::UnclosedToolCall { index });
                    };
                    let body = &rest[body_start..body_start + len];
                    calls.push(parse_call(body, index, call_id_prefix)?);
                    let consumed = body_start + len + self.tool_close.len();
                    offset += consumed;
                    rest = &rest[consumed..];
                }
            }
        }
        Ok((content, calls))
    }
}

/// `{"name": "...", "arguments": {...}}` (or `"parameters"`, as Llama 3 emits).
fn parse_call(body: &str, index: usize, prefix: &str) -> Result<ToolCall, CompletionParseError> {
    let invalid = |reason: String| CompletionParseError::InvalidToolCall { index, reason };
    let value: serde_json::Value =
        serde_json::from_str(body.trim()).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| invalid("not a JSON object".into()))?;
    let name = obj
        .get("name")
        .and_then(serde_json::Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| invalid("no string `name`".into()))?;
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None => "{}".to_owned(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(v @ serde_json::Value::Object(_)) => v.to_string(),
        Some(other) => return Err(invalid(format!("arguments must be an object, got {other}"))),
    };
    Ok(ToolCall {
        id: format!("{prefix}{index}"),
        kind: "function".into(),
        function: FunctionCall {
            name: name.to_owned(),
            arguments,
        },
    })
}
