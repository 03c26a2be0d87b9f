//! [`PackedBatch`]: several token sequences packed into fixed `(B, L)` rows, with the position
//! ids, segment ids and next-token targets the training forward needs.

use crate::error::{ModelError, Result};

/// Segment id of padding slots (sequences are numbered from 1 within a row).
pub const PAD_SEGMENT: u32 = 0;

/// A `(batch, seq_len)` micro-batch; every vector is row-major with `batch * seq_len` entries.
///
/// Attention is allowed from slot `i` to slot `j` of the same row iff `j ≤ i` and both have the
/// same segment id, so packed sequences never see each other. Positions restart at 0 for each
/// sequence (RoPE sees each sequence as if it were alone).
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

    /// The additive attention mask `(B, L, L)`, 0 where attention is allowed and −∞ elsewhere.
    pub(crate) fn attention_mask(&self) -> Vec<f32> {
        let l = self.seq_len;
        let mut mask = vec![f32::NEG_INFINITY; self.batch * l * l];
        for r in 0..self.batch {
            let seg = &self.segment_ids[r * l..(r + 1) * l];
            for i in 0..l {
                let row = &mut mask[(r * l + i) * l..(r * l + i + 1) * l];
                for j in 0..=i {
                    if seg[j] == seg[i] {
                        row[j] = 0.0;
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
        assert!(batch.validate(9).is_err());
        batch.validate(10).unwrap();
    }
}
