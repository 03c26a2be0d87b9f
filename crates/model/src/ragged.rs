//! The layout of one inference step's ragged batch ([`StepLayout`]): the inputs that add one
//! token first, for batched decode attention; then the prompt chunks, longest first, grouped
//! into padded attention batches ([`PrefillBatch`]); and the logit rows back in the caller's
//! order.
//!
//! Continuous batching mixes the two in most steps (a prompt is admitted while others decode).
//! Decoding sequences then keep their batched attention, and prompt chunks of similar lengths
//! share one padded batch instead of a dozen small ops each: on a GPU those ops are launches,
//! and one 16-token prompt cost about as much as a 64-sequence decode step.

use candle_core::{DType, Device, Tensor};

use crate::cache::SeqId;
use crate::infer::{LogitsWanted, StepInput};

/// Padded attention work a batch of prompt chunks may do over the work of its chunks alone,
/// as a fraction (5/4): chunks of similar lengths share a batch, a short one never pads to a
/// long one.
const MAX_PADDING: (usize, usize) = (5, 4);
/// Attention scores one prompt batch may hold per layer (`heads · B · L · T` elements, 64 MiB
/// of f32: batching stops paying well before that); a chunk past this alone is a batch of its
/// own, as one sequence always was.
const MAX_SCORES: usize = 1 << 24;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct StepLayout {
    /// The caller's index of each input, in the step's order.
    pub order: Vec<usize>,
    /// Inputs `0..decoding` (in the step's order) add one token each.
    pub decoding: usize,
}

/// Prompt chunks whose attention runs as one padded batch: query rows padded to the longest
/// chunk `L`, keys and values to the longest sequence `T`.
#[derive(Debug)]
pub(crate) struct PrefillBatch {
    pub seqs: Vec<SeqId>,
    /// New tokens per sequence.
    pub news: Vec<usize>,
    /// Rows (tokens) of the batch and the first of them among the step's prompt rows.
    pub rows: usize,
    pub first_row: usize,
    /// `L` and `T`.
    pub longest_new: usize,
    pub longest_total: usize,
    /// `(B · L)` indices into the batch's rows: query `i` of sequence `b` at `b · L + i`
    /// (padding repeats a sequence's last row); `None` when there is no padding.
    pub pad: Option<Tensor>,
    /// `(rows,)` indices of the real queries among the padded ones; `None` with `pad`.
    pub unpad: Option<Tensor>,
    /// `(B, 1, 1, L, T)` additive causal mask: query `i` of sequence `b` (at position
    /// `past[b] + i`) sees keys `0..=past[b] + i`.
    pub mask: Tensor,
}

impl StepLayout {
    /// The layout of `inputs`.
    pub fn new(inputs: &[StepInput<'_>]) -> Self {
        let len = |i: usize| inputs[i].tokens.len();
        let mut order: Vec<usize> = (0..inputs.len()).filter(|&i| len(i) == 1).collect();
        let decoding = order.len();
        let mut prompts: Vec<usize> = (0..inputs.len()).filter(|&i| len(i) > 1).collect();
        prompts.sort_by_key(|&i| std::cmp::Reverse(len(i)));
        order.extend(&prompts);
        Self { order, decoding }
    }

    /// The padded attention batches covering the prompt chunks, in order: `inputs` and `past`
    /// are in the step's order (the layout's), for a model of `heads` query heads computing in
    /// `dtype` on `device`. Only a cache that does not attend itself needs them.
    pub fn prefill_batches(
        &self,
        inputs: &[StepInput<'_>],
        past: &[usize],
        heads: usize,
        (dtype, device): (DType, &Device),
    ) -> candle_core::Result<Vec<PrefillBatch>> {
        let len = |i: usize| inputs[i].tokens.len();
        let total = |i: usize| past[i] + len(i);
        let prompts = self.decoding..inputs.len();
        let mut batches = Vec::new();
        let (mut start, mut first_row) = (prompts.start, 0);
        while start < prompts.end {
            let l = len(start);
            let (mut t, mut work, mut end) = (total(start), l * total(start), start + 1);
            while end < prompts.end {
                let (t2, b2) = (t.max(total(end)), end - start + 1);
                let work2 = work + len(end) * total(end);
                if MAX_PADDING.1 * b2 * l * t2 > MAX_PADDING.0 * work2
                    || heads * b2 * l * t2 > MAX_SCORES
                {
                    break;
                }
                (t, work, end) = (t2, work2, end + 1);
            }
            let batch = PrefillBatch::new(
                (start..end).map(|i| (inputs[i].seq, len(i), past[i])),
                first_row,
                (dtype, device),
            )?;
            first_row += batch.rows;
            batches.push(batch);
            start = end;
        }
        Ok(batches)
    }

    /// The rows of the step's `(N, ·)` activations that the caller's logits come from, in the
    /// caller's order (`lens`: new tokens per input in the caller's order); `None` when that
    /// is every row as it stands.
    pub fn logit_rows(&self, lens: &[usize], wanted: LogitsWanted) -> Option<Vec<u32>> {
        let mut start = vec![0usize; lens.len()];
        let mut row = 0;
        for &i in &self.order {
            start[i] = row;
            row += lens[i];
        }
        let in_order = self.order.iter().enumerate().all(|(k, &i)| k == i);
        match wanted {
            LogitsWanted::All if in_order => None,
            LogitsWanted::Last if in_order && self.decoding == lens.len() => None,
            LogitsWanted::All => Some(
                (0..lens.len())
                    .flat_map(|i| (start[i]..start[i] + lens[i]).map(|r| r as u32))
                    .collect(),
            ),
            LogitsWanted::Last => Some(
                (0..lens.len())
                    .map(|i| (start[i] + lens[i] - 1) as u32)
                    .collect(),
            ),
        }
    }
}

impl PrefillBatch {
    /// A batch of `(sequence, new tokens, past tokens)` members, longest chunk first.
    fn new(
        members: impl Iterator<Item = (SeqId, usize, usize)>,
        first_row: usize,
        (dtype, device): (DType, &Device),
    ) -> candle_core::Result<Self> {
        let members: Vec<(SeqId, usize, usize)> = members.collect();
        let l = members.iter().map(|m| m.1).max().unwrap_or(1);
        let t = members.iter().map(|m| m.1 + m.2).max().unwrap_or(1);
        let b = members.len();
        let rows: usize = members.iter().map(|m| m.1).sum();
        let (pad, unpad) = if rows == b * l {
            (None, None)
        } else {
            let mut pad = Vec::with_capacity(b * l);
            let mut unpad = Vec::with_capacity(rows);
            let mut offset = 0;
            for (k, &(_, n, _)) in members.iter().enumerate() {
                pad.extend((0..l).map(|i| (offset + i.min(n - 1)) as u32));
                unpad.extend((0..n).map(|i| (k * l + i) as u32));
                offset += n;
            }
            (
                Some(Tensor::from_vec(pad, b * l, device)?),
                Some(Tensor::from_vec(unpad, rows, device)?),
            )
        };
        let mask: Vec<f32> = members
            .iter()
            .flat_map(|&(_, _, past)| {
                (0..l).flat_map(move |i| {
                    (0..t).map(move |j| {
                        if j <= past + i {
                            0.0
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (b, 1, 1, l, t), device)?.to_dtype(dtype)?;
        Ok(Self {
            seqs: members.iter().map(|m| m.0).collect(),
            news: members.iter().map(|m| m.1).collect(),
            rows,
            first_row,
            longest_new: l,
            longest_total: t,
            pad,
            unpad,
            mask,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(lens: &[usize]) -> StepLayout {
        let tokens: Vec<Vec<u32>> = lens.iter().map(|&n| vec![1; n]).collect();
        StepLayout::new(&StepInput::numbered(&tokens))
    }

    /// The prompt batches of inputs of `lens` tokens after `past` ones (the caller's order).
    fn batches(l: &StepLayout, lens: &[usize], past: &[usize]) -> Vec<PrefillBatch> {
        let tokens: Vec<Vec<u32>> = l.order.iter().map(|&i| vec![1; lens[i]]).collect();
        let inputs: Vec<StepInput<'_>> = (l.order.iter().zip(&tokens))
            .map(|(&i, t)| StepInput {
                seq: i as u64,
                tokens: t,
            })
            .collect();
        let past: Vec<usize> = l.order.iter().map(|&i| past[i]).collect();
        l.prefill_batches(&inputs, &past, 2, (DType::F32, &Device::Cpu))
            .unwrap()
    }

    #[test]
    fn decoding_inputs_lead_and_prompts_batch_by_length() {
        // Two one-token inputs, then prompts of 7, 7, 6 (one batch) and 40 (too much padding
        // for the others: a batch of its own, first as the longest).
        let (lens, past) = ([7, 1, 40, 6, 1, 7], [0, 5, 0, 3, 9, 0]);
        let l = layout(&lens);
        assert_eq!(l.order, vec![1, 4, 2, 0, 5, 3]);
        assert_eq!(l.decoding, 2);
        let batches = batches(&l, &lens, &past);
        let shapes: Vec<(Vec<u64>, usize, usize, usize)> = batches
            .iter()
            .map(|b| (b.seqs.clone(), b.first_row, b.longest_new, b.longest_total))
            .collect();
        assert_eq!(
            shapes,
            vec![(vec![2], 0, 40, 40), (vec![0, 5, 3], 40, 7, 9)]
        );
        let second = &batches[1];
        assert!(batches[0].pad.is_none());
        let pad = second.pad.as_ref().unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(pad[14..], [14, 15, 16, 17, 18, 19, 19]);
        let unpad = second.unpad.as_ref().unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(unpad.len(), 20);
        assert_eq!(unpad[14..], [14, 15, 16, 17, 18, 19]);
        // Sequence 3 (past 3): its query 0 sees keys 0..=3, its query 5 keys 0..=8.
        let mask = second.mask.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let at = |b: usize, i: usize, j: usize| mask[(b * 7 + i) * 9 + j];
        assert_eq!(at(2, 0, 3), 0.0);
        assert_eq!(at(2, 0, 4), f32::NEG_INFINITY);
        assert_eq!(at(2, 5, 8), 0.0);
        assert_eq!(at(0, 6, 6), 0.0);
        assert_eq!(at(0, 5, 6), f32::NEG_INFINITY);
    }

    #[test]
    fn logit_rows_come_back_in_the_callers_order() {
        let l = layout(&[3, 1, 2]);
        // Step order: input 1 (row 0), input 0 (rows 1..4), input 2 (rows 4..6).
        assert_eq!(
            l.logit_rows(&[3, 1, 2], LogitsWanted::Last),
            Some(vec![3, 0, 5])
        );
        assert_eq!(
            l.logit_rows(&[3, 1, 2], LogitsWanted::All),
            Some(vec![1, 2, 3, 0, 4, 5])
        );
        let in_order = layout(&[1, 1, 4, 2]);
        assert_eq!(in_order.logit_rows(&[1, 1, 4, 2], LogitsWanted::All), None);
        let decoding = layout(&[1, 1]);
        assert_eq!(decoding.logit_rows(&[1, 1], LogitsWanted::Last), None);
    }
}
