//! Prompt text on its way to token ids: bounded in size before any work (a prompt far longer
//! than the context could hold is refused with a 400 before it is tokenized), then rendered
//! (chat template) and tokenized on the blocking pool, never on the runtime's threads. The work
//! belongs to the call: when the client goes, the handler is dropped, a render in progress is
//! abandoned and a tokenization not yet started is skipped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sluice_core::Message;
use sluice_model::{ChatOptions, Tokenizer};

use super::{ApiError, ServerState};

/// Bytes of prompt text accepted per token of context. No tokenizer packs more than a few bytes
/// into a token on real text (about 4 for English, fewer for code and other scripts), so 16 only
/// refuses prompts that could never fit the context, and bounds the tokenizer's work.
pub const PROMPT_BYTES_PER_TOKEN: usize = 16;

impl ServerState {
    /// The longest prompt text accepted, in bytes: the context × [`PROMPT_BYTES_PER_TOKEN`].
    pub fn max_prompt_bytes(&self) -> usize {
        self.context_len().saturating_mul(PROMPT_BYTES_PER_TOKEN)
    }

    /// Refuses `bytes` of prompt text in `param` beyond [`Self::max_prompt_bytes`].
    pub(super) fn check_prompt_bytes(&self, param: &str, bytes: usize) -> Result<(), ApiError> {
        let max = self.max_prompt_bytes();
        if bytes > max {
            return Err(ApiError::invalid(
                param,
                format!(
                    "the prompt text is {bytes} bytes; this model's context of {} tokens takes at most {max} bytes of text ({PROMPT_BYTES_PER_TOKEN} per token)",
                    self.context_len()
                ),
            ));
        }
        Ok(())
    }
}

/// Set when the call that asked for the work is gone (dropped with the handler's future).
struct Abandoned(Arc<AtomicBool>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs `work` on the blocking pool for the calling handler; the flag it gets turns true when
/// the handler is dropped (the client went away), so later stages can be skipped.
async fn off_runtime<T: Send + 'static>(
    work: impl FnOnce(&AtomicBool) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let flag = Arc::new(AtomicBool::new(false));
    let _abandoned = Abandoned(Arc::clone(&flag));
    tokio::task::spawn_blocking(move || work(&flag))
        .await
        .map_err(|e| ApiError::internal(format!("prompt thread: {e}")))?
}

fn gone() -> ApiError {
    ApiError::bad_body("the client went away")
}

/// Tokenizes each of `texts` (already bounded in size) off the runtime; failures name `param`.
pub(super) async fn encode_all(
    tokenizer: Arc<Tokenizer>,
    texts: Vec<String>,
    add_special_tokens: bool,
    param: &'static str,
) -> Result<Vec<Vec<u32>>, ApiError> {
    off_runtime(move |abandoned| {
        texts
            .iter()
            .map(|t| {
                if abandoned.load(Ordering::Relaxed) {
                    return Err(gone());
                }
                tokenizer
                    .encode(t, add_special_tokens)
                    .map_err(|e| ApiError::invalid(param, e.to_string()))
            })
            .collect()
    })
    .await
}

/// Renders `messages` with the chat template, bounds the rendered text like a prompt, and
/// tokenizes it, off the runtime: the rendered text and its ids.
pub(super) async fn render_chat(
    state: &ServerState,
    messages: Vec<Message>,
    options: ChatOptions,
) -> Result<(String, Vec<u32>), ApiError> {
    let tokenizer = Arc::clone(&state.tokenizer);
    let max = state.max_prompt_bytes();
    let context = state.context_len();
    off_runtime(move |abandoned| {
        let rendered = tokenizer
            .apply_chat_template(&messages, &options)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        if rendered.len() > max {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "the rendered conversation is {} bytes; this model's context of {context} tokens takes at most {max} bytes of text ({PROMPT_BYTES_PER_TOKEN} per token)",
                    rendered.len()
                ),
            ));
        }
        if abandoned.load(Ordering::Relaxed) {
            return Err(gone());
        }
        let ids = tokenizer
            .encode(&rendered, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        Ok((rendered, ids))
    })
    .await
}

/// The text a chat request brings (contents, reasoning, tool-call arguments, tool specs), in
/// bytes: bounded before the template renders it.
pub(super) fn chat_text_bytes(
    messages: &[Message],
    tools: Option<&Vec<sluice_core::ToolSpec>>,
) -> usize {
    let in_messages: usize = messages
        .iter()
        .map(|m| {
            m.content.as_ref().map_or(0, String::len)
                + m.reasoning_content.as_ref().map_or(0, String::len)
                + m.tool_calls
                    .iter()
                    .map(|c| c.function.arguments.len() + c.function.name.len())
                    .sum::<usize>()
        })
        .sum();
    let in_tools = tools.map_or(0, |t| serde_json::to_string(t).map_or(0, |s| s.len()));
    in_messages + in_tools
}
