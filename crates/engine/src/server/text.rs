//! Token ids → text for responses: whole completions, per-token pieces for log-probabilities,
//! and streaming deltas that never split a UTF-8 character or leak a stop string.

use sluice_model::Tokenizer;

use crate::native::truncate_at_stop;

/// Text of `ids` without special tokens ("" when the tokenizer refuses).
pub(crate) fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> String {
    tokenizer.decode(ids, true).unwrap_or_default()
}

/// The text one token stands for (special tokens included, as OpenAI's `tokens` lists do).
pub(crate) fn piece(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer
        .decode(&[id], false)
        .ok()
        .or_else(|| tokenizer.id_to_token(id))
        .unwrap_or_default()
}

/// Incremental detokenizer for streaming: re-decodes the completion and releases only text that
/// can no longer change (no trailing replacement character from a cut multi-byte sequence, and
/// nothing that could still become the start of a stop string).
pub(crate) struct Streamer {
    ids: Vec<u32>,
    sent: usize,
    stops: Vec<String>,
    holdback: usize,
}

impl Streamer {
    pub(crate) fn new(stops: Vec<String>) -> Self {
        let holdback = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            ids: Vec::new(),
            sent: 0,
            stops,
            holdback,
        }
    }

    /// Adds a token; returns the new text that is safe to send.
    pub(crate) fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let text = decode(tokenizer, &self.ids);
        if text.ends_with('\u{fffd}') {
            return String::new();
        }
        let mut end = text.len().saturating_sub(self.holdback.saturating_sub(1));
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        self.take(&text, end)
    }

    /// The rest of the text at the end, cut before a stop string.
    pub(crate) fn finish(&mut self, tokenizer: &Tokenizer) -> String {
        let text = decode(tokenizer, &self.ids);
        let end = truncate_at_stop(&text, &self.stops).len();
        self.take(&text, end)
    }

    fn take(&mut self, text: &str, end: usize) -> String {
        let end = end.min(truncate_at_stop(text, &self.stops).len());
        if end <= self.sent {
            return String::new();
        }
        let out = text[self.sent..end].to_owned();
        self.sent = end;
        out
    }
}
