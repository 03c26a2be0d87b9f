//! `POST /v1/chat/completions`: messages rendered with the checkpoint's chat template (with
//! `tools`), the reply parsed back into content, reasoning and `tool_calls`; `logprobs` /
//! `top_logprobs`; SSE `stream`. With tools offered, a streamed reply is sent whole at the end
//! (tool-call markup cannot be parsed from a prefix); without, content streams token by token.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_core::message::FunctionCall;
use sluice_core::{Message, Role, ToolCall, ToolSpec};
use sluice_model::{ChatOptions, CompletionParser};

use super::completions::{
    MAX_LOGPROBS, Sampling, completion_text, finish_reason, parse_body, unix_now, usage,
};
use super::generate::{ChoiceOutput, launch};
use super::text::{Streamer, piece};
use super::{ApiError, ServerState};
use crate::native::RequestUpdate;

/// The body of a chat request.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<WireMessage>,
    #[serde(flatten)]
    sampling: Sampling,
    #[serde(default)]
    tools: Option<Vec<ToolSpec>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    logprobs: bool,
    top_logprobs: Option<i64>,
    /// Extra template variables (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`).
    #[serde(default)]
    chat_template_kwargs: serde_json::Map<String, Value>,
}

/// A message as OpenAI clients send it: `content` may be a list of text parts.
#[derive(Debug, Deserialize)]
struct WireMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<WireToolCall>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireToolCall {
    #[serde(default)]
    id: String,
    function: WireFunction,
}

#[derive(Debug, Deserialize)]
struct WireFunction {
    name: String,
    #[serde(default)]
    arguments: Value,
}

impl WireMessage {
    fn into_message(self, index: usize) -> Result<Message, ApiError> {
        let param = format!("messages[{index}]");
        let role = match self.role.as_str() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            other => return Err(ApiError::invalid(&param, format!("unknown role `{other}`"))),
        };
        let content = match self.content {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match p.get("text").and_then(Value::as_str) {
                        Some(t) => text.push_str(t),
                        None => {
                            return Err(ApiError::invalid(
                                &param,
                                "only text content parts are supported",
                            ));
                        }
                    }
                }
                Some(text)
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    &param,
                    "content must be a string or a list of parts",
                ));
            }
        };
        let tool_calls = self
            .tool_calls
            .into_iter()
            .map(|c| ToolCall {
                id: c.id,
                kind: "function".into(),
                function: FunctionCall {
                    name: c.function.name,
                    arguments: match c.function.arguments {
                        Value::String(s) => s,
                        other => other.to_string(),
                    },
                },
            })
            .collect();
        Ok(Message {
            role,
            content,
            reasoning_content: self.reasoning_content,
            tool_calls,
            tool_call_id: self.tool_call_id,
            name: self.name,
        })
    }
}

/// `POST /v1/chat/completions`.
pub async fn handle(
    State(state): State<Arc<ServerState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(&body)?;
    state.check_model(req.sampling.model.as_deref())?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let top = match req.top_logprobs {
        None => 0,
        Some(n) if (0..=MAX_LOGPROBS).contains(&n) => n as u32,
        Some(n) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("top_logprobs must be in [0, {MAX_LOGPROBS}], got {n}"),
            ));
        }
    };
    let messages = req
        .messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| m.into_message(i))
        .collect::<Result<Vec<_>, _>>()?;
    let tools_off = matches!(&req.tool_choice, Some(Value::String(s)) if s == "none");
    let tools = if tools_off {
        None
    } else {
        req.tools.filter(|t| !t.is_empty())
    };
    let options = ChatOptions {
        add_generation_prompt: true,
        tools: tools.clone(),
        extra: req.chat_template_kwargs,
    };
    let rendered = state
        .tokenizer
        .apply_chat_template(&messages, &options)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let prompt = state
        .tokenizer
        .encode(&rendered, false)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let specs = req.sampling.choices(&state, &prompt, None, (top, false))?;
    let stops = specs[0].stop.clone();
    let launched = launch(&state, req.sampling.rid.clone(), specs)?;
    let id = format!("chat{}", launched.response_id);
    let created = unix_now();
    let model = state.model_name().to_owned();
    let ctx = Render {
        logprobs: req.logprobs,
        token_ids: req.sampling.return_token_ids,
        tools: tools.is_some(),
        stops,
    };
    if req.sampling.stream {
        let head = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model});
        return Ok(stream(state, launched, ctx, head).into_response());
    }
    let n = launched_len(&launched);
    let outputs = launched.collect(&vec![prompt.clone(); n]).await?;
    let choices: Vec<Value> = outputs
        .iter()
        .enumerate()
        .map(|(i, o)| choice_json(&state, &id, i, o, &ctx))
        .collect();
    let completion_tokens: usize = outputs.iter().map(|o| o.completion.output.len()).sum();
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt.len() * n, completion_tokens),
    }))
    .into_response())
}

fn launched_len(l: &super::generate::Launched) -> usize {
    l.len()
}

struct Render {
    logprobs: bool,
    token_ids: bool,
    tools: bool,
    stops: Vec<String>,
}

/// The assistant message of a completion: parsed for reasoning and tool calls when it parses,
/// the raw text as content when it does not (as vLLM does).
fn reply(id: &str, index: usize, text: &str) -> (Value, bool) {
    match CompletionParser::default().parse(text, &format!("call_{id}_{index}_")) {
        Ok(m) => {
            let calls = !m.tool_calls.is_empty();
            let mut v = json!({"role": "assistant", "content": m.content});
            if let Some(r) = m.reasoning_content {
                v["reasoning_content"] = json!(r);
            }
            if calls {
                v["tool_calls"] = json!(m.tool_calls);
            }
            (v, calls)
        }
        Err(_) => (json!({"role": "assistant", "content": text}), false),
    }
}

fn logprob_entry(state: &ServerState, token: u32, logprob: f32, top: &[(u32, f32)]) -> Value {
    let p = piece(&state.tokenizer, token);
    json!({
        "token": p,
        "logprob": logprob,
        "bytes": p.as_bytes(),
        "top_logprobs": top.iter().map(|&(t, l)| {
            let q = piece(&state.tokenizer, t);
            json!({"token": q, "logprob": l, "bytes": q.as_bytes()})
        }).collect::<Vec<_>>(),
    })
}

fn choice_json(
    state: &ServerState,
    id: &str,
    index: usize,
    o: &ChoiceOutput,
    ctx: &Render,
) -> Value {
    let text = completion_text(state, o, &ctx.stops);
    let (message, calls) = reply(id, index, &text);
    let out = &o.completion.output;
    let logprobs = if ctx.logprobs {
        let content: Vec<Value> = (0..out.len())
            .map(|i| {
                let top = o.tokens.get(i).map(|s| s.top.as_slice()).unwrap_or(&[]);
                logprob_entry(state, out.token_ids[i], out.logprobs[i], top)
            })
            .collect();
        json!({"content": content})
    } else {
        Value::Null
    };
    let reason = if calls && o.completion.finish == crate::backend::FinishReason::Stop {
        "tool_calls"
    } else {
        finish_reason(&o.completion.finish)
    };
    let mut choice =
        json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason});
    if ctx.token_ids {
        choice["prompt_token_ids"] = json!(o.prompt);
        choice["token_ids"] = json!(out.token_ids);
        choice["token_versions"] = json!(out.versions.iter().map(|v| v.0).collect::<Vec<_>>());
    }
    choice
}

/// SSE chunks: a role delta, content deltas (or, with tools, the whole parsed reply at the
/// end), a finish chunk per choice, then `[DONE]`.
fn stream(
    state: Arc<ServerState>,
    launched: super::generate::Launched,
    ctx: Render,
    head: Value,
) -> impl IntoResponse {
    let n = launched.len();
    let init = (
        launched,
        Vec::<Option<Streamer>>::new(),
        vec![String::new(); n],
        false,
    );
    let ctx = Arc::new(ctx);
    let events = futures::stream::unfold(
        init,
        move |(mut launched, mut streamers, mut texts, done)| {
            let state = Arc::clone(&state);
            let ctx = Arc::clone(&ctx);
            let head = head.clone();
            let mut chunk = head.clone();
            async move {
                if done {
                    return None;
                }
                loop {
                    let Some((i, update)) = launched.next().await else {
                        let e = Event::default().data("[DONE]");
                        return Some((
                            Ok::<_, std::convert::Infallible>(e),
                            (launched, streamers, texts, true),
                        ));
                    };
                    while streamers.len() <= i {
                        streamers.push(None);
                    }
                    let first = streamers[i].is_none();
                    let s = streamers[i].get_or_insert_with(|| Streamer::new(ctx.stops.clone()));
                    let c = match update {
                        RequestUpdate::PromptLogprobs(_) => continue,
                        RequestUpdate::Token(t) => {
                            let piece_text = s.push(&state.tokenizer, t.token);
                            let mut delta = json!({});
                            if first {
                                delta["role"] = json!("assistant");
                            }
                            if ctx.tools {
                                texts[i].push_str(&piece_text);
                            } else {
                                delta["content"] = json!(piece_text);
                            }
                            let mut c = json!({"index": i, "delta": delta, "finish_reason": null, "logprobs": null});
                            if ctx.logprobs {
                                c["logprobs"] = json!({"content": [logprob_entry(&state, t.token, t.logprob, &t.top)]});
                            }
                            if ctx.token_ids {
                                c["token_ids"] = json!([t.token]);
                                c["token_versions"] = json!([t.version.0]);
                            }
                            c
                        }
                        RequestUpdate::Finished { completion, .. } => {
                            let rest = s.finish(&state.tokenizer);
                            let mut reason = finish_reason(&completion.finish);
                            let delta = if ctx.tools {
                                texts[i].push_str(&rest);
                                let id = head["id"].as_str().unwrap_or_default().to_owned();
                                let (mut m, calls) = reply(&id, i, &texts[i]);
                                if calls && reason == "stop" {
                                    reason = "tool_calls";
                                }
                                if let Some(calls) =
                                    m.get_mut("tool_calls").and_then(Value::as_array_mut)
                                {
                                    for (k, call) in calls.iter_mut().enumerate() {
                                        call["index"] = json!(k);
                                    }
                                }
                                m
                            } else {
                                json!({"content": rest})
                            };
                            json!({"index": i, "delta": delta, "finish_reason": reason, "logprobs": null})
                        }
                    };
                    chunk["choices"] = json!([c]);
                    let e = Event::default().data(chunk.to_string());
                    return Some((Ok(e), (launched, streamers, texts, false)));
                }
            }
        },
    );
    Sse::new(events)
}
