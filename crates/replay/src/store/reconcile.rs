//! The store's own audit: every admitted group in exactly one bucket, and the counters that
//! admission reads agreeing with the buckets (the property tests call it after every step).

use super::ReplayStore;
use crate::bucket::Bucket;

impl ReplayStore {
    /// Checks that every admitted group is in exactly one bucket; returns what is off.
    pub fn reconcile(&self) -> Result<(), String> {
        let in_buckets: u64 = Bucket::ALL.iter().map(|b| self.count(*b)).sum();
        let live: u64 = Bucket::ALL
            .iter()
            .filter(|b| !self.is_final(**b))
            .map(|b| self.count(*b))
            .sum();
        if in_buckets != self.counters.admitted_total || self.entries.len() as u64 != live {
            return Err(format!(
                "admitted {} but {} in buckets and {} live entries for {} live",
                self.counters.admitted_total,
                in_buckets,
                self.entries.len(),
                live
            ));
        }
        let released = self.counters.skipped_total
            + self.count(Bucket::Failed)
            + self.count(Bucket::Filtered)
            + self.count(Bucket::Cleared)
            + if self.drop_expired {
                self.count(Bucket::Expired)
            } else {
                0
            };
        if released != self.counters.released_total {
            return Err(format!(
                "released {} but counter says {}",
                released, self.counters.released_total
            ));
        }
        if self.count(Bucket::Consumed) != self.counters.consumed_total {
            return Err("consumed bucket and counter disagree".into());
        }
        if self.counters.skipped_total > self.counters.consumed_total {
            return Err("more groups skipped than consumed".into());
        }
        Ok(())
    }
}
