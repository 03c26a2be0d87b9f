//! `POST /v1/chat/completions`: messages rendered with the checkpoint's chat template (with
//! `tools`), the reply parsed back into content, reasoning and `tool_calls`; `logprobs` /
//! `top_logprobs`; SSE `stream`, where reasoning, content and tool calls (header, then argument
//! fragments) stream as they are generated and reassemble to the non-streamed reply
//! (`reply_stream`).

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_core::message::FunctionCall;
use sluice_core::{Message, Role, ToolCall, ToolSpec};
use sluice_model::ChatOptions;

use super::completions::{
    MAX_LOGPROBS, Sampling, completion_text, finish_reason, parse_body, unix_now, usage,
    usage_chunk,
};
use super::generate::{ChoiceOutput, launch};
use super::limits::{check_logprob_budget, unsupported};
use super::prompt_text::{chat_text_bytes, render_chat};
use super::reply_stream::{Parsing, ReplyStream, delta_chunks, parse_reply};
use super::text::{Streamer, piece};
use super::{ApiError, ServerState};
use crate::native::RequestUpdate;

/// Template variables the server itself sets, which `chat_template_kwargs` may not replace
/// (nor the special tokens, every name ending in `_token`: `bos_token`, `eos_token`, …).
const RESERVED_TEMPLATE_VARIABLES: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

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
    #[serde(default, deserialize_with = "sluice_core::message::null_as_default")]
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
        Some(n) if n > 0 && !req.logprobs => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs `logprobs: true` (it says how many alternatives each reported token has)",
            ));
        }
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
    req.sampling.unsupported.check()?;
    let tools_off = match &req.tool_choice {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) if s == "auto" => false,
        Some(Value::String(s)) if s == "none" => true,
        Some(v) => {
            return Err(unsupported(
                "tool_choice",
                v,
                "\"auto\" or \"none\" (the model decides whether to call a tool)",
            ));
        }
    };
    if let Some(name) = RESERVED_TEMPLATE_VARIABLES
        .iter()
        .find(|&&r| req.chat_template_kwargs.contains_key(r))
        .map(|r| (*r).to_owned())
        .or_else(|| {
            req.chat_template_kwargs
                .keys()
                .find(|k| k.ends_with("_token"))
                .cloned()
        })
    {
        return Err(ApiError::invalid(
            "chat_template_kwargs",
            format!(
                "`chat_template_kwargs` may not set `{name}`: the server sets it (reserved: {}, and the special tokens `*_token`)",
                RESERVED_TEMPLATE_VARIABLES.join(", ")
            ),
        ));
    }
    let tools = if tools_off {
        None
    } else {
        req.tools.filter(|t| !t.is_empty())
    };
    // A reply is parsed for tool calls only when tools were offered, and for reasoning only
    // when the model's template reasons: other replies are the text as generated.
    let parsing = Parsing {
        reasoning: state
            .tokenizer
            .chat_template()
            .is_some_and(|t| t.has_reasoning()),
        tools: tools.is_some(),
    };
    state.check_prompt_bytes("messages", chat_text_bytes(&messages, tools.as_ref()))?;
    let options = ChatOptions {
        add_generation_prompt: true,
        tools,
        extra: req.chat_template_kwargs,
    };
    let (rendered, prompt) = render_chat(&state, messages, options).await?;
    let specs = req.sampling.choices(&state, &prompt, None, (top, false))?;
    let reported = req.logprobs.then_some(top);
    check_logprob_budget("top_logprobs", &specs, reported, false, req.sampling.stream)?;
    let stops = specs[0].stop.clone();
    let launched = launch(&state, req.sampling.rid.clone(), specs)?;
    let id = format!("chat{}", launched.response_id);
    let created = unix_now();
    let model = state.model_name().to_owned();
    let ctx = Render {
        logprobs: req.logprobs,
        token_ids: req.sampling.return_token_ids,
        stops,
        usage_of_prompt: req.sampling.include_usage().then_some(prompt.len()),
        parsing,
    };
    if req.sampling.stream {
        let head = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model});
        let replies = (0..launched.len())
            .map(|i| ReplyStream::new(&rendered, call_prefix(&id, i), parsing))
            .collect();
        return Ok(stream(state, launched, ctx, head, replies).into_response());
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
        "usage": usage(prompt.len(), completion_tokens),
    }))
    .into_response())
}

fn launched_len(l: &super::generate::Launched) -> usize {
    l.len()
}

struct Render {
    logprobs: bool,
    token_ids: bool,
    stops: Vec<String>,
    /// `stream_options.include_usage`: the prompt's tokens, for the stream's last chunk.
    usage_of_prompt: Option<usize>,
    /// What the reply is parsed for.
    parsing: Parsing,
}

/// Tool-call ids of choice `index`: `call_{id}_{index}_{k}`.
fn call_prefix(id: &str, index: usize) -> String {
    format!("call_{id}_{index}_")
}

/// The assistant message of a completion (see [`parse_reply`]) and whether it has tool calls.
fn reply(id: &str, index: usize, text: &str, parsing: Parsing) -> (Value, bool) {
    let m = parse_reply(text, &call_prefix(id, index), parsing);
    let calls = !m.tool_calls.is_empty();
    let mut v = json!({"role": "assistant", "content": m.content});
    if let Some(r) = m.reasoning {
        v["reasoning_content"] = json!(r);
    }
    if calls {
        v["tool_calls"] = json!(m.tool_calls);
    }
    (v, calls)
}

/// One token's log-probability as OpenAI's chat format has it: `bytes` are the token's own
/// (part of a character for some byte-level tokens, whose `token` text then shows U+FFFD), so
/// that a client can rebuild the text from them.
fn logprob_entry(state: &ServerState, token: u32, logprob: f32, top: &[(u32, f32)]) -> Value {
    json!({
        "token": piece(&state.tokenizer, token),
        "logprob": logprob,
        "bytes": state.tokenizer.token_bytes(token),
        "top_logprobs": top.iter().map(|&(t, l)| {
            json!({
                "token": piece(&state.tokenizer, t),
                "logprob": l,
                "bytes": state.tokenizer.token_bytes(t),
            })
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
    let (message, calls) = reply(id, index, &text, ctx.parsing);
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

/// SSE chunks: per token, the deltas that are now certain (the first chunk of a choice with the
/// role; a tool call's header alone in its chunk), the token's log-probabilities and ids on the
/// first of them; per choice, the chunks completing the reply, the last with the finish reason;
/// with `stream_options.include_usage` a chunk of the call's usage and no choices; then
/// `[DONE]`.
fn stream(
    state: Arc<ServerState>,
    launched: super::generate::Launched,
    ctx: Render,
    head: Value,
    replies: Vec<ReplyStream>,
) -> impl IntoResponse {
    let n = launched.len();
    // The state between chunks; `generated`: completion tokens of the finished choices, for
    // the usage chunk.
    let init = (
        launched,
        (0..n).map(|_| None).collect::<Vec<Option<Streamer>>>(),
        replies,
        0usize,
        false,
    );
    let ctx = Arc::new(ctx);
    let batches = futures::stream::unfold(
        init,
        move |(mut launched, mut streamers, mut replies, mut generated, done)| {
            let state = Arc::clone(&state);
            let ctx = Arc::clone(&ctx);
            let head = head.clone();
            async move {
                if done {
                    return None;
                }
                loop {
                    let Some((i, update)) = launched.next().await else {
                        let usage = ctx
                            .usage_of_prompt
                            .map(|prompt| usage_chunk(&head, prompt, generated));
                        let done = Event::default().data("[DONE]");
                        let events: Vec<Event> = usage.into_iter().chain([done]).collect();
                        return Some((events, (launched, streamers, replies, generated, true)));
                    };
                    let first = streamers[i].is_none();
                    let s = streamers[i].get_or_insert_with(|| Streamer::new(ctx.stops.clone()));
                    let mut choices = match update {
                        RequestUpdate::PromptLogprobs(_) => continue,
                        RequestUpdate::Token(t) => {
                            let piece_text = s.push(&state.tokenizer, t.token);
                            let mut choices: Vec<Value> = delta_chunks(&replies[i].push(&piece_text))
                                .into_iter()
                                .map(|delta| json!({"index": i, "delta": delta, "finish_reason": null, "logprobs": null}))
                                .collect();
                            let c = &mut choices[0];
                            if ctx.logprobs {
                                c["logprobs"] = json!({"content": [logprob_entry(&state, t.token, t.logprob, &t.top)]});
                            }
                            if ctx.token_ids {
                                c["token_ids"] = json!([t.token]);
                                c["token_versions"] = json!([t.version.0]);
                            }
                            choices
                        }
                        RequestUpdate::Finished { completion, .. } => {
                            generated += completion.output.len();
                            let rest = s.finish(&state.tokenizer);
                            let (deltas, parsed) = replies[i].finish(&rest);
                            let mut reason = finish_reason(&completion.finish);
                            if !parsed.tool_calls.is_empty() && reason == "stop" {
                                reason = "tool_calls";
                            }
                            let mut choices: Vec<Value> = delta_chunks(&deltas)
                                .into_iter()
                                .map(|delta| json!({"index": i, "delta": delta, "finish_reason": null, "logprobs": null}))
                                .collect();
                            if let Some(last) = choices.last_mut() {
                                last["finish_reason"] = json!(reason);
                            }
                            choices
                        }
                    };
                    if first {
                        choices[0]["delta"]["role"] = json!("assistant");
                    }
                    let events = choices
                        .into_iter()
                        .map(|c| {
                            let mut chunk = head.clone();
                            chunk["choices"] = json!([c]);
                            Event::default().data(chunk.to_string())
                        })
                        .collect();
                    return Some((events, (launched, streamers, replies, generated, false)));
                }
            }
        },
    );
    let events = batches.flat_map(|events| {
        futures::stream::iter(events.into_iter().map(Ok::<_, std::convert::Infallible>))
    });
    Sse::new(events)
}
