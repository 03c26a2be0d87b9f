//! Messages ↔ tokens. The [`Renderer`] trait is what [`crate::TokenEnv`] needs from a chat
//! template and a tokenizer; the model crate implements it with the model's own template.
//! [`ByteRenderer`] is a dependency-free implementation (a ChatML-like template over UTF-8 bytes)
//! for tests, the simulated engine and examples. [`parse_assistant_text`] turns completion text
//! into a message (reasoning, tool calls) with the core crate's [`CompletionParser`], the one
//! parser every renderer shares.

use serde_json::Value;
use sluice_core::{CompletionParser, Message, Role, ToolSpec};

use crate::error::EnvError;

/// A completion decoded to text whose structure (tool-call JSON, …) did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("completion does not parse: {reason}")]
pub struct ParseError {
    /// The decoded text, so the env can still see (and penalize) what the model wrote.
    pub raw_text: String,
    /// What did not parse.
    pub reason: String,
}

/// Renders chat histories to prompt token ids and parses completions back into messages.
pub trait Renderer: Send + Sync {
    /// Token ids of `messages` (with `tools` declared as the template does), ending with the
    /// generation prompt of an assistant turn.
    fn render_prompt(&self, messages: &[Message], tools: &[ToolSpec])
    -> Result<Vec<u32>, EnvError>;

    /// The assistant message a completion encodes (stop tokens stripped), or a [`ParseError`]
    /// carrying the raw text.
    fn parse_completion(&self, completion: &[u32]) -> Result<Message, ParseError>;
}

/// Splits assistant text into content, reasoning (`<think>…</think>`) and tool calls
/// (`<tool_call>{"name": …, "arguments": {…}}</tool_call>`) with the one completion parser
/// ([`sluice_core::CompletionParser`]). Tool-call ids are `call_<n>` in order of appearance.
pub fn parse_assistant_text(text: &str) -> Result<Message, ParseError> {
    CompletionParser::default()
        .parse(text, "call_")
        .map_err(|e| ParseError {
            raw_text: text.to_owned(),
            reason: e.to_string(),
        })
}

/// Renders an assistant message back to the text [`parse_assistant_text`] reads.
pub fn assistant_text(message: &Message) -> String {
    let mut out = String::new();
    if let Some(r) = &message.reasoning_content {
        out.push_str(&format!("<think>{r}</think>"));
    }
    if let Some(c) = &message.content {
        out.push_str(c);
    }
    for call in &message.tool_calls {
        let args: Value = serde_json::from_str(&call.function.arguments)
            .unwrap_or(Value::String(call.function.arguments.clone()));
        let body = serde_json::json!({"name": call.function.name, "arguments": args});
        out.push_str(&format!("<tool_call>{body}</tool_call>"));
    }
    out
}

/// ChatML-like template over UTF-8 bytes: token id = byte value; every message is
/// `<|im_start|>{role}\n{text}<|im_end|>\n`, tools are listed in a leading system block, and the
/// generation prompt is `<|im_start|>assistant\n`. A completion ends at `<|im_end|>`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteRenderer;

impl ByteRenderer {
    /// The end-of-turn marker a completion stops at.
    pub const END: &'static str = "<|im_end|>";

    /// The prompt as text (what [`Renderer::render_prompt`] encodes).
    pub fn render_text(messages: &[Message], tools: &[ToolSpec]) -> String {
        let mut out = String::new();
        if !tools.is_empty() {
            out.push_str("<|im_start|>system\n# Tools\n");
            for t in tools {
                out.push_str(&serde_json::to_string(t).unwrap_or_default());
                out.push('\n');
            }
            out.push_str("<|im_end|>\n");
        }
        for m in messages {
            let text = match m.role {
                Role::Assistant => assistant_text(m),
                _ => m.content.clone().unwrap_or_default(),
            };
            out.push_str(&format!(
                "<|im_start|>{}\n{text}<|im_end|>\n",
                m.role.as_str()
            ));
        }
        out.push_str("<|im_start|>assistant\n");
        out
    }

    /// Token ids of `text`.
    pub fn encode(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }
}

impl Renderer for ByteRenderer {
    fn render_prompt(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
    ) -> Result<Vec<u32>, EnvError> {
        Ok(Self::encode(&Self::render_text(messages, tools)))
    }

    fn parse_completion(&self, completion: &[u32]) -> Result<Message, ParseError> {
        let bytes: Vec<u8> = completion.iter().map(|&t| t.min(255) as u8).collect();
        let text = String::from_utf8_lossy(&bytes);
        let text = text.split(Self::END).next().unwrap_or_default();
        if completion.iter().any(|&t| t > 255) {
            return Err(ParseError {
                raw_text: text.to_owned(),
                reason: "token id above 255 in a byte-level completion".into(),
            });
        }
        parse_assistant_text(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_reasoning_content_and_tool_calls() {
        let m = parse_assistant_text(
            "<think>17*23 first</think>Let me compute.<tool_call>{\"name\": \"calc\", \"arguments\": {\"expression\": \"17*23\"}}</tool_call>",
        )
        .unwrap();
        assert_eq!(m.reasoning_content.as_deref(), Some("17*23 first"));
        assert_eq!(m.content.as_deref(), Some("Let me compute."));
        assert_eq!(m.tool_calls.len(), 1);
        assert_eq!(m.tool_calls[0].function.name, "calc");
        assert_eq!(
            m.tool_calls[0].function.arguments,
            r#"{"expression":"17*23"}"#
        );
        // Round trip through the text form.
        assert_eq!(parse_assistant_text(&assistant_text(&m)).unwrap(), m);

        let only_call =
            parse_assistant_text("<tool_call>{\"name\":\"calc\",\"arguments\":{}}</tool_call>")
                .unwrap();
        assert_eq!(only_call.content, None);
        assert_eq!(
            parse_assistant_text("  42 ").unwrap().content.as_deref(),
            Some("42")
        );
    }

    #[test]
    fn malformed_structure_keeps_the_raw_text() {
        for bad in [
            "<tool_call>{not json}</tool_call>",
            "<tool_call>{\"arguments\":{}}</tool_call>",
            "<tool_call>{\"name\":\"calc\"}",
            "<think>never closed",
        ] {
            let e = parse_assistant_text(bad).unwrap_err();
            assert_eq!(e.raw_text, bad);
        }
    }

    #[test]
    fn completions_parse_as_the_model_crate_parses_them() {
        // Thinking-enabled templates put `<think>` in the prompt, so the completion carries only
        // the closing tag; Llama 3 names arguments `parameters`; a stray close is an error. The
        // byte renderer and the model's templates once parsed these three differently.
        let text = "weigh it\n</think>\n<tool_call>{\"name\": \"calc\", \"parameters\": {\"x\": 1}}</tool_call>";
        let m = parse_assistant_text(text).unwrap();
        assert_eq!(m.reasoning_content.as_deref(), Some("weigh it"));
        assert_eq!(m.tool_calls[0].function.arguments, r#"{"x":1}"#);
        assert_eq!(m, CompletionParser::default().parse(text, "call_").unwrap());
        assert!(parse_assistant_text("42</tool_call>").is_err());
    }

    #[test]
    fn byte_renderer_round_trip() {
        let r = ByteRenderer;
        let prompt = r
            .render_prompt(&[Message::system("s"), Message::user("hi")], &[])
            .unwrap();
        let text: String = prompt.iter().map(|&b| b as u8 as char).collect();
        assert_eq!(
            text,
            "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let completion = ByteRenderer::encode("12<|im_end|>");
        assert_eq!(
            r.parse_completion(&completion).unwrap().content.as_deref(),
            Some("12")
        );
        assert!(r.parse_completion(&[300]).is_err());
    }
}
