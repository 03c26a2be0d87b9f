//! What a caller hands the native engine beyond the backend trait ([`NativeRequest`]: stop
//! strings, alternatives per token, prompt log-probabilities, an observer) and what its observer
//! sees ([`RequestUpdate`]).

use std::sync::Arc;

use sluice_core::PolicyVersion;

use super::StopHit;
use crate::backend::{Completion, GenerateRequest};

/// A request with the options only the native engine offers.
#[derive(Clone)]
pub struct NativeRequest {
    /// The request as every backend sees it.
    pub request: GenerateRequest,
    /// Stop strings (need the engine's tokenizer).
    pub stop: Vec<String>,
    /// Do not stop on the end-of-sequence ids.
    pub ignore_eos: bool,
    /// Alternatives reported per generated (and, with `prompt_logprobs`, prompt) token.
    pub top_logprobs: u32,
    /// Report the log-probability of every prompt token (`echo` with `logprobs`).
    pub prompt_logprobs: bool,
    /// Sees this request's tokens as they are produced, and its end.
    pub observer: Option<RequestObserver>,
}

impl NativeRequest {
    /// A plain request: no stop strings, no extra log-probabilities, no observer.
    pub fn plain(request: GenerateRequest) -> Self {
        Self {
            request,
            stop: Vec::new(),
            ignore_eos: false,
            top_logprobs: 0,
            prompt_logprobs: false,
            observer: None,
        }
    }
}

/// Called on the compute thread for each update of one request: must not block.
pub type RequestObserver = Arc<dyn Fn(RequestUpdate) + Send + Sync>;

/// What an observer sees, in order: prompt log-probabilities (when asked), each token, the end.
#[derive(Debug, Clone)]
pub enum RequestUpdate {
    /// One entry per prompt token; the first has no log-probability.
    PromptLogprobs(Vec<PromptLogprob>),
    /// A generated token.
    Token(TokenStep),
    /// The request left the engine (also delivered to the engine's sink).
    Finished {
        /// The whole completion.
        completion: Completion,
        /// The stop condition met, when it stopped on one.
        stop: Option<StopHit>,
    },
}

/// The log-probability of one prompt token given the tokens before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    /// The token.
    pub token: u32,
    /// Its log-probability (`None` for the first token).
    pub logprob: Option<f32>,
    /// The most likely tokens at that position.
    pub top: Vec<(u32, f32)>,
}

/// One generated token as an observer sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenStep {
    /// The token.
    pub token: u32,
    /// Its behaviour log-probability (see the `sampler` module).
    pub logprob: f32,
    /// The version of the weights that produced it.
    pub version: PolicyVersion,
    /// The most likely tokens at this position, with their log-probabilities.
    pub top: Vec<(u32, f32)>,
}
