//! No-progress detection: a run whose groups keep ending untrainable (every rollout failed,
//! every reward equal so the group was filtered, or generated with weights too old to train)
//! would loop at the same step forever, admitting
//! and failing groups without a line of output. [`ProgressWatch`] counts the groups stored since
//! the last trainable one and, past a limit, says why in one message: the rollout statuses seen,
//! and a sample error.

use std::collections::BTreeMap;

use sluice_core::{RolloutGroup, RolloutStatus};

use crate::bucket::Bucket;

/// What a finished group looked like, kept from its end until the store says where it went.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GroupSummary {
    /// Its rollouts by status label.
    pub statuses: BTreeMap<&'static str, u64>,
    /// One error among its rollouts (`Error(kind)`), if any.
    pub error: Option<String>,
}

impl GroupSummary {
    /// The statuses and a sample error of `group`'s rollouts.
    pub fn of(group: &RolloutGroup) -> Self {
        let mut s = Self::default();
        for r in &group.rollouts {
            *s.statuses.entry(r.status.as_label()).or_default() += 1;
            if let RolloutStatus::Error(kind) = &r.status {
                s.error.get_or_insert_with(|| kind.clone());
            }
        }
        s
    }
}

/// Counts groups that ended untrainable since the last trainable one.
#[derive(Debug, Clone, Default)]
pub struct ProgressWatch {
    /// Untrainable groups in a row that stop the run (0 = never).
    limit: u64,
    failed: u64,
    filtered: u64,
    expired: u64,
    statuses: BTreeMap<&'static str, u64>,
    error: Option<String>,
}

impl ProgressWatch {
    /// A watch that trips after `limit` untrainable groups in a row (0 = off).
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            ..Self::default()
        }
    }

    /// A group was stored in `bucket`; `summary` is what it looked like when it ended. Returns
    /// the reason to stop when this group reaches the limit.
    pub fn stored(&mut self, bucket: Bucket, summary: Option<&GroupSummary>) -> Option<String> {
        match bucket {
            Bucket::Completed => {
                let limit = self.limit;
                *self = Self::new(limit);
                return None;
            }
            Bucket::Failed => self.failed += 1,
            Bucket::Filtered => self.filtered += 1,
            Bucket::Expired => self.expired += 1,
            _ => return None,
        }
        if let Some(s) = summary {
            for (label, n) in &s.statuses {
                *self.statuses.entry(label).or_default() += n;
            }
            if self.error.is_none() {
                self.error.clone_from(&s.error);
            }
        }
        let untrainable = self.untrainable();
        (self.limit > 0 && untrainable == self.limit).then(|| self.reason())
    }

    /// Groups stored untrainable since the last trainable one.
    pub fn untrainable(&self) -> u64 {
        self.failed + self.filtered + self.expired
    }

    fn reason(&self) -> String {
        let statuses = self
            .statuses
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut why = format!(
            "no trainable group in the last {} finished groups ({} failed: every rollout ended in \
             error; {} filtered: every reward equal; {} expired: generated with weights older \
             than max_version_lag allows); rollouts by status: {statuses}",
            self.untrainable(),
            self.failed,
            self.filtered,
            self.expired,
        );
        if let Some(e) = &self.error {
            why.push_str(&format!("; a sample error: {e}"));
        }
        why.push_str(
            " (supervision.no_progress_groups; check the data rows, the prompt length against \
             the context, and the model's weights)",
        );
        why
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(status: &'static str, n: u64, error: Option<&str>) -> GroupSummary {
        GroupSummary {
            statuses: BTreeMap::from([(status, n)]),
            error: error.map(str::to_owned),
        }
    }

    #[test]
    fn trips_once_at_the_limit_and_a_trainable_group_resets_it() {
        let mut w = ProgressWatch::new(3);
        let failed = summary("error", 2, Some("env_panic"));
        assert_eq!(w.stored(Bucket::Failed, Some(&failed)), None);
        assert_eq!(w.stored(Bucket::Completed, None), None);
        assert_eq!(w.untrainable(), 0, "a trainable group resets the count");
        assert_eq!(w.stored(Bucket::Failed, Some(&failed)), None);
        assert_eq!(
            w.stored(Bucket::Filtered, Some(&summary("completed", 2, None))),
            None
        );
        let why = w.stored(Bucket::Failed, Some(&failed)).expect("the limit");
        assert!(why.contains("last 3 finished groups (2 failed"), "{why}");
        assert!(why.contains("completed 2, error 4"), "{why}");
        assert!(why.contains("a sample error: env_panic"), "{why}");
        assert_eq!(w.stored(Bucket::Failed, Some(&failed)), None, "said once");
    }

    #[test]
    fn off_at_zero_and_blind_to_other_buckets() {
        let mut w = ProgressWatch::new(0);
        for _ in 0..1000 {
            assert_eq!(w.stored(Bucket::Failed, None), None);
        }
        let mut w = ProgressWatch::new(2);
        assert_eq!(w.stored(Bucket::Aborted, None), None);
        assert_eq!(w.stored(Bucket::Expired, None), None);
        let why = w
            .stored(Bucket::Filtered, None)
            .expect("expired and filtered count");
        assert!(
            why.contains("1 filtered") && why.contains("1 expired"),
            "{why}"
        );
    }
}
