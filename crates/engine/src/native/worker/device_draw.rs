//! Token choice on the GPU (`cuda` builds): when a step's sequences need nothing but a token and
//! its behaviour log-probability (no top-k/top-p, no top log-probs, no prompt log-probs), the
//! draw runs on the logits where the model left them and only `(token, log-prob)` per sequence
//! comes back to the host, not a row of the vocabulary per sequence
//! ([`sluice_model::kernels::sample_rows`]). Same uniform draws as the CPU sampler, so a
//! request's tokens still depend on its seed and position only.

use sluice_model::candle::Tensor;

use super::Seq;
use crate::backend::SamplingParams;
use crate::native::sampler::{Sampled, sample_rows};

/// What a step's model call gave one sequence.
pub(super) enum Outcome {
    /// Logits rows, to the host: the last for the draw, every row for prompt log-probs.
    Rows(Vec<Vec<f32>>),
    /// The token drawn on the device from the last row.
    Drawn(Sampled),
}

impl Outcome {
    /// The logits rows, when they came to the host.
    pub(super) fn rows(&self) -> &[Vec<f32>] {
        match self {
            Outcome::Rows(rows) => rows,
            Outcome::Drawn(_) => &[],
        }
    }

    /// The last row of logits of sequence `i` in `outcomes` (empty when none came to the host).
    pub(super) fn last_row(outcomes: &[Option<Outcome>], i: usize) -> &[f32] {
        outcomes[i]
            .as_ref()
            .and_then(|o| o.rows().last())
            .map_or(&[], |r| r)
    }
}

/// The draws of the sequences `drawing` (indices into `running`, in order): the device's where
/// it drew, the CPU sampler's from each last row for the rest (on the pool's threads at a real
/// vocabulary: each row is independent).
pub(super) fn picks(
    running: &[Seq],
    drawing: &[usize],
    outcomes: &[Option<Outcome>],
) -> Vec<Sampled> {
    let jobs: Vec<(&[f32], &SamplingParams, u64, u64)> = drawing
        .iter()
        .filter(|&&i| !matches!(outcomes[i], Some(Outcome::Drawn(_))))
        .map(|&i| {
            let s = &running[i];
            (
                Outcome::last_row(outcomes, i),
                &s.params,
                s.seed,
                s.output.len() as u64,
            )
        })
        .collect();
    let mut on_host = sample_rows(&jobs).into_iter();
    drawing
        .iter()
        .map(|&i| match &outcomes[i] {
            Some(Outcome::Drawn(pick)) => *pick,
            _ => on_host
                .next()
                .expect("one host draw per row drawn on the host"),
        })
        .collect()
}

/// Whether `s`'s draw can run on the device: plain temperature (or greedy) sampling and
/// nothing that needs the whole row on the host.
pub(super) fn qualifies(s: &Seq) -> bool {
    s.params.top_k == 0 && s.params.top_p >= 1.0 && s.top_logprobs == 0 && s.prompt_lps.is_none()
}

/// Draws one token from each row of `logits` (one per sequence of `seqs`, in order) on their
/// GPU; `None` where the logits are not on a GPU (or this build has no CUDA).
pub(super) fn draw<'a>(
    logits: &Tensor,
    seqs: impl Iterator<Item = &'a Seq>,
) -> Option<sluice_model::Result<Vec<Sampled>>> {
    if !logits.device().is_cuda() {
        return None;
    }
    draw_cuda(logits, seqs)
}

#[cfg(feature = "cuda")]
fn draw_cuda<'a>(
    logits: &Tensor,
    seqs: impl Iterator<Item = &'a Seq>,
) -> Option<sluice_model::Result<Vec<Sampled>>> {
    use crate::native::sampler::{GREEDY_BELOW, uniform};
    let (mut temperatures, mut uniforms) = (Vec::new(), Vec::new());
    for s in seqs {
        let t = s.params.temperature;
        temperatures.push(if t > GREEDY_BELOW { t as f32 } else { 0.0 });
        uniforms.push(uniform(s.seed, s.output.len() as u64));
    }
    let drawn = sluice_model::kernels::sample_rows(logits, &temperatures, &uniforms)
        .map(|rows| {
            rows.into_iter()
                .map(|(token, logprob)| Sampled { token, logprob })
                .collect()
        })
        .map_err(|error| sluice_model::ModelError::Tensor {
            context: "token choice on the device".into(),
            error,
        });
    Some(drawn)
}

#[cfg(not(feature = "cuda"))]
fn draw_cuda<'a>(
    _: &Tensor,
    _: impl Iterator<Item = &'a Seq>,
) -> Option<sluice_model::Result<Vec<Sampled>>> {
    None
}
