//! [`ChatTemplate`]: renders a checkpoint's Jinja chat template the way transformers'
//! `apply_chat_template` does.
//!
//! Matching transformers means: `trim_blocks` and `lstrip_blocks` on, no trailing-newline
//! keeping, Python string/dict methods (`startswith`, `split`, `items`, … via minijinja-contrib's
//! pycompat), `tojson` as Python's `json.dumps`, the globals `raise_exception` and
//! `strftime_now`, the special tokens (`bos_token`, `eos_token`, …) as variables, `tools` and
//! `add_generation_prompt`, plus any extra variables (`enable_thinking`). transformers' own
//! `{% generation %}` block tag is accepted and renders its body.
//!
//! A rendering runs under a [`RenderBudget`] (template steps, output size, deadline): templates
//! come from model directories and configs, and one with a runaway loop fails its request or
//! rollout with an error saying which bound it hit.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use sluice_core::{Message, ToolSpec};

use super::pyjson::{DumpOptions, Json, dumps};
use crate::error::{ModelError, Result};

const TEMPLATE_NAME: &str = "chat";

/// Options of one rendering (the keyword arguments of `apply_chat_template`).
#[derive(Debug, Clone, Default)]
pub struct ChatOptions {
    /// Append the header that opens an assistant turn.
    pub add_generation_prompt: bool,
    /// Tools offered to the model (`None`: the template sees `tools = none`).
    pub tools: Option<Vec<ToolSpec>>,
    /// Extra template variables, e.g. `{"enable_thinking": false}`.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Bounds on one rendering. A template is code from a model directory or a config: a loop in
/// it must fail the request or rollout, not hang it or grow memory without end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderBudget {
    /// Template instructions one rendering may execute (minijinja's fuel).
    pub fuel: u64,
    /// Most bytes of rendered text.
    pub max_output_bytes: usize,
    /// Wall-clock limit of one rendering, checked as text is written.
    pub deadline: Duration,
}

impl RenderBudget {
    /// The default: 10 million instructions (real templates take a few hundred per message),
    /// 64 MiB of text, 10 seconds.
    pub const DEFAULT: Self = Self {
        fuel: 10_000_000,
        max_output_bytes: 64 << 20,
        deadline: Duration::from_secs(10),
    };
}

impl Default for RenderBudget {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A compiled chat template plus the special-token variables it is rendered with.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: BTreeMap<String, String>,
    budget: RenderBudget,
    /// The template writes the reasoning tag (`<think>`).
    reasons: bool,
}

impl ChatTemplate {
    /// Compiles `source`. `special_tokens` maps variable names (`bos_token`, `eos_token`,
    /// `pad_token`, `unk_token`) to their strings.
    pub fn new(source: &str, special_tokens: BTreeMap<String, String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, accept_generation_tags(source))
            .map_err(template_err)?;
        let budget = RenderBudget::DEFAULT;
        env.set_fuel(Some(budget.fuel));
        Ok(Self {
            env,
            special_tokens,
            budget,
            reasons: source.contains(&sluice_core::CompletionParser::default().think_open),
        })
    }

    /// Whether the template writes the reasoning tag (`<think>`): its model reasons before it
    /// answers (Qwen3, DeepSeek-R1), and a reply's reasoning is parsed out of it. A template
    /// without it (SmolLM2, Llama) has none: a `<think>` in its reply is text.
    pub fn has_reasoning(&self) -> bool {
        self.reasons
    }

    /// Renders under `budget` instead of [`RenderBudget::DEFAULT`].
    pub fn with_budget(mut self, budget: RenderBudget) -> Self {
        self.env.set_fuel(Some(budget.fuel));
        self.budget = budget;
        self
    }

    /// Renders `messages` into the prompt text.
    pub fn render(&self, messages: &[Message], options: &ChatOptions) -> Result<String> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), Value::from(v.as_str()));
        }
        let msgs: Vec<TemplateMessage<'_>> = messages.iter().map(TemplateMessage::from).collect();
        ctx.insert("messages".into(), Value::from_serialize(&msgs));
        let tools = match &options.tools {
            Some(t) => Value::from_serialize(t),
            None => Value::from(()),
        };
        ctx.insert("tools".into(), tools);
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(options.add_generation_prompt),
        );
        for (k, v) in &options.extra {
            ctx.insert(k.clone(), Value::from_serialize(v));
        }
        let template = self.env.get_template(TEMPLATE_NAME).map_err(template_err)?;
        let mut out = BoundedOutput::new(&self.budget);
        match template.render_captured_to(&ctx, &mut out) {
            Ok(_) => String::from_utf8(out.text).map_err(|_| ModelError::ChatTemplate {
                reason: "rendering produced invalid UTF-8".into(),
            }),
            Err(e) => Err(self.render_err(e, out.stopped)),
        }
    }

    /// Why a rendering failed: a budget that ran out says which and by how much.
    fn render_err(&self, e: Error, stopped: Option<Stop>) -> ModelError {
        let budget = &self.budget;
        let reason = match stopped {
            Some(Stop::Output) => format!(
                "rendering stopped: the text passed {} bytes (a runaway loop in the template?)",
                budget.max_output_bytes
            ),
            Some(Stop::Deadline) => format!(
                "rendering stopped: it ran past its {:?} deadline (a runaway loop in the template?)",
                budget.deadline
            ),
            None if e.kind() == ErrorKind::OutOfFuel => format!(
                "rendering stopped: it used up its budget of {} template steps (a runaway loop in the template?)",
                budget.fuel
            ),
            None => return template_err(e),
        };
        ModelError::ChatTemplate { reason }
    }
}

/// Which bound stopped a rendering's output.
#[derive(Debug, Clone, Copy)]
enum Stop {
    Output,
    Deadline,
}

/// The rendered text, refusing to grow past the budget's size or deadline.
struct BoundedOutput {
    text: Vec<u8>,
    max_bytes: usize,
    deadline: Instant,
    stopped: Option<Stop>,
}

impl BoundedOutput {
    fn new(budget: &RenderBudget) -> Self {
        Self {
            text: Vec::new(),
            max_bytes: budget.max_output_bytes,
            deadline: Instant::now() + budget.deadline,
            stopped: None,
        }
    }
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len().saturating_add(buf.len()) > self.max_bytes {
            self.stopped = Some(Stop::Output);
        } else if Instant::now() >= self.deadline {
            self.stopped = Some(Stop::Deadline);
        }
        if self.stopped.is_some() {
            return Err(std::io::Error::other("chat template budget exceeded"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn template_err(e: Error) -> ModelError {
    let mut reason = e.to_string();
    if let Some(line) = e.line() {
        reason.push_str(&format!(" (template line {line})"));
    }
    ModelError::ChatTemplate { reason }
}

/// A message as HF templates expect it: tool-call arguments as an object when they are JSON
/// (transformers users pass dicts; OpenAI carries strings), so `arguments | tojson` prints the
/// object rather than a quoted string.
#[derive(Serialize)]
struct TemplateMessage<'a> {
    role: &'a str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<TemplateToolCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

#[derive(Serialize)]
struct TemplateToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    function: TemplateFunction<'a>,
}

#[derive(Serialize)]
struct TemplateFunction<'a> {
    name: &'a str,
    arguments: serde_json::Value,
}

impl<'a> From<&'a Message> for TemplateMessage<'a> {
    fn from(m: &'a Message) -> Self {
        Self {
            role: m.role.as_str(),
            content: m.content.as_deref(),
            reasoning_content: m.reasoning_content.as_deref(),
            tool_calls: m
                .tool_calls
                .iter()
                .map(|c| TemplateToolCall {
                    id: &c.id,
                    kind: &c.kind,
                    function: TemplateFunction {
                        name: &c.function.name,
                        arguments: serde_json::from_str(&c.function.arguments).unwrap_or_else(
                            |_| serde_json::Value::from(c.function.arguments.clone()),
                        ),
                    },
                })
                .collect(),
            tool_call_id: m.tool_call_id.as_deref(),
            name: m.name.as_deref(),
        }
    }
}

/// `{% generation %}…{% endgeneration %}` (transformers' assistant-mask extension) becomes an
/// always-true `if`, keeping the tags' whitespace control.
fn accept_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let body = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match body {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let lead = &inner[..inner.len() - inner.trim_start_matches(['-', '+']).len()];
                let trail = &inner[inner.trim_end_matches(['-', '+']).len()..];
                out.push_str(&format!("{{%{lead} {r} {trail}%}}"));
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// `tojson` as transformers defines it (Python `json.dumps`, `ensure_ascii=False`).
fn tojson(
    value: Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<String, Error> {
    let indent: Option<Value> = match indent {
        Some(i) => Some(i),
        None => kwargs.get("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be an integer",
            )
        })?),
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let separators = match separators {
        None => None,
        Some(s) if s.len() == 2 => Some((s[0].clone(), s[1].clone())),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ));
        }
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = Json::from_template(&value)?;
    Ok(dumps(
        &json,
        &DumpOptions {
            indent,
            separators,
            sort_keys: sort_keys.unwrap_or(false),
            ensure_ascii: ensure_ascii.unwrap_or(false),
        },
    ))
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(fmt)`: the current UTC date/time formatted with the common `%` codes.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(secs, &format)
}

pub(crate) fn strftime(unix_secs: u64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        assert_eq!(strftime(0, "%d %b %Y"), "01 Jan 1970");
        // 2024-02-29 12:34:56 UTC, a Thursday.
        assert_eq!(
            strftime(1_709_210_096, "%A %d %B %Y %H:%M:%S"),
            "Thursday 29 February 2024 12:34:56"
        );
    }

    #[test]
    fn generation_tags_become_ifs() {
        assert_eq!(
            accept_generation_tags("a{%- generation %}b{% endgeneration -%}c{{ x }}"),
            "a{%- if true %}b{% endif -%}c{{ x }}"
        );
    }
}
