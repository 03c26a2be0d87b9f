//! The `judge` reward function: a model behind an OpenAI-compatible chat endpoint (vLLM,
//! SGLang, `sluice serve`) grades each reply, as RLAIF and generative reward models do. The
//! rubric's `[judge]` table ([`sluice_data::config::JudgeConfig`]) sets the server, the prompt
//! and how the score is read from the answer:
//!
//! - the prompt's `{question}` is the last user message of the rollout's first prompt (the
//!   question as the policy saw it), `{reply}` the rollout's final reply, `{reference}` the
//!   sample's reference answer (the domain's answer field; empty when the row has none);
//! - the answer's score is group 1 of the last match of `score_regex`, divided by `max_score`
//!   and clamped to [0, 1];
//! - at most `concurrency` requests are in flight per domain, each bounded by `timeout_s`;
//! - an answer without a score, a refused request or an unreachable server fails the rollout's
//!   scoring with the reason (the rubric's `error_reward` applies; `sluice_env_failures_total`
//!   counts it) rather than inventing a score. `sluice_env_judge_requests_total{outcome}` counts
//!   scored, unparsed and failed requests; `sluice_env_judge_seconds` times them.

use std::sync::Arc;
use std::time::Instant;

use regex::Regex;
use serde_json::{Value, json};
use sluice_core::Role;
use sluice_core::config::Secret;
use sluice_core::metrics::{ENV_JUDGE_REQUESTS, ENV_JUDGE_SECONDS};
use sluice_data::config::{JudgeConfig, PromptPart, prompt_parts};
use sluice_http::{HttpClient, Method};
use tokio::sync::Semaphore;

use crate::reward_fns::sample_field;
use crate::rubric::ScoreInput;

/// The environment variable holding the bearer token judge requests carry (an OpenAI-style
/// API key), when set.
pub const JUDGE_TOKEN_VAR: &str = "SLUICE_JUDGE_TOKEN";

/// The `outcome` label values of `sluice_env_judge_requests_total`.
pub const OUTCOMES: [&str; 3] = ["scored", "unparsed", "failed"];

/// How much of a judge's answer an error quotes.
const QUOTED_CHARS: usize = 200;

/// One domain's judge: its server, prompt, score pattern and request budget.
#[derive(Debug)]
pub struct Judge {
    client: HttpClient,
    config: JudgeConfig,
    pattern: Regex,
    permits: Semaphore,
    /// The sample field holding the reference answer.
    reference_field: String,
}

impl Judge {
    /// The judge `config` sets up, reading references from `reference_field` and sending
    /// `token` as a bearer token when given.
    pub fn new(
        config: &JudgeConfig,
        reference_field: &str,
        token: Option<Secret>,
    ) -> Result<Self, String> {
        let client = HttpClient::new(&config.url, "judge")
            .map_err(|e| format!("url: {e}"))?
            .with_token(token)
            .with_max_body_bytes(4 << 20);
        let pattern = Regex::new(&config.score_regex).map_err(|e| format!("score_regex: {e}"))?;
        prompt_parts(&config.prompt).map_err(|e| format!("prompt: {e}"))?;
        Ok(Self {
            client,
            config: config.clone(),
            pattern,
            permits: Semaphore::new(config.concurrency.max(1) as usize),
            reference_field: reference_field.to_owned(),
        })
    }

    /// [`Judge::new`] with `$SLUICE_JUDGE_TOKEN` as the token when it is set.
    pub fn from_env(config: &JudgeConfig, reference_field: &str) -> Result<Self, String> {
        let token = sluice_http::auth::token_from_env(JUDGE_TOKEN_VAR)?;
        Self::new(config, reference_field, token)
    }

    /// The prompt for `input`'s rollout, placeholders filled.
    pub fn prompt_for(&self, input: &ScoreInput) -> String {
        let question = input
            .rollout
            .turns
            .first()
            .and_then(|t| {
                t.prompt_messages
                    .iter()
                    .rev()
                    .find(|m| m.role == Role::User)
            })
            .and_then(|m| m.content.as_deref())
            .unwrap_or("");
        let reference = match sample_field(&input.sample.input, &self.reference_field) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(other) => other.to_string(),
        };
        let reply = input.final_text().unwrap_or("");
        let mut out = String::with_capacity(self.config.prompt.len() + reply.len());
        // The prompt's parts were checked when the judge was built.
        for part in prompt_parts(&self.config.prompt).unwrap_or_default() {
            match part {
                PromptPart::Text(t) => out.push_str(&t),
                PromptPart::Field("question") => out.push_str(question),
                PromptPart::Field("reference") => out.push_str(&reference),
                PromptPart::Field(_) => out.push_str(reply),
            }
        }
        out
    }

    /// The score in [0, 1] the judge gives `input`'s reply, or why there is none.
    pub async fn score(&self, input: &ScoreInput) -> Result<f64, String> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| "the judge is shut down".to_owned())?;
        let started = Instant::now();
        let result = self.ask(&self.prompt_for(input)).await;
        metrics::histogram!(ENV_JUDGE_SECONDS).record(started.elapsed().as_secs_f64());
        let outcome = match &result {
            Ok(_) => OUTCOMES[0],
            Err(JudgeFailure::Unparsed(_)) => OUTCOMES[1],
            Err(JudgeFailure::Request(_)) => OUTCOMES[2],
        };
        metrics::counter!(ENV_JUDGE_REQUESTS, "outcome" => outcome).increment(1);
        result.map_err(|e| match e {
            JudgeFailure::Unparsed(m) | JudgeFailure::Request(m) => m,
        })
    }

    /// One request: the answer's score, normalised.
    async fn ask(&self, prompt: &str) -> Result<f64, JudgeFailure> {
        let mut messages = Vec::with_capacity(2);
        if let Some(system) = &self.config.system_prompt {
            messages.push(json!({ "role": "system", "content": system }));
        }
        messages.push(json!({ "role": "user", "content": prompt }));
        let body = json!({
            "model": self.config.model,
            "messages": messages,
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
        });
        let url = self.client.url();
        let (status, answer) = self
            .client
            .call(
                Method::POST,
                "/chat/completions",
                Some(body.to_string().into_bytes()),
                self.config.timeout,
            )
            .await
            .map_err(|e| JudgeFailure::Request(format!("judge: {e}")))?;
        if !status.is_success() {
            return Err(JudgeFailure::Request(format!(
                "judge at {url} answered {status}: {}",
                quote(&String::from_utf8_lossy(&answer))
            )));
        }
        let text = serde_json::from_slice::<Value>(&answer)
            .ok()
            .and_then(|v| {
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .ok_or_else(|| {
                JudgeFailure::Request(format!(
                    "judge at {url}: the answer has no `choices[0].message.content`: {}",
                    quote(&String::from_utf8_lossy(&answer))
                ))
            })?;
        let score = self
            .pattern
            .captures_iter(&text)
            .last()
            .and_then(|c| c.get(1))
            .and_then(|m| m.as_str().trim().parse::<f64>().ok())
            .filter(|s| s.is_finite())
            .ok_or_else(|| {
                JudgeFailure::Unparsed(format!(
                    "judge at {url}: no score matching `{}` in its answer: {}",
                    self.config.score_regex,
                    quote(&text)
                ))
            })?;
        Ok((score / self.config.max_score).clamp(0.0, 1.0))
    }
}

/// Why a judge request gave no score.
enum JudgeFailure {
    /// The answer came but held no score.
    Unparsed(String),
    /// No usable answer came.
    Request(String),
}

/// The first [`QUOTED_CHARS`] characters of `s`, quoted, with `…` when cut.
fn quote(s: &str) -> String {
    let mut cut: String = s.chars().take(QUOTED_CHARS).collect();
    if cut.len() < s.len() {
        cut.push('…');
    }
    format!("«{cut}»")
}

/// The rubric function `judge` with `weight`, scoring through `judge`.
pub fn reward_fn(judge: Arc<Judge>, weight: f64) -> crate::rubric::RewardFn {
    crate::rubric::RewardFn::new_async("judge", weight, move |input| {
        let judge = Arc::clone(&judge);
        async move { judge.score(&input).await }
    })
}
