//! What a request may ask beyond its own fields' checks: the OpenAI and vLLM fields this server
//! does not implement (accepted at their neutral value only, refused otherwise, so nothing is
//! silently ignored), and how many log-probabilities one completions call may report.

use serde::Deserialize;
use serde_json::Value;

use super::ApiError;
use super::generate::ChoiceSpec;

/// OpenAI and vLLM sampling fields the engine does not implement. Clients (LangChain, say) send
/// them at their neutral value, which changes nothing and is accepted; any other value would be
/// silently ignored, so it is refused with 400 naming the field.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct Unsupported {
    logit_bias: Option<Value>,
    presence_penalty: Option<Value>,
    frequency_penalty: Option<Value>,
    repetition_penalty: Option<Value>,
    min_p: Option<Value>,
    min_tokens: Option<Value>,
    /// Structured output (JSON mode, a JSON schema): no constrained decoding here.
    response_format: Option<Value>,
    /// The legacy function-calling fields (`tools` is what this server reads).
    functions: Option<Value>,
    function_call: Option<Value>,
}

/// 400: `field` = `value` would change the output, and this server does not implement it;
/// `neutral` says what may be sent instead.
pub(crate) fn unsupported(field: &str, value: &Value, neutral: &str) -> ApiError {
    ApiError::invalid(
        field,
        format!(
            "`{field}` = {value} is not supported by this server; send {neutral} or leave it out"
        ),
    )
}

/// Whether `value` is absent, `null` or the number `neutral`.
fn is_neutral_number(value: Option<&Value>, neutral: f64) -> bool {
    match value {
        None | Some(Value::Null) => true,
        Some(v) => v.as_f64() == Some(neutral),
    }
}

impl Unsupported {
    /// Refuses the first field set to a value that would change the output.
    pub(crate) fn check(&self) -> Result<(), ApiError> {
        let numbers = [
            ("presence_penalty", &self.presence_penalty, 0.0, "0"),
            ("frequency_penalty", &self.frequency_penalty, 0.0, "0"),
            ("repetition_penalty", &self.repetition_penalty, 1.0, "1"),
            ("min_p", &self.min_p, 0.0, "0"),
            ("min_tokens", &self.min_tokens, 0.0, "0"),
        ];
        for (field, value, neutral, shown) in numbers {
            if !is_neutral_number(value.as_ref(), neutral) {
                let value = value.as_ref().unwrap_or(&Value::Null);
                return Err(unsupported(field, value, shown));
            }
        }
        match &self.response_format {
            None | Some(Value::Null) => {}
            Some(f) if f.get("type").and_then(Value::as_str) == Some("text") => {}
            Some(v) => return Err(unsupported("response_format", v, "`{\"type\": \"text\"}`")),
        }
        match &self.functions {
            None | Some(Value::Null) => {}
            Some(Value::Array(fs)) if fs.is_empty() => {}
            Some(v) => return Err(unsupported("functions", v, "`tools`, the same functions,")),
        }
        match &self.function_call {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "none" || s == "auto" => {}
            Some(v) => return Err(unsupported("function_call", v, "`\"auto\"` or `\"none\"`")),
        }
        match &self.logit_bias {
            None | Some(Value::Null) => Ok(()),
            Some(Value::Object(biases))
                if biases.values().all(|b| is_neutral_number(Some(b), 0.0)) =>
            {
                Ok(())
            }
            Some(v) => Err(unsupported("logit_bias", v, "`{}` (no bias)")),
        }
    }
}

/// Most log-probabilities one completions or chat call may report ([`logprob_entries`]): about 0.3 KB
/// of memory each while the answer is built and 25 bytes of JSON, so the largest call takes a
/// few hundred MB where the other limits allowed about 100 GB. RL's calls are far below: 64
/// choices of 4,096 tokens with `logprobs: 1` are 0.5 M; echoing 16 prompts of 3,000 tokens
/// with `logprobs: 20` is 1 M.
pub const MAX_LOGPROB_ENTRIES: u64 = 1 << 20;

/// The log-probabilities a call reports with `logprobs: k`: `k + 1` (the token's own and `k`
/// alternatives) for each echoed prompt token and, unless streamed (a stream holds none of them),
/// each token it may generate, summed over every choice (prompts × `n`). `None` without
/// `logprobs`.
fn logprob_entries(
    specs: &[ChoiceSpec],
    logprobs: Option<u32>,
    echo: bool,
    stream: bool,
) -> Option<u64> {
    let per_token = u64::from(logprobs?) + 1;
    let tokens: u64 = specs
        .iter()
        .map(|s| {
            let echoed = if echo { s.prompt.len() as u64 } else { 0 };
            let generated = if stream {
                0
            } else {
                u64::from(s.params.max_tokens)
            };
            echoed + generated
        })
        .sum();
    Some(tokens.saturating_mul(per_token))
}

/// Refuses a call over [`MAX_LOGPROB_ENTRIES`], naming the fields that make it up; `field` is
/// the request's count of alternatives (`logprobs` in completions, `top_logprobs` in chat).
pub(crate) fn check_logprob_budget(
    field: &str,
    specs: &[ChoiceSpec],
    logprobs: Option<u32>,
    echo: bool,
    stream: bool,
) -> Result<(), ApiError> {
    match logprob_entries(specs, logprobs, echo, stream) {
        Some(entries) if entries > MAX_LOGPROB_ENTRIES => Err(ApiError::invalid(
            field,
            format!(
                "this request would report {entries} log-probabilities (({field} + 1) per {} token, over {} choices: prompts × n); at most {MAX_LOGPROB_ENTRIES} per request: lower `{field}`, `n`{}, or send fewer or shorter prompts",
                match (echo, stream) {
                    (true, true) => "echoed prompt",
                    (true, false) => "echoed prompt and max_tokens",
                    (false, _) => "max_tokens",
                },
                specs.len(),
                if stream { "" } else { ", `max_tokens`" },
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SamplingParams;

    fn spec(prompt: usize, max_tokens: u32) -> ChoiceSpec {
        ChoiceSpec {
            prompt: vec![1; prompt],
            params: SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                max_tokens,
                seed: None,
                stop_token_ids: Vec::new(),
            },
            stop: Vec::new(),
            ignore_eos: false,
            top_logprobs: 0,
            prompt_logprobs: false,
        }
    }

    /// A chat call's budget counts each choice's generated tokens (no echo), unless streamed,
    /// and names `top_logprobs`; without `logprobs` nothing is counted.
    #[test]
    fn a_chat_call_counts_its_generated_tokens_and_names_top_logprobs() {
        let specs = vec![spec(10, 1000); 64];
        assert_eq!(
            logprob_entries(&specs, Some(20), false, false),
            Some(64 * 1000 * 21)
        );
        let err = check_logprob_budget("top_logprobs", &specs, Some(20), false, false).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("top_logprobs"));
        let err = err.message;
        assert!(
            err.contains("1344000 log-probabilities") && err.contains("lower `top_logprobs`"),
            "{err}"
        );
        assert!(check_logprob_budget("top_logprobs", &specs, Some(20), false, true).is_ok());
        assert!(check_logprob_budget("top_logprobs", &specs, None, false, false).is_ok());
        assert!(check_logprob_budget("top_logprobs", &specs, Some(14), false, false).is_ok());
    }
}
