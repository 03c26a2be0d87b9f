//! Chat: rendering messages with a checkpoint's template, and parsing completions back.

mod pyjson;
mod template;

// The parser lives in the core crate (the env crate's renderer uses it too); re-exported here so
// the model's chat API stays in one place.
pub use sluice_core::completion::{CompletionParseError, CompletionParser};
pub use template::{ChatOptions, ChatTemplate, RenderBudget};
