//! The prompt log-probabilities of a prefill (`prompt_logprobs`): each chunk's logits rows
//! score the prompt's next tokens.

use crate::backend::SamplingParams;
use crate::native::PromptLogprob;
use crate::native::sampler::{log_softmax, top_n};

/// One prefill chunk with every row of logits.
pub(super) struct PromptChunk<'a> {
    /// The tokens the chunk fed.
    pub fed: &'a [u32],
    /// The first token still pending after it (what its last row scores, when any).
    pub next: Option<u32>,
    /// One logits row per fed token.
    pub rows: &'a [Vec<f32>],
}

/// Appends the prompt log-probabilities a prefill chunk yields. Row `j` of a chunk starting at
/// position `a` scores the token at `a + j + 1`. Invariant: after a chunk ending at `e`, `lps`
/// covers positions `0..=e`, so the next chunk starts at `lps.len() - 1`. Entries stop at the
/// prompt's end (resumed tokens are not prompt).
pub(super) fn collect_prompt_logprobs(
    prompt_len: usize,
    lps: &mut Vec<PromptLogprob>,
    chunk: &PromptChunk<'_>,
    params: &SamplingParams,
    top: usize,
) {
    if lps.is_empty()
        && let Some(&first) = chunk.fed.first()
    {
        lps.push(PromptLogprob {
            token: first,
            logprob: None,
            top: Vec::new(),
        });
    }
    let start = lps.len() - 1;
    for (j, row) in chunk.rows.iter().enumerate() {
        if start + j + 1 >= prompt_len {
            break;
        }
        let Some(token) = chunk.fed.get(j + 1).copied().or(chunk.next) else {
            break;
        };
        let lp = log_softmax(row, params.temperature);
        lps.push(PromptLogprob {
            token,
            logprob: Some(lp[token as usize]),
            top: top_n(&lp, top),
        });
    }
}
