//! A streamed chat reply as OpenAI deltas: reasoning, content and tool calls parsed from the text
//! as it arrives, so that the deltas reassemble to the non-streamed reply.
//!
//! The non-streamed reply is [`parse_reply`] of the whole text. While streaming, [`ReplyStream`]
//! only ever sends what is certain to be a prefix of that final parse:
//! - content is trimmed as the parser trims it (leading whitespace dropped, whitespace held back
//!   until something follows it), and a suffix that could still become `<tool_call>` is held;
//! - reasoning (after `<think>`, or from the start when the prompt ends inside `<think>`) streams
//!   as `reasoning_content` until `</think>`;
//! - a tool call is announced (`index`, `id`, `type`, `function.name`) as soon as its name is
//!   complete; its `arguments` object then streams as fragments of the model's text without
//!   whitespace, which is what the non-streamed reply carries too (key order, escapes and
//!   number forms as generated). A body that does not start `{"name": …, "arguments": {…`
//!   is sent when it closes.
//!
//! What is parsed is the request's [`Parsing`]: tool calls only when it offered tools, reasoning
//! only when the model's template reasons; with neither, the reply is the generated text as it
//! is, streamed as it comes.
//!
//! [`ReplyStream::finish`] parses the whole text and sends whatever the final reply has beyond
//! what was streamed. A malformed reply (the non-streamed answer is then the raw text as
//! content) can contradict what was already sent; that is logged, and the rest of the raw text
//! follows as content.

use serde_json::{Value, json};
use sluice_core::ToolCall;
use sluice_model::CompletionParser;

use super::tool_json::{minify_prefix, raw_arguments, scan_header};

/// What the non-streamed reply holds for one completion.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ParsedReply {
    /// Content (`None` when empty and there are tool calls).
    pub content: Option<String>,
    /// Reasoning, when the text had `</think>`.
    pub reasoning: Option<String>,
    /// Parsed tool calls.
    pub tool_calls: Vec<ToolCall>,
}

/// What a chat reply is parsed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parsing {
    /// `<think>…</think>` reasoning: the model's template reasons.
    pub reasoning: bool,
    /// `<tool_call>` calls: the request offered tools (and `tool_choice` is not `"none"`).
    pub tools: bool,
}

impl Parsing {
    /// Everything, as the pipeline's parser reads its replies (`CompletionParser::parse`).
    pub(crate) const ALL: Self = Self {
        reasoning: true,
        tools: true,
    };

    /// Nothing is parsed: the reply is the text as generated.
    fn nothing(self) -> bool {
        !self.reasoning && !self.tools
    }
}

/// The assistant message of a completion: parsed for what `parsing` asks (reasoning, tool
/// calls) when it parses, the raw text as content when it does not or when nothing is asked
/// (as vLLM does without its parsers). Call ids are `{call_prefix}{k}`. A call's `arguments`
/// object is the model's own text without whitespace (key order and number forms kept, as
/// vLLM keeps them), so that it can stream as it is generated.
pub(crate) fn parse_reply(text: &str, call_prefix: &str, parsing: Parsing) -> ParsedReply {
    if parsing.nothing() {
        return ParsedReply {
            content: Some(text.to_owned()),
            ..ParsedReply::default()
        };
    }
    let tags = CompletionParser::default();
    match tags.parse_only(text, call_prefix, parsing.reasoning, parsing.tools) {
        Ok(m) => {
            let after_think = text
                .find(&tags.think_close)
                .filter(|_| parsing.reasoning)
                .map_or(text, |at| &text[at + tags.think_close.len()..]);
            let mut bodies = tool_call_bodies(&tags, after_think).into_iter();
            let tool_calls = m
                .tool_calls
                .into_iter()
                .map(|mut call| {
                    if let Some(args) = bodies.next().and_then(raw_arguments) {
                        call.function.arguments = args;
                    }
                    call
                })
                .collect();
            ParsedReply {
                content: m.content,
                reasoning: m.reasoning_content,
                tool_calls,
            }
        }
        Err(_) => ParsedReply {
            content: Some(text.to_owned()),
            ..ParsedReply::default()
        },
    }
}

/// The bodies between the tool-call tags of a well-formed text, in order.
fn tool_call_bodies<'t>(tags: &CompletionParser, mut text: &'t str) -> Vec<&'t str> {
    let mut bodies = Vec::new();
    while let Some(open) = text.find(&tags.tool_open) {
        let body = &text[open + tags.tool_open.len()..];
        let Some(close) = body.find(&tags.tool_close) else {
            break;
        };
        bodies.push(&body[..close]);
        text = &body[close + tags.tool_close.len()..];
    }
    bodies
}

/// One delta of a streamed choice; merge several with [`delta_json`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Delta {
    /// More reasoning text.
    Reasoning(String),
    /// More content text.
    Content(String),
    /// A new tool call: its header, with empty arguments.
    CallStart {
        /// Position of the call in the reply.
        index: usize,
        /// Call id.
        id: String,
        /// Function name.
        name: String,
    },
    /// More of a call's arguments.
    CallArgs {
        /// Position of the call in the reply.
        index: usize,
        /// The fragment.
        fragment: String,
    },
}

/// The `delta` objects of the chunks that carry `deltas`, in order: a tool call's header goes
/// in a chunk of its own, as OpenAI sends it (arguments empty), its fragments in later chunks.
/// Always at least one (empty) delta.
pub(crate) fn delta_chunks(deltas: &[Delta]) -> Vec<Value> {
    let mut chunks = Vec::new();
    let mut group: Vec<Delta> = Vec::new();
    for d in deltas {
        if matches!(d, Delta::CallStart { .. }) {
            if !group.is_empty() {
                chunks.push(delta_json(&std::mem::take(&mut group)));
            }
            chunks.push(delta_json(std::slice::from_ref(d)));
        } else {
            group.push(d.clone());
        }
    }
    if !group.is_empty() || chunks.is_empty() {
        chunks.push(delta_json(&group));
    }
    chunks
}

/// The `delta` object of one chunk carrying `deltas`.
fn delta_json(deltas: &[Delta]) -> Value {
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut calls: Vec<Value> = Vec::new();
    for d in deltas {
        match d {
            Delta::Reasoning(s) => reasoning.push_str(s),
            Delta::Content(s) => content.push_str(s),
            Delta::CallStart { index, id, name } => calls.push(json!({
                "index": index, "id": id, "type": "function",
                "function": {"name": name, "arguments": ""},
            })),
            Delta::CallArgs { index, fragment } => {
                let same = calls.last_mut().filter(|c| c["index"] == json!(index));
                match same {
                    Some(c) => {
                        let had = c["function"]["arguments"].as_str().unwrap_or_default();
                        c["function"]["arguments"] = json!(format!("{had}{fragment}"));
                    }
                    None => {
                        calls.push(json!({"index": index, "function": {"arguments": fragment}}))
                    }
                }
            }
        }
    }
    let mut delta = json!({});
    if !reasoning.is_empty() {
        delta["reasoning_content"] = json!(reasoning);
    }
    if !content.is_empty() {
        delta["content"] = json!(content);
    }
    if !calls.is_empty() {
        delta["tool_calls"] = json!(calls);
    }
    delta
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
    Call,
}

/// What has been sent of one tool call.
#[derive(Debug, Default)]
struct SentCall {
    header: bool,
    args: String,
}

/// Incremental parser of one streamed choice. See the module docs.
pub(crate) struct ReplyStream {
    tags: CompletionParser,
    parsing: Parsing,
    call_prefix: String,
    mode: Mode,
    /// Text received and not yet consumed by the current mode.
    buf: String,
    /// Everything received (what [`Self::finish`] parses).
    raw: String,
    /// Leading `<think>` of the reply dealt with (or ruled out).
    think_checked: bool,
    /// Content, trimmed of whitespace at both ends.
    content: Trimmed,
    /// Reasoning, trimmed of newlines at both ends.
    reasoning: Trimmed,
    calls: Vec<SentCall>,
    /// A tool call did not parse: nothing more is streamed until the end.
    broken: bool,
}

impl ReplyStream {
    /// A choice whose prompt is `prompt_text`, parsed for what `parsing` asks: with reasoning,
    /// a prompt that ends inside an open `<think>` starts the reply with reasoning. Call ids
    /// are `{call_prefix}{k}`.
    pub(crate) fn new(prompt_text: &str, call_prefix: String, parsing: Parsing) -> Self {
        let tags = CompletionParser::default();
        let mode = if parsing.reasoning && prompt_text.trim_end().ends_with(&tags.think_open) {
            Mode::Reasoning
        } else {
            Mode::Content
        };
        Self {
            tags,
            parsing,
            call_prefix,
            mode,
            buf: String::new(),
            raw: String::new(),
            think_checked: !parsing.reasoning,
            content: Trimmed::default(),
            reasoning: Trimmed::default(),
            calls: Vec::new(),
            broken: false,
        }
    }

    /// Adds text; returns the deltas that are now certain.
    pub(crate) fn push(&mut self, text: &str) -> Vec<Delta> {
        self.raw.push_str(text);
        if self.broken {
            return Vec::new();
        }
        if self.parsing.nothing() {
            // Nothing to parse: the text as it comes.
            self.content.sent.push_str(text);
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![Delta::Content(text.to_owned())]
            };
        }
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// The end of the text (`rest`, if any): the deltas that complete the final reply.
    pub(crate) fn finish(&mut self, rest: &str) -> (Vec<Delta>, ParsedReply) {
        self.raw.push_str(rest);
        let parsed = parse_reply(&self.raw, &self.call_prefix, self.parsing);
        let mut out = Vec::new();
        let reasoning = parsed.reasoning.as_deref().unwrap_or_default();
        if let Some(more) = self.remainder(reasoning, &self.reasoning.sent, "reasoning") {
            out.push(Delta::Reasoning(more));
        }
        let content = parsed.content.as_deref().unwrap_or_default();
        if let Some(more) = self.remainder(content, &self.content.sent, "content") {
            out.push(Delta::Content(more));
        }
        for (index, call) in parsed.tool_calls.iter().enumerate() {
            let sent = self.calls.get(index);
            if !sent.is_some_and(|s| s.header) {
                out.push(Delta::CallStart {
                    index,
                    id: call.id.clone(),
                    name: call.function.name.clone(),
                });
            }
            let had = sent.map_or("", |s| s.args.as_str());
            if let Some(fragment) = self.remainder(&call.function.arguments, had, "arguments") {
                out.push(Delta::CallArgs { index, fragment });
            }
        }
        if self.calls.iter().filter(|c| c.header).count() > parsed.tool_calls.len() {
            tracing::warn!("streamed tool call header has no call in the parsed reply");
        }
        (out, parsed)
    }

    /// `whole` minus what was sent, when what was sent is a prefix of it.
    fn remainder(&self, whole: &str, sent: &str, what: &str) -> Option<String> {
        match whole.strip_prefix(sent) {
            Some("") => None,
            Some(rest) => Some(rest.to_owned()),
            None => {
                tracing::warn!(what, "the streamed reply contradicts its final parse");
                None
            }
        }
    }

    /// Consumes what it can of `buf` in the current mode; true when the mode changed and the
    /// rest should be looked at again.
    fn step(&mut self, out: &mut Vec<Delta>) -> bool {
        if !self.think_checked {
            // `<think>` opening the reply (after whitespace only) is reasoning.
            let trimmed = self.buf.trim_start();
            let open = self.tags.think_open.clone();
            if trimmed.is_empty() || open.starts_with(trimmed) && trimmed.len() < open.len() {
                return false;
            }
            self.think_checked = true;
            if let Some(after) = trimmed.strip_prefix(open.as_str()) {
                self.buf = after.to_owned();
                self.mode = Mode::Reasoning;
            }
        }
        match self.mode {
            Mode::Reasoning => {
                let close = self.tags.think_close.clone();
                let (text, found) = split_at_tag(&self.buf, &close);
                let more = self.reasoning.push(&text, |c| c == '\n');
                if !more.is_empty() {
                    out.push(Delta::Reasoning(more));
                }
                if found {
                    self.buf = self.buf[text.len() + close.len()..].to_owned();
                    self.mode = Mode::Content;
                    return true;
                }
                self.buf.drain(..text.len());
                false
            }
            Mode::Content => {
                let open = self.tags.tool_open.clone();
                let (text, found) = if self.parsing.tools {
                    split_at_tag(&self.buf, &open)
                } else {
                    (self.buf.clone(), false)
                };
                let more = self.content.push(&text, char::is_whitespace);
                if !more.is_empty() {
                    out.push(Delta::Content(more));
                }
                if found {
                    self.buf = self.buf[text.len() + open.len()..].to_owned();
                    self.calls.push(SentCall::default());
                    self.mode = Mode::Call;
                    return true;
                }
                self.buf.drain(..text.len());
                false
            }
            Mode::Call => self.step_call(out),
        }
    }

    fn step_call(&mut self, out: &mut Vec<Delta>) -> bool {
        let index = self.calls.len() - 1;
        let close = self.tags.tool_close.clone();
        if let Some(end) = self.buf.find(&close) {
            let body = self.buf[..end].to_owned();
            self.buf = self.buf[end + close.len()..].to_owned();
            self.mode = Mode::Content;
            let whole = format!("{}{body}{close}", self.tags.tool_open);
            let parsed = parse_reply(&whole, "", Parsing::ALL)
                .tool_calls
                .into_iter()
                .next();
            let Some(call) = parsed else {
                // The final reply will be the raw text: stop guessing.
                self.broken = true;
                return false;
            };
            self.announce(index, &call.function.name, out);
            let sent = &mut self.calls[index];
            match call.function.arguments.strip_prefix(sent.args.as_str()) {
                Some(rest) => {
                    if !rest.is_empty() {
                        out.push(Delta::CallArgs {
                            index,
                            fragment: rest.to_owned(),
                        });
                    }
                    sent.args = call.function.arguments;
                }
                None => {
                    tracing::warn!("streamed tool call arguments contradict the parsed call");
                    self.broken = true;
                    return false;
                }
            }
            return true;
        }
        let Some(head) = scan_header(&self.buf) else {
            return false;
        };
        self.announce(index, &head.name, out);
        if let Some(args_at) = head.args_at.filter(|&a| self.buf[a..].starts_with('{')) {
            let (safe, _) = minify_prefix(&self.buf[args_at..]);
            let sent = &mut self.calls[index];
            if let Some(rest) = safe.strip_prefix(sent.args.as_str())
                && !rest.is_empty()
            {
                out.push(Delta::CallArgs {
                    index,
                    fragment: rest.to_owned(),
                });
                sent.args = safe;
            }
        }
        false
    }

    fn announce(&mut self, index: usize, name: &str, out: &mut Vec<Delta>) {
        if !self.calls[index].header {
            self.calls[index].header = true;
            out.push(Delta::CallStart {
                index,
                id: format!("{}{index}", self.call_prefix),
                name: name.to_owned(),
            });
        }
    }
}

/// Text sent with the trimming the parser applies at both ends: leading trimmed characters are
/// dropped, inner ones held until something else follows them.
#[derive(Debug, Default)]
struct Trimmed {
    held: String,
    sent: String,
}

impl Trimmed {
    /// Adds `text`; returns what can be sent now.
    fn push(&mut self, text: &str, trimmed: impl Fn(char) -> bool) -> String {
        let mut out = String::new();
        for c in text.chars() {
            if !trimmed(c) {
                out.push_str(&std::mem::take(&mut self.held));
                out.push(c);
            } else if !self.sent.is_empty() || !out.is_empty() {
                self.held.push(c);
            }
        }
        self.sent.push_str(&out);
        out
    }
}

/// The text before `tag`, and whether `tag` was found; when it was not, a suffix that could
/// still become `tag` is left out.
fn split_at_tag(buf: &str, tag: &str) -> (String, bool) {
    if let Some(at) = buf.find(tag) {
        return (buf[..at].to_owned(), true);
    }
    let keep = (1..tag.len().min(buf.len() + 1))
        .rev()
        .find(|&n| buf.is_char_boundary(buf.len() - n) && tag.starts_with(&buf[buf.len() - n..]))
        .unwrap_or(0);
    (buf[..buf.len() - keep].to_owned(), false)
}

#[cfg(test)]
mod tests;
