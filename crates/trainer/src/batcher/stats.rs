//! [`PackingStats`]: what one packing (or a step's several) holds and costs.

/// Counts of one packing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackingStats {
    /// Texts packed (whole or split).
    pub texts: usize,
    /// Texts that were split into pieces.
    pub split_texts: usize,
    /// Texts left out: longer than a row under `reject`, needing more than `B` rows, or without
    /// a prompt token to condition their first completion token on.
    pub rejected_texts: usize,
    /// Completion tokens of the rejected texts.
    pub rejected_tokens: usize,
    /// Slots holding a token.
    pub used_slots: usize,
    /// `B · L` summed over the micro-batches.
    pub total_slots: usize,
    /// Loss slots (completion tokens trained on).
    pub loss_tokens: usize,
}

impl PackingStats {
    /// Adds `other`'s counts to these (the packings of one step's minibatches).
    pub fn merge(&mut self, other: &PackingStats) {
        let PackingStats {
            texts,
            split_texts,
            rejected_texts,
            rejected_tokens,
            used_slots,
            total_slots,
            loss_tokens,
        } = *other;
        self.texts += texts;
        self.split_texts += split_texts;
        self.rejected_texts += rejected_texts;
        self.rejected_tokens += rejected_tokens;
        self.used_slots += used_slots;
        self.total_slots += total_slots;
        self.loss_tokens += loss_tokens;
    }

    /// `used_slots / total_slots` (1 when nothing was packed).
    pub fn efficiency(&self) -> f64 {
        if self.total_slots == 0 {
            1.0
        } else {
            self.used_slots as f64 / self.total_slots as f64
        }
    }
}
