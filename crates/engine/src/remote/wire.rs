//! The JSON the remote backend speaks: a `/v1/completions` body with token ids in and out
//! (`return_token_ids`, `logprobs: 1`, `rid`), and the parse of the reply into a [`TokenOutput`].

use serde_json::{Value, json};
use sluice_core::PolicyVersion;

use crate::backend::{FinishReason, GenerateRequest, TokenOutput};

/// The completions body for `request`: the prompt is prompt + resumed tokens, `max_tokens`
/// what is left of the request's budget.
pub(crate) fn completion_body(request: &GenerateRequest, model: Option<&str>) -> Value {
    let resumed = request.resume.as_ref().map_or(0, TokenOutput::len) as u32;
    let mut prompt = request.prompt_token_ids.clone();
    if let Some(r) = &request.resume {
        prompt.extend_from_slice(&r.token_ids);
    }
    let p = &request.params;
    let mut body = json!({
        "prompt": prompt,
        "max_tokens": p.max_tokens.saturating_sub(resumed),
        "temperature": p.temperature,
        "top_p": p.top_p,
        "logprobs": 1,
        "return_token_ids": true,
        "skip_special_tokens": false,
        "rid": request.id.to_string(),
        "n": 1,
        "stream": false,
    });
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    if p.top_k > 0 {
        body["top_k"] = json!(p.top_k);
    }
    if let Some(seed) = p.seed {
        body["seed"] = json!(seed);
    }
    if !p.stop_token_ids.is_empty() {
        body["stop_token_ids"] = json!(p.stop_token_ids);
    }
    body
}

/// A reply that is not what the protocol promises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadReply(pub String);

/// How far above 0 a log-probability may be and still count as 0: a server that computes
/// `log_softmax` in low precision can round a near-certain token's log-probability up to a
/// few ulps above 0; anything beyond is not a probability and is refused.
pub(crate) const LOGPROB_TOLERANCE: f64 = 1e-3;

/// What a reply to one request may hold, besides what the protocol itself says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplyLimits {
    /// The version every token gets when the server sends no `token_versions`.
    pub version: PolicyVersion,
    /// The `max_tokens` the request asked for: a reply with more new tokens is refused (its
    /// text could not be trained, and the request's budget would be a lie).
    pub max_new_tokens: u32,
    /// The vocabulary of the weights the server was given (`vocab_size` of their model
    /// config): an id at or beyond it is refused. `None` when the head gave the server no
    /// weights yet (it already held the start version): ids are then only checked to fit u32.
    pub vocab_size: Option<usize>,
}

/// `value` as JSON, cut to a few dozen characters: a message quotes what the server sent
/// without letting a hostile server write a megabyte into the log.
fn shown(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(40) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// The new tokens of a completions reply and why it ended. Per-token versions come from
/// Sluice's `token_versions` when the server sends them, else every token gets
/// `limits.version`. Impossible per-token data is refused, never trained: an id outside the
/// vocabulary, more new tokens than `max_tokens`, a log-probability that is not a number, not
/// finite as f32 or above 0 (beyond [`LOGPROB_TOLERANCE`]; a tolerated one is stored as 0),
/// a `token_versions` entry that is not an integer, or one list longer or shorter than the ids.
pub(crate) fn parse_completion(
    reply: &Value,
    limits: ReplyLimits,
) -> Result<(TokenOutput, FinishReason), BadReply> {
    let choice = reply
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| BadReply("no choices[0]".into()))?;
    let raw_ids = choice
        .get("token_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            BadReply("choices[0].token_ids missing: the server needs return_token_ids".into())
        })?;
    if raw_ids.len() > limits.max_new_tokens as usize {
        return Err(BadReply(format!(
            "choices[0].token_ids holds {} new tokens, more than the max_tokens = {} asked",
            raw_ids.len(),
            limits.max_new_tokens
        )));
    }
    let ids = raw_ids
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let id = v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    BadReply(format!(
                        "choices[0].token_ids[{i}] = {}: not a token id",
                        shown(v)
                    ))
                })?;
            match limits.vocab_size {
                Some(vocab) if id as usize >= vocab => Err(BadReply(format!(
                    "choices[0].token_ids[{i}] = {id}: beyond the vocabulary of {vocab} tokens"
                ))),
                _ => Ok(id),
            }
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let logprobs = choice
        .pointer("/logprobs/token_logprobs")
        .and_then(Value::as_array)
        .ok_or_else(|| BadReply("choices[0].logprobs.token_logprobs missing".into()))?;
    if logprobs.len() != ids.len() {
        return Err(BadReply(format!(
            "{} token ids but {} logprobs",
            ids.len(),
            logprobs.len()
        )));
    }
    let logprobs = logprobs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let bad = |why: &str| {
                BadReply(format!(
                    "choices[0].logprobs.token_logprobs[{i}] = {}: {why}",
                    shown(v)
                ))
            };
            let lp = v.as_f64().ok_or_else(|| bad("not a number"))?;
            if !(lp as f32).is_finite() {
                return Err(bad("not a finite f32"));
            }
            if lp > LOGPROB_TOLERANCE {
                return Err(bad("a log-probability is ≤ 0"));
            }
            Ok((lp as f32).min(0.0))
        })
        .collect::<Result<Vec<f32>, _>>()?;
    let versions: Vec<PolicyVersion> = match choice.get("token_versions") {
        None | Some(Value::Null) => vec![limits.version; ids.len()],
        Some(Value::Array(v)) if v.len() == ids.len() => v
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_u64().map(PolicyVersion).ok_or_else(|| {
                    BadReply(format!(
                        "choices[0].token_versions[{i}] = {}: not a version (an integer ≥ 0)",
                        shown(x)
                    ))
                })
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Array(v)) => {
            return Err(BadReply(format!(
                "{} token ids but {} token_versions",
                ids.len(),
                v.len()
            )));
        }
        Some(other) => {
            return Err(BadReply(format!(
                "choices[0].token_versions = {}: not a list of versions",
                shown(other)
            )));
        }
    };
    let finish = match choice.get("finish_reason").and_then(Value::as_str) {
        Some("stop") => FinishReason::Stop,
        Some("length") => FinishReason::Length,
        Some("abort") => FinishReason::Abort,
        other => FinishReason::Error(
            format!("remote_finish_{}", other.unwrap_or("none"))
                .chars()
                .take(40)
                .collect(),
        ),
    };
    Ok((
        TokenOutput {
            token_ids: ids,
            logprobs,
            versions,
        },
        finish,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(version: u64) -> ReplyLimits {
        ReplyLimits {
            version: PolicyVersion(version),
            max_new_tokens: 8,
            vocab_size: Some(100),
        }
    }

    #[test]
    fn parses_ids_logprobs_versions() {
        let reply = json!({"choices": [{
            "token_ids": [5, 6], "finish_reason": "length",
            "logprobs": {"token_logprobs": [-0.5, -1.0]}, "token_versions": [3, 4]
        }]});
        let (out, finish) = parse_completion(&reply, limits(9)).unwrap();
        assert_eq!(out.token_ids, vec![5, 6]);
        assert_eq!(out.versions, vec![PolicyVersion(3), PolicyVersion(4)]);
        assert_eq!(finish, FinishReason::Length);
        let foreign = json!({"choices": [{
            "token_ids": [5], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5]}
        }]});
        let (out, _) = parse_completion(&foreign, limits(9)).unwrap();
        assert_eq!(out.versions, vec![PolicyVersion(9)]);
        assert!(parse_completion(&json!({"choices": [{"text": "x"}]}), limits(0)).is_err());
    }

    #[test]
    fn a_rounded_up_zero_logprob_is_kept_as_zero() {
        let reply = json!({"choices": [{
            "token_ids": [5, 6, 99], "finish_reason": "length",
            "logprobs": {"token_logprobs": [0.00004, -0.0, 0.0]}
        }]});
        let (out, _) = parse_completion(&reply, limits(0)).unwrap();
        assert_eq!(out.logprobs, vec![0.0, 0.0, 0.0]);
    }

    /// One row per lie a server may tell; the message names the field, the index and why.
    #[test]
    fn impossible_per_token_data_is_refused() {
        let long = "x".repeat(10_000);
        let rows: Vec<(Value, &str)> = vec![
            (
                json!({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0, null]}}),
                "choices[0].logprobs.token_logprobs[1] = null: not a number",
            ),
            (
                json!({"token_ids": [1], "logprobs": {"token_logprobs": ["x"]}}),
                "choices[0].logprobs.token_logprobs[0] = \"x\": not a number",
            ),
            (
                json!({"token_ids": [1, 2, 3, 4], "logprobs": {"token_logprobs": [-1, -1, -1, 50]}}),
                "choices[0].logprobs.token_logprobs[3] = 50: a log-probability is ≤ 0",
            ),
            (
                json!({"token_ids": [1], "logprobs": {"token_logprobs": [0.01]}}),
                "choices[0].logprobs.token_logprobs[0] = 0.01: a log-probability is ≤ 0",
            ),
            (
                json!({"token_ids": [1], "logprobs": {"token_logprobs": [1e300]}}),
                "choices[0].logprobs.token_logprobs[0] = 1e+300: not a finite f32",
            ),
            (
                json!({"token_ids": [1], "logprobs": {"token_logprobs": [-1e39]}}),
                "choices[0].logprobs.token_logprobs[0] = -1e+39: not a finite f32",
            ),
            (
                json!({"token_ids": [1, 100], "logprobs": {"token_logprobs": [-1, -1]}}),
                "choices[0].token_ids[1] = 100: beyond the vocabulary of 100 tokens",
            ),
            (
                json!({"token_ids": [4294967296u64], "logprobs": {"token_logprobs": [-1]}}),
                "choices[0].token_ids[0] = 4294967296: not a token id",
            ),
            (
                json!({"token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9],
                       "logprobs": {"token_logprobs": [-1, -1, -1, -1, -1, -1, -1, -1, -1]}}),
                "choices[0].token_ids holds 9 new tokens, more than the max_tokens = 8 asked",
            ),
            (
                json!({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1, -1]},
                       "token_versions": [0, 1.5]}),
                "choices[0].token_versions[1] = 1.5: not a version (an integer ≥ 0)",
            ),
            (
                json!({"token_ids": [1], "logprobs": {"token_logprobs": [-1]},
                       "token_versions": [long]}),
                "choices[0].token_versions[0] = \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx…: not a version (an integer ≥ 0)",
            ),
            (
                json!({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1, -1]},
                       "token_versions": [0]}),
                "2 token ids but 1 token_versions",
            ),
            (
                json!({"token_ids": [1], "logprobs": {"token_logprobs": [-1]},
                       "token_versions": "v0"}),
                "choices[0].token_versions = \"v0\": not a list of versions",
            ),
        ];
        for (choice, want) in rows {
            let reply = json!({"choices": [choice]});
            assert_eq!(
                parse_completion(&reply, limits(0)).map(|_| ()),
                Err(BadReply(want.into())),
                "{reply}"
            );
        }
        let unknown_vocab = ReplyLimits {
            vocab_size: None,
            ..limits(0)
        };
        let reply =
            json!({"choices": [{"token_ids": [100_000], "logprobs": {"token_logprobs": [-1]}}]});
        assert!(parse_completion(&reply, unknown_vocab).is_ok());
    }
}
