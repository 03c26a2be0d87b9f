//! The SSE stream of `POST /v1/completions`.

use std::sync::Arc;

use axum::response::IntoResponse;
use axum::response::sse::{Event, Sse};
use serde_json::{Value, json};

use super::{LogprobsJson, Shape, finish_reason, usage_chunk};
use crate::native::RequestUpdate;
use crate::server::ServerState;
use crate::server::generate::Launched;
use crate::server::text::Streamer;

/// What every chunk of the stream repeats, and the usage chunk's figures.
pub(super) struct StreamHead {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// `stream_options.include_usage`: a last chunk with no choices and the call's usage.
    pub include_usage: bool,
    /// The prompts' tokens, each prompt once (as the non-streamed `usage` counts them).
    pub prompt_tokens: usize,
}

/// Per choice, what the stream has sent.
struct Sent {
    /// The text's decoder.
    streamer: Streamer,
    /// Its prompt is still to be echoed.
    to_echo: bool,
    /// Characters of the choice's text so far (echo included): the next token's `text_offset`,
    /// as the non-streamed `logprobs` count them.
    at: usize,
}

/// The stream's state between chunks.
struct State {
    launched: Launched,
    sent: Vec<Sent>,
    /// An event that goes out before the next update is read (the chunk after an echo, or
    /// `[DONE]` after the usage chunk).
    held: Option<Event>,
    completion_tokens: usize,
    done: bool,
}

/// Server-sent events: with `echo`, a first chunk per choice with the prompt's text (and, with
/// `logprobs`, its tokens' log-probabilities, the first `null`), as vLLM sends it; then one
/// chunk per token per choice (text delta, its log-probability at its offset in the choice's
/// text and, with `return_token_ids`, its id and version), a last chunk per choice with the
/// finish reason, with `stream_options.include_usage` a chunk of the call's usage and no
/// choices, then `[DONE]`.
pub(super) fn stream(
    state: Arc<ServerState>,
    launched: Launched,
    shape: Shape,
    head: StreamHead,
    echo_texts: Vec<Arc<str>>,
) -> impl IntoResponse {
    let sent = (0..launched.len())
        .map(|_| Sent {
            streamer: Streamer::new(shape.stops.clone()),
            to_echo: shape.echo,
            at: 0,
        })
        .collect();
    let init = State {
        launched,
        sent,
        held: None,
        completion_tokens: 0,
        done: false,
    };
    let head_json = json!({"id": head.id, "object": "text_completion", "created": head.created, "model": head.model});
    let (include_usage, prompt_tokens) = (head.include_usage, head.prompt_tokens);
    let with_lp = shape.logprobs.is_some();
    let with_ids = shape.token_ids;
    let echo_texts: Arc<[Arc<str>]> = echo_texts.into();
    let events = futures::stream::unfold(init, move |mut s| {
        let state = Arc::clone(&state);
        let head_json = head_json.clone();
        let echo_texts = Arc::clone(&echo_texts);
        async move {
            if let Some(e) = s.held.take() {
                return Some((Ok::<_, std::convert::Infallible>(e), s));
            }
            if s.done {
                return None;
            }
            let Some((i, update)) = s.launched.next().await else {
                s.done = true;
                let done = Event::default().data("[DONE]");
                if !include_usage {
                    return Some((Ok(done), s));
                }
                s.held = Some(done);
                let last = usage_chunk(&head_json, prompt_tokens, s.completion_tokens);
                return Some((Ok(last), s));
            };
            // One choice's chunk.
            let c_of = |c: Value| {
                let mut chunk = head_json.clone();
                chunk["choices"] = json!([c]);
                Event::default().data(chunk.to_string())
            };
            let sent = &mut s.sent[i];
            let echo = std::mem::take(&mut sent.to_echo).then(|| {
                let text = echo_texts.get(i).map_or("", |t| &**t);
                json!({"index": i, "text": text, "finish_reason": null, "logprobs": null})
            });
            let c = match update {
                RequestUpdate::PromptLogprobs(p) => {
                    // Asked for only with `echo` and `logprobs`: the echo chunk's.
                    let mut c = echo
                        .unwrap_or_else(|| json!({"index": i, "text": "", "finish_reason": null}));
                    let mut lp = LogprobsJson::starting_at(sent.at);
                    for t in &p {
                        lp.push(&state, t.token, t.logprob, &t.top);
                    }
                    sent.at = lp.at;
                    c["logprobs"] = lp.to_json();
                    return Some((Ok(c_of(c)), s));
                }
                RequestUpdate::Token(t) => {
                    let text = sent.streamer.push(&state.tokenizer, t.token);
                    let mut c =
                        json!({"index": i, "text": text, "finish_reason": null, "logprobs": null});
                    if with_lp {
                        let mut lp = LogprobsJson::starting_at(sent.at);
                        lp.push(&state, t.token, Some(t.logprob), &t.top);
                        sent.at = lp.at;
                        c["logprobs"] = lp.to_json();
                    }
                    if with_ids {
                        c["token_ids"] = json!([t.token]);
                        c["token_versions"] = json!([t.version.0]);
                    }
                    c
                }
                RequestUpdate::Finished { completion, .. } => {
                    s.completion_tokens += completion.output.len();
                    let text = sent.streamer.finish(&state.tokenizer);
                    json!({
                        "index": i,
                        "text": text,
                        "finish_reason": finish_reason(&completion.finish),
                        "logprobs": null,
                    })
                }
            };
            match echo {
                Some(echo) => {
                    s.held = Some(c_of(c));
                    Some((Ok(c_of(echo)), s))
                }
                None => Some((Ok(c_of(c)), s)),
            }
        }
    });
    Sse::new(events)
}
