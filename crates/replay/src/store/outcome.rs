//! What the [`super::ReplayStore`] keeps and answers: the run's persisted counters, the outcome
//! of a finish, a take and a clear, and the snapshot `/v1/status` shows.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_core::{GroupId, RolloutGroup};

use crate::bucket::{Bucket, BucketCounts, Transition};

/// Run-level counters, persisted with the groups.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    /// Groups ever admitted.
    pub admitted_total: u64,
    /// Groups given back to admission: they ended filtered, failed or expired-and-dropped, or a
    /// training step consumed them and published nothing (see `skipped_total`).
    pub released_total: u64,
    /// Groups handed to the trainer.
    pub consumed_total: u64,
    /// Of the consumed groups, those whose step was skipped (every advantage zero): the step
    /// published no version, so the admission bound `(v + η + 1) · B` did not move for them and
    /// they are given back instead (counted in `released_total` too). Without this, η + 1 skipped
    /// steps would close admission for good.
    #[serde(default)]
    pub skipped_total: u64,
    /// The counter the next group id should carry (so a restarted run never reuses an id).
    pub next_group_counter: u64,
    /// The newest published policy version the store has seen.
    pub policy_version: u64,
    /// Generated tokens thrown away (regenerated partials, regenerated expired groups).
    pub discarded_tokens: u64,
    /// Transition counts (keys written `from->to`).
    pub transitions: BTreeMap<Transition, u64>,
}

impl Counters {
    /// Groups that count against the admission bound: running + completed + trained.
    pub fn admitted_load(&self) -> u64 {
        self.admitted_total - self.released_total
    }
}

/// What `finish` decided for a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishOutcome {
    /// The bucket the group went to.
    pub bucket: Bucket,
}

/// What `take_batch` returned.
#[derive(Debug, Clone, PartialEq)]
pub enum TakeOutcome {
    /// `n` groups, oldest first, now `Consumed`.
    Batch(Vec<RolloutGroup>),
    /// Fewer than `n` eligible groups; nothing was consumed.
    NotEnough {
        /// Eligible completed groups.
        available: u64,
    },
}

/// What [`crate::ReplayStore::clear`] threw away.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClearOutcome {
    /// Cleared groups per bucket they were in (every asked bucket appears).
    pub cleared: BucketCounts,
    /// The cleared groups, oldest first.
    #[serde(skip)]
    pub ids: Vec<GroupId>,
    /// Their generated tokens, now discarded.
    pub discarded_tokens: u64,
}

/// Counts per bucket plus the counters: what the metrics and `/v1/status` show.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StoreSnapshot {
    /// Groups per bucket (written by label).
    pub buckets: BucketCounts,
    /// The counters.
    pub counters: Counters,
}
