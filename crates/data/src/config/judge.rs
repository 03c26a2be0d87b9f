//! `[data.domains.<domain>.rubric.judge]`: the `judge` reward function's model, an
//! OpenAI-compatible chat server (vLLM, SGLang, `sluice serve`) asked to grade each reply, and
//! how its answer becomes a score. Raw (serde, defaults) → [`validate_judge`] → [`JudgeConfig`].

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize, Serializer};
use sluice_core::config::ConfigError;
use sluice_core::config::check::{Ctx, non_zero_u32, number, positive_seconds};

/// The placeholders a judge prompt may hold; `{reply}` is required.
pub const JUDGE_PLACEHOLDERS: &[&str] = &["question", "reply", "reference"];

/// The prompt the judge is sent when the config sets none.
pub const DEFAULT_JUDGE_PROMPT: &str = "Grade the reply to the question below.

Question:
{question}

Reference answer (empty when there is none):
{reference}

Reply:
{reply}

Say in a sentence or two whether the reply is correct and complete, then end with a line \
`Score: N`, N an integer from 0 (wrong) to 10 (correct and complete).";

/// The pattern the judge's score is read with when the config sets none: group 1 of its last
/// match (`Score: 7`, `score = 8.5`, `**Score:** 9`).
pub const DEFAULT_SCORE_REGEX: &str = r"(?i)score\W{0,4}[:=]\W{0,4}(-?\d+(?:\.\d+)?)";

/// `[data.domains.<domain>.rubric.judge]` as serde reads it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawJudge {
    /// Base URL of the OpenAI-compatible server (`http://host:port/v1`).
    pub url: Option<String>,
    /// The `model` every request names.
    pub model: Option<String>,
    /// The grading prompt, with `{question}`, `{reply}` and `{reference}`.
    pub prompt: Option<String>,
    /// A system message sent before the prompt.
    pub system_prompt: Option<String>,
    /// The score's pattern: group 1 of its last match.
    pub score_regex: Option<String>,
    /// The score that maps to reward 1 (scores are divided by it and clamped to [0, 1]).
    pub max_score: f64,
    /// Tokens the judge may write.
    pub max_tokens: i64,
    /// The judge's sampling temperature.
    pub temperature: f64,
    /// Requests in flight to the judge at most, per domain.
    pub concurrency: i64,
    /// Deadline of one request, seconds.
    pub timeout_s: f64,
}

impl Default for RawJudge {
    fn default() -> Self {
        Self {
            url: None,
            model: None,
            prompt: None,
            system_prompt: None,
            score_regex: None,
            max_score: 10.0,
            max_tokens: 512,
            temperature: 0.0,
            concurrency: 16,
            timeout_s: 60.0,
        }
    }
}

/// `[data.domains.<domain>.rubric.judge]`, validated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JudgeConfig {
    /// Base URL, `http://…`, without a trailing slash.
    pub url: String,
    /// The `model` every request names.
    pub model: String,
    /// The grading prompt (its placeholders checked).
    pub prompt: String,
    /// A system message sent before the prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// The score's pattern (compiles, with a capture group).
    pub score_regex: String,
    /// The score that maps to reward 1 (> 0).
    pub max_score: f64,
    /// Tokens the judge may write (≥ 1).
    pub max_tokens: u32,
    /// Sampling temperature, in [0, 2].
    pub temperature: f64,
    /// Requests in flight at most (1–1024).
    pub concurrency: u32,
    /// Deadline of one request.
    #[serde(rename = "timeout_s", serialize_with = "seconds")]
    pub timeout: Duration,
}

fn seconds<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// The pieces of a judge prompt: literal text and placeholders, `{{`/`}}` read as braces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptPart<'a> {
    /// Text sent as it is.
    Text(std::borrow::Cow<'a, str>),
    /// `{name}`, one of [`JUDGE_PLACEHOLDERS`].
    Field(&'a str),
}

/// `prompt` split into its parts, or why it cannot be: an unknown placeholder, or an unmatched
/// brace.
pub fn prompt_parts(prompt: &str) -> Result<Vec<PromptPart<'_>>, String> {
    let mut parts = Vec::new();
    let mut text = String::new();
    let mut rest = prompt;
    while let Some(i) = rest.find(['{', '}']) {
        text.push_str(&rest[..i]);
        let tail = &rest[i..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            text.push_str(&tail[..1]);
            rest = &tail[2..];
        } else if let Some(name) = tail.strip_prefix('{') {
            let end = name
                .find('}')
                .ok_or("an unclosed `{` (write `{{` for a brace)")?;
            let (name, after) = (&name[..end], &name[end + 1..]);
            if !JUDGE_PLACEHOLDERS.contains(&name) {
                return Err(format!(
                    "unknown placeholder `{{{name}}}`: the prompt may use {} (write `{{{{` for a brace)",
                    JUDGE_PLACEHOLDERS
                        .iter()
                        .map(|p| format!("{{{p}}}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            if !text.is_empty() {
                parts.push(PromptPart::Text(std::mem::take(&mut text).into()));
            }
            parts.push(PromptPart::Field(name));
            rest = after;
        } else {
            return Err("an unmatched `}` (write `}}` for a brace)".into());
        }
    }
    text.push_str(rest);
    if !text.is_empty() {
        parts.push(PromptPart::Text(text.into()));
    }
    Ok(parts)
}

/// Phase two of a rubric's `judge` table (`key` is `data.domains.<d>.rubric.judge`); the
/// rubric's `weights` must name `judge`.
pub fn validate_judge(
    key: &str,
    weights: &BTreeMap<String, f64>,
    raw: RawJudge,
    ctx: &Ctx<'_>,
) -> Result<JudgeConfig, ConfigError> {
    if !weights.contains_key("judge") {
        return Err(ctx.value(
            key,
            "the table is for the `judge` reward function, which `weights` does not name (add `judge = 1.0` to `weights`)",
        ));
    }
    let url = raw.url.ok_or_else(|| {
        ctx.value(
            &format!("{key}.url"),
            "expected the judge server's base URL, e.g. `http://127.0.0.1:8000/v1`",
        )
    })?;
    if !url.starts_with("http://") {
        return Err(ctx.value(
            &format!("{key}.url"),
            format!("expected an `http://` base URL (TLS is not spoken), got `{url}`"),
        ));
    }
    let model = raw.model.filter(|m| !m.trim().is_empty()).ok_or_else(|| {
        ctx.value(
            &format!("{key}.model"),
            "expected the model name the judge server serves",
        )
    })?;
    let prompt = raw
        .prompt
        .unwrap_or_else(|| DEFAULT_JUDGE_PROMPT.to_owned());
    let parts = prompt_parts(&prompt).map_err(|m| ctx.value(&format!("{key}.prompt"), m))?;
    if !parts.contains(&PromptPart::Field("reply")) {
        return Err(ctx.value(
            &format!("{key}.prompt"),
            "expected the placeholder `{reply}`: the judge must see the reply it grades",
        ));
    }
    let score_regex = raw
        .score_regex
        .unwrap_or_else(|| DEFAULT_SCORE_REGEX.to_owned());
    match regex::Regex::new(&score_regex) {
        Ok(r) if r.captures_len() >= 2 => {}
        Ok(_) => {
            return Err(ctx.value(
                &format!("{key}.score_regex"),
                "expected a capture group around the score, e.g. `Score: (\\d+)`",
            ));
        }
        Err(e) => {
            let message = e.to_string();
            let reason: Vec<&str> = message.lines().map(str::trim).collect();
            return Err(ctx.value(
                &format!("{key}.score_regex"),
                format!("expected a valid regular expression: {}", reason.join(" ")),
            ));
        }
    }
    let concurrency = non_zero_u32(ctx, &format!("{key}.concurrency"), raw.concurrency)?;
    if concurrency.get() > 1024 {
        return Err(ctx.value(
            &format!("{key}.concurrency"),
            format!("expected 1–1024 requests in flight, got {concurrency}"),
        ));
    }
    Ok(JudgeConfig {
        url: url.trim_end_matches('/').to_owned(),
        model,
        prompt,
        system_prompt: raw.system_prompt,
        score_regex,
        max_score: number(
            ctx,
            &format!("{key}.max_score"),
            raw.max_score,
            "a number > 0",
            |v| v > 0.0,
        )?,
        max_tokens: non_zero_u32(ctx, &format!("{key}.max_tokens"), raw.max_tokens)?.get(),
        temperature: number(
            ctx,
            &format!("{key}.temperature"),
            raw.temperature,
            "a temperature in [0, 2]",
            |v| (0.0..=2.0).contains(&v),
        )?,
        concurrency: concurrency.get(),
        timeout: positive_seconds(ctx, &format!("{key}.timeout_s"), raw.timeout_s)?,
    })
}
