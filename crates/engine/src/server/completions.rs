//! `POST /v1/completions`: prompts as text or token ids (one or a batch), `n` choices each,
//! `logprobs` (with `echo`, the prompt's too, as vLLM does), `stop`, SSE `stream`, and the RL
//! extensions `return_token_ids` (adds `prompt_token_ids`, `token_ids` and Sluice's per-token
//! `token_versions` to each choice), `rid`, `top_k`, `stop_token_ids`, `ignore_eos`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

mod stream;

use super::generate::{ChoiceOutput, ChoiceSpec, launch};
use super::limits::{Unsupported, check_logprob_budget, unsupported};
use super::prompt_text::encode_all;
use super::text::{decode, piece};
use super::{ApiError, ServerState};
use crate::backend::{FinishReason, SamplingParams};
use crate::native::{PromptLogprob, StopHit, truncate_at_stop};

/// Most alternatives per token (OpenAI's limit).
pub const MAX_LOGPROBS: i64 = 20;

/// Parses a JSON body, answering 400 with the parser's message.
pub(crate) fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    sluice_http::api::parse_json(body, "invalid_request_error", "invalid JSON body")
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum StopField {
    One(String),
    Many(Vec<String>),
}

/// Sampling fields shared by both generation routes.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct Sampling {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub n: Option<i64>,
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub stream: bool,
    /// `{"include_usage": true}`: a streamed call ends with a chunk of its usage.
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub return_token_ids: bool,
    pub rid: Option<String>,
    /// Fields this server does not implement: accepted only at their neutral value
    /// ([`Unsupported::check`]).
    #[serde(flatten)]
    pub unsupported: Unsupported,
}

/// What a streamed call asks of its stream (OpenAI's `stream_options`).
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

impl Sampling {
    /// Whether the stream ends with a usage chunk; `stream_options` on a call that does not
    /// stream was refused by [`Sampling::choices`].
    pub(crate) fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }

    /// Validated choices for one prompt (`n` of them, seeds spread by index).
    pub(crate) fn choices(
        &self,
        state: &ServerState,
        prompt: &[u32],
        default_max_tokens: Option<usize>,
        logprobs: (u32, bool),
    ) -> Result<Vec<ChoiceSpec>, ApiError> {
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options is only allowed with `stream: true`",
            ));
        }
        let context = state.context_len();
        let vocab = state.control.model_config().vocab_size;
        if prompt.is_empty() {
            return Err(ApiError::invalid("prompt", "the prompt is empty"));
        }
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                "prompt",
                format!("token id {t} is outside the vocabulary (0..{vocab})"),
            ));
        }
        if prompt.len() >= context {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "This model's maximum context length is {context} tokens; the prompt has {}.",
                    prompt.len()
                ),
            ));
        }
        let room = context - prompt.len();
        let max_tokens = match self.max_tokens.or(self.max_completion_tokens) {
            Some(m) if m < 0 => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!("max_tokens must be >= 0, got {m}"),
                ));
            }
            Some(m) if m as u64 > room as u64 => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!(
                        "This model's maximum context length is {context} tokens; you requested {} ({} in the prompt, {m} to generate).",
                        prompt.len() as i64 + m,
                        prompt.len()
                    ),
                ));
            }
            Some(m) => m as u32,
            None => default_max_tokens.unwrap_or(room).min(room) as u32,
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=100.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature must be in [0, 100], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 && k <= u32::MAX as i64 => k as u32,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be -1, 0 or positive, got {k}"),
                ));
            }
        };
        let n = self.n.unwrap_or(1);
        if n < 1 || n > state.options.max_n as i64 {
            return Err(ApiError::invalid(
                "n",
                format!("n must be in [1, {}], got {n}", state.options.max_n),
            ));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        if stop.len() > 16 {
            return Err(ApiError::invalid("stop", "at most 16 stop strings"));
        }
        let mut stop_token_ids = Vec::new();
        for &t in self.stop_token_ids.iter().flatten() {
            if t < 0 || t as usize >= vocab {
                return Err(ApiError::invalid(
                    "stop_token_ids",
                    format!("token id {t} is outside the vocabulary"),
                ));
            }
            stop_token_ids.push(t as u32);
        }
        Ok((0..n as u64)
            .map(|i| ChoiceSpec {
                prompt: prompt.to_vec(),
                params: SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    max_tokens,
                    seed: self.seed.map(|s| (s as u64).wrapping_add(i)),
                    stop_token_ids: stop_token_ids.clone(),
                },
                stop: stop.clone(),
                ignore_eos: self.ignore_eos.unwrap_or(false),
                top_logprobs: logprobs.0,
                prompt_logprobs: logprobs.1,
            })
            .collect())
    }
}

/// The body of a completions request.
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: Value,
    #[serde(flatten)]
    sampling: Sampling,
    logprobs: Option<i64>,
    #[serde(default)]
    echo: bool,
    /// Not implemented: only `null`, 1 or `n` (one candidate per choice) are accepted.
    best_of: Option<Value>,
    /// Not implemented: only `null` or `""` are accepted.
    suffix: Option<Value>,
}

impl CompletionRequest {
    /// Refuses `best_of` and `suffix` at values that would change the output.
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let n = self.sampling.n.unwrap_or(1);
        match &self.best_of {
            None | Some(Value::Null) => {}
            Some(v) if v.as_i64() == Some(1) || v.as_i64() == Some(n) => {}
            Some(v) => return Err(unsupported("best_of", v, "1 or `n`")),
        }
        match &self.suffix {
            None | Some(Value::Null) => Ok(()),
            Some(Value::String(s)) if s.is_empty() => Ok(()),
            Some(v) => Err(unsupported("suffix", v, "`null` or \"\"")),
        }
    }
}

/// `prompt`: a string, a list of strings, a list of ids or a list of lists of ids. Texts are
/// bounded in size first, then tokenized off the runtime.
async fn prompts(state: &ServerState, prompt: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        )
    };
    let ids = |v: &Value| -> Result<Vec<u32>, ApiError> {
        v.as_array()
            .ok_or_else(bad)?
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| ApiError::invalid("prompt", format!("`{x}` is not a token id")))
            })
            .collect()
    };
    let texts: Vec<String> = match prompt {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) if items.is_empty() => return Err(bad()),
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|i| i.as_str().map(str::to_owned).ok_or_else(bad))
                .collect::<Result<_, _>>()?,
            Value::Array(_) => return items.iter().map(ids).collect(),
            _ => return Ok(vec![ids(prompt)?]),
        },
        _ => return Err(bad()),
    };
    for t in &texts {
        state.check_prompt_bytes("prompt", t.len())?;
    }
    encode_all(Arc::clone(&state.tokenizer), texts, true, "prompt").await
}

/// `POST /v1/completions`.
pub async fn handle(
    State(state): State<Arc<ServerState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(&body)?;
    state.check_model(req.sampling.model.as_deref())?;
    req.refuse_unsupported()?;
    req.sampling.unsupported.check()?;
    let logprobs = match req.logprobs {
        None => None,
        Some(n) if (0..=MAX_LOGPROBS).contains(&n) => Some(n as u32),
        Some(n) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be in [0, {MAX_LOGPROBS}], got {n}"),
            ));
        }
    };
    let prompt_ids = prompts(&state, &req.prompt).await?;
    let echo_logprobs = req.echo && logprobs.is_some();
    let mut specs = Vec::new();
    let mut prompt_of = Vec::new();
    for (p, ids) in prompt_ids.iter().enumerate() {
        let want = (logprobs.unwrap_or(0), echo_logprobs);
        for (copy, mut spec) in req
            .sampling
            .choices(&state, ids, Some(16), want)?
            .into_iter()
            .enumerate()
        {
            // A prompt's log-probabilities are the same for each of its `n` choices: the
            // engine computes them once (a stream sends each choice's own, in its first chunk).
            spec.prompt_logprobs &= req.sampling.stream || copy == 0;
            prompt_of.push(p);
            specs.push(spec);
        }
    }
    check_logprob_budget("logprobs", &specs, logprobs, req.echo, req.sampling.stream)?;
    let stops = specs[0].stop.clone();
    let launched = launch(&state, req.sampling.rid.clone(), specs)?;
    let id = launched.response_id.clone();
    let created = unix_now();
    let model = state.model_name().to_owned();
    let shape = Shape {
        logprobs,
        echo: req.echo,
        token_ids: req.sampling.return_token_ids,
        stops,
    };
    if req.sampling.stream {
        let echo_texts = if shape.echo {
            let texts: Vec<Arc<str>> = prompt_ids
                .iter()
                .map(|ids| decode(&state.tokenizer, ids).into())
                .collect();
            prompt_of.iter().map(|&p| Arc::clone(&texts[p])).collect()
        } else {
            Vec::new()
        };
        let head = stream::StreamHead {
            id,
            created,
            model,
            include_usage: req.sampling.include_usage(),
            prompt_tokens: prompt_ids.iter().map(Vec::len).sum(),
        };
        return Ok(stream::stream(state, launched, shape, head, echo_texts).into_response());
    }
    let prompts_of_choices: Vec<Vec<u32>> =
        prompt_of.iter().map(|&p| prompt_ids[p].clone()).collect();
    let outputs = launched.collect(&prompts_of_choices).await?;
    drop(prompts_of_choices);
    // The echoed part of each prompt (its text and log-probabilities), rendered once.
    let mut echoed: Vec<Option<Echo>> = (0..prompt_ids.len()).map(|_| None).collect();
    if shape.echo {
        for (o, &p) in outputs.iter().zip(&prompt_of) {
            if echoed[p].is_none() || o.prompt_logprobs.is_some() {
                echoed[p] = Some(Echo::new(&state, &o.prompt, o.prompt_logprobs.as_deref()));
            }
        }
    }
    let choices: Vec<Value> = outputs
        .iter()
        .zip(&prompt_of)
        .enumerate()
        .map(|(i, (o, &p))| choice_json(&state, i, o, &shape, echoed[p].as_ref()))
        .collect();
    let prompt_tokens: usize = prompt_ids.iter().map(Vec::len).sum();
    let completion_tokens: usize = outputs.iter().map(|o| o.completion.output.len()).sum();
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }))
    .into_response())
}

/// A prompt's echoed part: its text and the log-probabilities of its tokens.
struct Echo {
    text: String,
    logprobs: LogprobsJson,
}

impl Echo {
    fn new(state: &ServerState, prompt: &[u32], logprobs: Option<&[PromptLogprob]>) -> Self {
        let mut lp = LogprobsJson::default();
        for p in logprobs.into_iter().flatten() {
            lp.push(state, p.token, p.logprob, &p.top);
        }
        Self {
            text: decode(&state.tokenizer, prompt),
            logprobs: lp,
        }
    }
}

/// How choices are rendered.
struct Shape {
    logprobs: Option<u32>,
    echo: bool,
    token_ids: bool,
    stops: Vec<String>,
}

/// The last chunk of a stream asked for with `stream_options.include_usage`: the stream's
/// `head` (id, object, created, model) with no choices and the call's usage.
pub(crate) fn usage_chunk(head: &Value, prompt: usize, completion: usize) -> Event {
    let mut last = head.clone();
    last["choices"] = json!([]);
    last["usage"] = usage(prompt, completion);
    Event::default().data(last.to_string())
}

pub(crate) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// OpenAI's finish reasons, plus `abort` (SGLang's) and `error`.
pub(crate) fn finish_reason(f: &FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
        FinishReason::Error(_) => "error",
    }
}

/// The completion text, cut before a stop string that ended it.
pub(crate) fn completion_text(state: &ServerState, o: &ChoiceOutput, stops: &[String]) -> String {
    let text = decode(&state.tokenizer, &o.completion.output.token_ids);
    match &o.stop {
        Some(StopHit::String(_)) => truncate_at_stop(&text, stops).to_owned(),
        _ => text,
    }
}

fn choice_json(
    state: &ServerState,
    index: usize,
    o: &ChoiceOutput,
    shape: &Shape,
    echo: Option<&Echo>,
) -> Value {
    let mut text = completion_text(state, o, &shape.stops);
    let mut lp = LogprobsJson::default();
    if let Some(echo) = echo {
        if shape.logprobs.is_some() {
            lp = echo.logprobs.clone();
        }
        text = echo.text.clone() + &text;
    }
    for (i, &t) in o.completion.output.token_ids.iter().enumerate() {
        let top = o.tokens.get(i).map(|s| s.top.as_slice()).unwrap_or(&[]);
        lp.push(state, t, Some(o.completion.output.logprobs[i]), top);
    }
    let mut choice = json!({
        "index": index,
        "text": text,
        "logprobs": if shape.logprobs.is_some() { lp.to_json() } else { Value::Null },
        "finish_reason": finish_reason(&o.completion.finish),
    });
    if shape.token_ids {
        choice["prompt_token_ids"] = json!(o.prompt);
        choice["token_ids"] = json!(o.completion.output.token_ids);
        choice["token_versions"] = json!(
            o.completion
                .output
                .versions
                .iter()
                .map(|v| v.0)
                .collect::<Vec<_>>()
        );
    }
    if let Some(StopHit::String(s)) = &o.stop {
        choice["stop_reason"] = json!(s);
    } else if let Some(StopHit::Token(t)) = &o.stop {
        choice["stop_reason"] = json!(t);
    }
    choice
}

/// The legacy completions `logprobs` object.
#[derive(Default, Clone)]
struct LogprobsJson {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top: Vec<Value>,
    offsets: Vec<usize>,
    at: usize,
}

impl LogprobsJson {
    /// The log-probabilities of tokens whose text starts `at` characters into the choice's.
    fn starting_at(at: usize) -> Self {
        Self {
            at,
            ..Self::default()
        }
    }

    fn push(&mut self, state: &ServerState, token: u32, logprob: Option<f32>, top: &[(u32, f32)]) {
        let p = piece(&state.tokenizer, token);
        self.offsets.push(self.at);
        self.at += p.chars().count();
        self.tokens.push(p);
        self.token_logprobs.push(logprob);
        let map: BTreeMap<String, f32> = top
            .iter()
            .map(|&(t, l)| (piece(&state.tokenizer, t), l))
            .collect();
        self.top.push(if logprob.is_none() {
            Value::Null
        } else {
            json!(map)
        });
    }

    fn to_json(&self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top,
            "text_offset": self.offsets,
        })
    }
}
