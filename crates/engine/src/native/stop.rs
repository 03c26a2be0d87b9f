//! When a sequence stops: end-of-sequence and stop token ids, stop strings, the length limits.

use sluice_model::Tokenizer;

/// Why a sequence hit a stop condition (length limits are checked by the scheduler).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopHit {
    /// The last token is an end-of-sequence or stop token id (it stays in the completion).
    Token(u32),
    /// The completion text now contains this stop string (the tokens that made it stay in the
    /// completion; a server cuts the text before the string).
    String(String),
}

/// The stop conditions of one request.
#[derive(Debug, Clone, Default)]
pub(crate) struct StopRule {
    token_ids: Vec<u32>,
    strings: Vec<String>,
    /// Tokens decoded from the end of the completion to look for stop strings: every token
    /// decodes to at least one byte, so the longest string plus one fits.
    window: usize,
}

impl StopRule {
    /// `eos` (unless `ignore_eos`) plus the request's own ids and strings.
    pub(crate) fn new(eos: &[u32], ignore_eos: bool, ids: &[u32], strings: &[String]) -> Self {
        let mut token_ids: Vec<u32> = ids.to_vec();
        if !ignore_eos {
            token_ids.extend(eos);
        }
        token_ids.sort_unstable();
        token_ids.dedup();
        let strings: Vec<String> = strings.iter().filter(|s| !s.is_empty()).cloned().collect();
        let window = strings.iter().map(String::len).max().map_or(0, |n| n + 1);
        Self {
            token_ids,
            strings,
            window,
        }
    }

    /// Checks the completion after its last token was appended. Only the newest token can
    /// complete a condition: every earlier one was checked when it arrived.
    pub(crate) fn check(
        &self,
        completion: &[u32],
        tokenizer: Option<&Tokenizer>,
    ) -> Option<StopHit> {
        let &last = completion.last()?;
        if self.token_ids.binary_search(&last).is_ok() {
            return Some(StopHit::Token(last));
        }
        let tokenizer = tokenizer?;
        if self.strings.is_empty() {
            return None;
        }
        let tail = &completion[completion.len().saturating_sub(self.window)..];
        let text = tokenizer.decode(tail, false).ok()?;
        self.strings
            .iter()
            .find(|s| text.contains(s.as_str()))
            .map(|s| StopHit::String(s.clone()))
    }
}

/// Cuts `text` before the earliest occurrence of any of `stops` (the OpenAI convention: the stop
/// string is not part of the returned text). Returns the text unchanged when none occurs.
pub fn truncate_at_stop<'t>(text: &'t str, stops: &[String]) -> &'t str {
    let cut = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min();
    match cut {
        Some(i) => &text[..i],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_and_eos() {
        let rule = StopRule::new(&[9], false, &[4], &[]);
        assert_eq!(rule.check(&[1, 4], None), Some(StopHit::Token(4)));
        assert_eq!(rule.check(&[1, 9], None), Some(StopHit::Token(9)));
        assert_eq!(rule.check(&[4, 1], None), None);
        let ignore = StopRule::new(&[9], true, &[], &[]);
        assert_eq!(ignore.check(&[9], None), None);
    }

    #[test]
    fn truncation_takes_the_earliest_stop() {
        let stops = vec!["cd".to_owned(), "b".to_owned()];
        assert_eq!(truncate_at_stop("abcd", &stops), "a");
        assert_eq!(truncate_at_stop("xyz", &stops), "xyz");
    }
}
