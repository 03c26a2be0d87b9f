//! Chat: rendering messages with a checkpoint's template, and parsing completions back.

mod parse;
mod pyjson;
mod template;

pub use parse::{CompletionParseError, CompletionParser};
pub use template::{ChatOptions, ChatTemplate};
