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

/// The new tokens of a completions reply and why it ended. Per-token versions come from
/// Sluice's `token_versions` when the server sends them, else every token gets `version`.
pub(crate) fn parse_completion(
    reply: &Value,
    version: PolicyVersion,
) -> Result<(TokenOutput, FinishReason), BadReply> {
    let choice = reply
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| BadReply("no choices[0]".into()))?;
    let ids: Vec<u32> = choice
        .get("token_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            BadReply("choices[0].token_ids missing: the server needs return_token_ids".into())
        })?
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect::<Option<_>>()
        .ok_or_else(|| BadReply("token_ids holds a non-id".into()))?;
    let logprobs: Vec<f32> = match choice
        .pointer("/logprobs/token_logprobs")
        .and_then(Value::as_array)
    {
        Some(l) => l
            .iter()
            .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
            .collect(),
        None => {
            return Err(BadReply(
                "choices[0].logprobs.token_logprobs missing".into(),
            ));
        }
    };
    if logprobs.len() != ids.len() {
        return Err(BadReply(format!(
            "{} token ids but {} logprobs",
            ids.len(),
            logprobs.len()
        )));
    }
    let versions: Vec<PolicyVersion> = match choice.get("token_versions").and_then(Value::as_array)
    {
        Some(v) if v.len() == ids.len() => v
            .iter()
            .map(|x| PolicyVersion(x.as_u64().unwrap_or(version.0)))
            .collect(),
        _ => vec![version; ids.len()],
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

    #[test]
    fn parses_ids_logprobs_versions() {
        let reply = json!({"choices": [{
            "token_ids": [5, 6], "finish_reason": "length",
            "logprobs": {"token_logprobs": [-0.5, -1.0]}, "token_versions": [3, 4]
        }]});
        let (out, finish) = parse_completion(&reply, PolicyVersion(9)).unwrap();
        assert_eq!(out.token_ids, vec![5, 6]);
        assert_eq!(out.versions, vec![PolicyVersion(3), PolicyVersion(4)]);
        assert_eq!(finish, FinishReason::Length);
        let foreign = json!({"choices": [{
            "token_ids": [5], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5]}
        }]});
        let (out, _) = parse_completion(&foreign, PolicyVersion(9)).unwrap();
        assert_eq!(out.versions, vec![PolicyVersion(9)]);
        assert!(parse_completion(&json!({"choices": [{"text": "x"}]}), PolicyVersion(0)).is_err());
    }
}
