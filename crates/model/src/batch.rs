//! [`PackedBatch`]: several token sequences packed into fixed `(B, L)` rows, with the position
//! ids, segment ids and next-token targets the training forward needs.

use crate::error::{ModelError, Result};

/// Segment id of padding slots (sequences are numbered from 1 within a row).
pub const PAD_SEGMENT: u32 = 0;

/// Whether a slot of segment `own`, continuing prefix segment `prefix` ([`PAD_SEGMENT`] for
/// none), may see a slot of segment `other` at or before it: the attention rule of
/// [`PackedBatch`], shared by its dense mask and the fused attention kernel.
pub(crate) fn segment_visible(own: u32, prefix: u32, other: u32) -> bool {
    other == own || (prefix != PAD_SEGMENT && other == prefix)
}

/// A `(batch, seq_len)` micro-batch; every vector is row-major with `batch * seq_len` entries.
///
/// Attention is allowed from slot `i` to slot `j` of the same row iff `j ≤ i` and slot `j`'s
/// segment is slot `i`'s own or the shared prefix slot `i` continues (`prefix_ids[i]`), so packed
/// sequences never see each other. Positions count from the start of each sequence, a shared
/// prefix included (RoPE sees each sequence as if it were alone).
///
/// A shared prefix is how one prompt serves several completions: the rollouts of a GRPO group
/// share their prompt, which is packed once, followed by one segment per completion that sees the
/// prompt's segment and itself, never its siblings. Every completion token then sees exactly the
/// tokens it would see packed alone, at the same positions, so log-probs and gradients are those
/// of the unshared packing while the prompt is computed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBatch {
    /// Rows `B`.
    pub batch: usize,
    /// Slots per row `L`.
    pub seq_len: usize,
    /// Input token ids.
    pub input_ids: Vec<u32>,
    /// Position of each slot within its sequence.
    pub position_ids: Vec<u32>,
    /// Which sequence of the row each slot belongs to ([`PAD_SEGMENT`] for padding).
    pub segment_ids: Vec<u32>,
    /// The segment of the row whose slots slot `i` also sees: the shared prefix its sequence
    /// continues ([`PAD_SEGMENT`] for none). A prefix segment precedes its continuations in the
    /// row and continues nothing itself.
    pub prefix_ids: Vec<u32>,
    /// The token whose log-probability is scored at each slot (the next token of the same
    /// sequence; any valid id where `target_mask` is false).
    pub target_ids: Vec<u32>,
    /// Whether slot `i` has a real target (false for the last token of a sequence and padding).
    pub target_mask: Vec<bool>,
}

impl PackedBatch {
    /// Packs `rows[r]` (a list of sequences) into row `r`, padding with `pad_id` up to
    /// `seq_len`. Targets are the next token within each sequence. Fails when a row overflows.
    pub fn from_rows(rows: &[Vec<&[u32]>], seq_len: usize, pad_id: u32) -> Result<Self> {
        let n = rows.len() * seq_len;
        let mut b = Self {
            batch: rows.len(),
            seq_len,
            input_ids: vec![pad_id; n],
            position_ids: vec![0; n],
            segment_ids: vec![PAD_SEGMENT; n],
            prefix_ids: vec![PAD_SEGMENT; n],
            target_ids: vec![pad_id; n],
            target_mask: vec![false; n],
        };
        for (r, seqs) in rows.iter().enumerate() {
            let used: usize = seqs.iter().map(|s| s.len()).sum();
            if used > seq_len {
                return Err(ModelError::input(format!(
                    "row {r} holds {used} tokens, more than seq_len {seq_len}"
                )));
            }
            let mut at = r * seq_len;
            for (s, seq) in seqs.iter().enumerate() {
                for (i, &tok) in seq.iter().enumerate() {
                    b.input_ids[at] = tok;
                    b.position_ids[at] = i as u32;
                    b.segment_ids[at] = s as u32 + 1;
                    if let Some(&next) = seq.get(i + 1) {
                        b.target_ids[at] = next;
                        b.target_mask[at] = true;
                    }
                    at += 1;
                }
            }
        }
        Ok(b)
    }

    /// Checks that every vector has `batch * seq_len` entries and ids fit the vocabulary.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        let n = self.batch * self.seq_len;
        if n == 0 {
            return Err(ModelError::input("empty batch"));
        }
        let lens = [
            ("input_ids", self.input_ids.len()),
            ("position_ids", self.position_ids.len()),
            ("segment_ids", self.segment_ids.len()),
            ("prefix_ids", self.prefix_ids.len()),
            ("target_ids", self.target_ids.len()),
            ("target_mask", self.target_mask.len()),
        ];
        for (what, len) in lens {
            if len != n {
                return Err(ModelError::input(format!(
                    "{what} has {len} entries, batch*seq_len = {n}"
                )));
            }
        }
        for (i, &p) in self.prefix_ids.iter().enumerate() {
            let (row, seg) = (i / self.seq_len, self.segment_ids[i]);
            if p != PAD_SEGMENT && (seg == PAD_SEGMENT || p == seg) {
                return Err(ModelError::input(format!(
                    "slot {i} of row {row}: prefix segment {p} on {} slot",
                    if seg == PAD_SEGMENT {
                        "a padding"
                    } else {
                        "its own segment's"
                    }
                )));
            }
        }
        for (what, ids) in [
            ("input_ids", &self.input_ids),
            ("target_ids", &self.target_ids),
        ] {
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab_size) {
                return Err(ModelError::input(format!(
                    "{what} holds token {bad}, vocabulary has {vocab_size}"
                )));
            }
        }
        Ok(())
    }

    /// Whether slot `i` of row `r` attends to slot `j` of the same row (see the type's docs).
    pub fn sees(&self, r: usize, i: usize, j: usize) -> bool {
        let at = r * self.seq_len;
        j <= i
            && segment_visible(
                self.segment_ids[at + i],
                self.prefix_ids[at + i],
                self.segment_ids[at + j],
            )
    }

    /// The additive attention mask `(B, L, L)`, 0 where attention is allowed and −∞ elsewhere.
    pub(crate) fn attention_mask(&self) -> Vec<f32> {
        let l = self.seq_len;
        let mut mask = vec![f32::NEG_INFINITY; self.batch * l * l];
        for r in 0..self.batch {
            for i in 0..l {
                let row = &mut mask[(r * l + i) * l..(r * l + i + 1) * l];
                for (j, m) in row.iter_mut().enumerate().take(i + 1) {
                    if self.sees(r, i, j) {
                        *m = 0.0;
                    }
                }
            }
        }
        mask
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_sets_positions_segments_and_targets() {
        let a = [5u32, 6, 7];
        let b = [8u32, 9];
        let batch = PackedBatch::from_rows(&[vec![&a[..], &b[..]]], 6, 0).unwrap();
        assert_eq!(batch.input_ids, [5, 6, 7, 8, 9, 0]);
        assert_eq!(batch.position_ids, [0, 1, 2, 0, 1, 0]);
        assert_eq!(batch.segment_ids, [1, 1, 1, 2, 2, 0]);
        assert_eq!(batch.target_ids, [6, 7, 0, 9, 0, 0]);
        assert_eq!(batch.target_mask, [true, true, false, true, false, false]);
        let m = batch.attention_mask();
        let allowed = |i: usize, j: usize| m[i * 6 + j] == 0.0;
        assert!(allowed(2, 0) && allowed(4, 3) && allowed(5, 5));
        assert!(!allowed(3, 2), "second sequence must not see the first");
        assert!(!allowed(0, 1), "causal");
        assert!(PackedBatch::from_rows(&[vec![&a[..], &b[..]]], 4, 0).is_err());
        assert_eq!(batch.prefix_ids, [0; 6]);
        assert!(batch.validate(9).is_err());
        batch.validate(10).unwrap();
    }

    #[test]
    fn a_continuation_sees_its_prefix_and_itself_but_not_its_sibling() {
        // One prompt (segment 1) continued twice (segments 2 and 3).
        let mut batch =
            PackedBatch::from_rows(&[vec![&[1u32, 2][..], &[3, 4][..], &[5][..]]], 6, 0).unwrap();
        batch.prefix_ids = vec![0, 0, 1, 1, 1, 0];
        batch.validate(10).unwrap();
        assert!(batch.sees(0, 2, 0) && batch.sees(0, 4, 1), "prefix seen");
        assert!(
            !batch.sees(0, 4, 2) && !batch.sees(0, 4, 3),
            "sibling not seen"
        );
        assert!(
            batch.sees(0, 3, 2) && !batch.sees(0, 2, 3),
            "causal within a continuation"
        );
        assert!(!batch.sees(0, 1, 2), "a prefix sees nothing after it");
        let m = batch.attention_mask();
        assert_eq!(m[4 * 6..5 * 6].iter().filter(|&&x| x == 0.0).count(), 3);
        batch.prefix_ids[5] = 1;
        let err = batch.validate(10).unwrap_err().to_string();
        assert!(
            err.contains("slot 5 of row 0") && err.contains("padding"),
            "{err}"
        );
    }
}
