//! The native trainer's per-step plumbing: splitting a step into minibatch shares, the model's
//! view of a packed micro-batch, picking loss slots out of the forward's outputs (and a model's
//! log-probs at them), where each loss slot's token lies in the step's texts and which texts are
//! one rollout's, the packing figures of a step, and the clock of its parts.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use sluice_model::{ForwardOptions, PackedBatch, TrainableModel};

use crate::advantage::ScoredText;
use crate::batcher::{MicroBatch, Packing, PackingStats};
use crate::error::{TrainerError, tensor_ctx};
use crate::report::StepStats;

/// The clock of a step's parts ([`crate::StepParts`]). A GPU runs work after the host has
/// issued it and moved on, so a part's wall time is its host time, and the device's time lands
/// on whichever later part first waits for a result. With `sync` (the settings'
/// [`crate::NativeTrainerConfig::sync_parts`]) each lap first waits for the device, so every
/// part is charged for its own work, at the cost of the overlap.
pub(crate) struct PartClock {
    at: Instant,
    sync: Option<Device>,
}

impl PartClock {
    pub(crate) fn start(sync: Option<Device>) -> Self {
        Self {
            at: Instant::now(),
            sync,
        }
    }

    /// Seconds since the last lap (or the start); the clock restarts now.
    pub(crate) fn lap(&mut self) -> Result<f64, TrainerError> {
        if let Some(device) = &self.sync {
            device
                .synchronize()
                .map_err(tensor_ctx("waiting for the device"))?;
        }
        let now = Instant::now();
        let seconds = now.duration_since(self.at).as_secs_f64();
        self.at = now;
        Ok(seconds)
    }
}

/// Copies what packing `packings` cost into `stats` (one step, however many shares).
pub(crate) fn record_packing(stats: &mut StepStats, packings: &[Packing]) {
    let mut total = PackingStats::default();
    for p in packings {
        total.merge(&p.stats);
    }
    stats.micro_batches = packings.iter().map(|p| p.micro_batches.len()).sum();
    stats.packing_efficiency = total.efficiency();
    stats.processed_tokens = total.used_slots;
    stats.trained_tokens = total.loss_tokens;
    stats.rejected_texts = total.rejected_texts;
}

/// The flat indices of a micro-batch's loss slots, as a tensor for [`pick`].
pub(crate) fn slot_index(
    slots: &[usize],
    device: &candle_core::Device,
) -> Result<Tensor, TrainerError> {
    Tensor::new(slots.iter().map(|&i| i as u32).collect::<Vec<_>>(), device)
        .map_err(tensor_ctx("loss slot index"))
}

/// The values of `t` at the flat indices `index`: the tensor (in the graph) and a host copy.
pub(crate) fn pick(
    t: &Tensor,
    index: &Tensor,
    what: &str,
) -> Result<(Tensor, Vec<f32>), TrainerError> {
    let picked = t
        .flatten_all()
        .and_then(|f| f.index_select(index, 0))
        .map_err(tensor_ctx(what))?;
    let host = picked
        .to_dtype(DType::F32)
        .and_then(|h| h.to_vec1::<f32>())
        .map_err(tensor_ctx(what))?;
    Ok((picked, host))
}

/// Splits texts into at most `n` contiguous ranges of whole groups, as even in group count as
/// the groups allow, never an empty one. `group_of_text[i]` is text `i`'s group; a group's texts
/// are adjacent (batch order).
pub fn minibatch_ranges(group_of_text: &[usize], n: usize) -> Vec<std::ops::Range<usize>> {
    let len = group_of_text.len();
    let starts: Vec<usize> = (0..len)
        .filter(|&i| i == 0 || group_of_text[i - 1] != group_of_text[i])
        .collect();
    let groups = starts.len();
    let n = n.clamp(1, groups.max(1));
    (0..n)
        .map(|k| {
            let at = |g: usize| starts.get(g).copied().unwrap_or(len);
            at(k * groups / n)..at((k + 1) * groups / n)
        })
        .filter(|r| !r.is_empty())
        .collect()
}

/// The model crate's view of a micro-batch.
pub(crate) fn packed(mb: &MicroBatch) -> PackedBatch {
    PackedBatch {
        batch: mb.rows,
        seq_len: mb.row_len,
        input_ids: mb.input_ids.clone(),
        position_ids: mb.position_ids.clone(),
        segment_ids: mb.segment_ids.clone(),
        prefix_ids: mb.prefix_ids.clone(),
        target_ids: mb.target_ids.clone(),
        target_mask: mb.target_mask.clone(),
    }
}

/// The rollouts of `texts` (a rollout's texts are adjacent, turns in order): each as the range
/// of its texts.
pub(crate) fn rollouts(texts: &[ScoredText<'_>]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        match out.last_mut() {
            Some(r) if texts[r.start].group == t.group && texts[r.start].rollout == t.rollout => {
                r.end = i + 1;
            }
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// For each micro-batch of `packing` (the texts `share`, the first of them the step's text
/// `offset`), the step's text and completion token of each loss slot, in order.
pub(crate) fn slot_places(
    packing: &Packing,
    share: &[ScoredText<'_>],
    offset: usize,
) -> Result<Vec<Vec<(usize, usize)>>, TrainerError> {
    packing
        .micro_batches
        .iter()
        .map(|mb| {
            mb.loss_slots()
                .into_iter()
                .map(|slot| {
                    let local = mb.text_ids[slot] as usize;
                    let text = share.get(local).ok_or_else(|| {
                        TrainerError::Input(format!("loss slot {slot} of an unknown text {local}"))
                    })?;
                    // Slot j scores token j + 1 of its text.
                    let token = mb.position_ids[slot] as usize + 1;
                    let c = token
                        .checked_sub(text.text.prompt_token_ids.len())
                        .filter(|&c| c < text.text.completion_tokens())
                        .ok_or_else(|| {
                            TrainerError::Input(format!(
                                "loss slot {slot} scores token {token}, outside text {local}'s completion"
                            ))
                        })?;
                    Ok((offset + local, c))
                })
                .collect()
        })
        .collect()
}

/// The log-probs `model` gives `mb`'s loss slots, in order (no gradient: the forward that keeps
/// one layer's activations at a time).
pub(crate) fn slot_logprobs(
    model: &TrainableModel,
    mb: &MicroBatch,
    options: ForwardOptions,
    what: &str,
) -> Result<Vec<f32>, TrainerError> {
    let slots = mb.loss_slots();
    if slots.is_empty() {
        return Ok(Vec::new());
    }
    let options = ForwardOptions {
        kept_logits_bytes: 0,
        ..options
    };
    let (scores, _) = model.token_scores_recomputable(&packed(mb), options)?;
    let index = slot_index(&slots, model.device())?;
    Ok(pick(&scores.logprobs.detach(), &index, what)?.1)
}

#[cfg(test)]
mod tests {
    use super::minibatch_ranges;

    #[test]
    fn minibatches_hold_whole_groups_and_are_never_empty() {
        // Texts of groups 0,0 | 1 | 2,2,2 | 3.
        let groups = [0, 0, 1, 2, 2, 2, 3];
        assert_eq!(minibatch_ranges(&groups, 1), vec![0..7]);
        assert_eq!(minibatch_ranges(&groups, 2), vec![0..3, 3..7]);
        assert_eq!(minibatch_ranges(&groups, 4), vec![0..2, 2..3, 3..6, 6..7]);
        // More minibatches than groups: one group each.
        assert_eq!(minibatch_ranges(&groups, 9), vec![0..2, 2..3, 3..6, 6..7]);
        assert_eq!(minibatch_ranges(&groups, 0), vec![0..7]);
        assert!(minibatch_ranges(&[], 3).is_empty());
    }
}
