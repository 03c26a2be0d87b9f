//! [`ReplayStore`]: every admitted group, the bucket it is in, and the counters that admission and
//! the metrics need. Pure logic: each mutation appends [`PersistOp`]s to an outbox that the owner
//! flushes to the [`crate::Persister`] before acknowledging.
//!
//! Ordering: "oldest" means lowest admission counter (`GroupId` order), so `take_batch` serves
//! groups in the order they were admitted.

use std::collections::{BTreeSet, HashMap};

use sluice_core::{GroupId, PolicyVersion, RolloutGroup, RolloutStatus};

use crate::bucket::{Bucket, Transition};
use crate::error::ReplayError;
use crate::persist::PersistOp;

mod lanes;
mod outcome;
mod reconcile;

pub use lanes::{Lane, ResumedGroups, Waiting};
pub use outcome::{ClearOutcome, Counters, FinishOutcome, StoreSnapshot, TakeOutcome};

struct Entry {
    bucket: Bucket,
    /// The group's data while it is at rest (completed, aborted, expired). A group in flight
    /// is on disk only (its record is written when it starts): the controller holds the live
    /// copy and hands it back when the group ends. Final groups are forgotten.
    group: Option<RolloutGroup>,
    /// The largest abort count of the group's rollouts when it was last stored.
    aborts: u32,
}

/// The in-memory replay store.
pub struct ReplayStore {
    entries: HashMap<GroupId, Entry>,
    by_bucket: [BTreeSet<GroupId>; Bucket::ALL.len()],
    counters: Counters,
    drop_expired: bool,
    filter_zero_advantage: bool,
    /// `tail_batch_candidate_steps`: which aborted groups are tail candidates ([`Lane::Tail`]).
    tail_steps: u32,
    outbox: Vec<PersistOp>,
}

impl ReplayStore {
    /// An empty store. `drop_expired`: expired groups are final (else they wait for regeneration);
    /// `filter_zero_advantage`: groups with equal rewards go to `Filtered`.
    pub fn new(drop_expired: bool, filter_zero_advantage: bool) -> Self {
        Self {
            entries: HashMap::new(),
            by_bucket: Default::default(),
            counters: Counters::default(),
            drop_expired,
            filter_zero_advantage,
            tail_steps: 0,
            outbox: Vec::new(),
        }
    }

    /// Rebuilds a store from persisted records. Groups that were pending or in flight when the
    /// process died come back `Aborted` (their last saved partials resume); their ongoing rollouts
    /// are marked aborted so the controller resubmits them.
    pub fn recover(
        drop_expired: bool,
        filter_zero_advantage: bool,
        counters: Counters,
        records: Vec<(Bucket, RolloutGroup)>,
    ) -> Self {
        let mut store = Self::new(drop_expired, filter_zero_advantage);
        store.counters = counters;
        for (bucket, mut group) in records {
            let id = group.id;
            let bucket = match bucket {
                Bucket::Pending | Bucket::InFlight => {
                    for r in &mut group.rollouts {
                        if r.status == RolloutStatus::Ongoing {
                            r.status = RolloutStatus::Aborted;
                        }
                    }
                    store.count_transition(bucket, Bucket::Aborted);
                    store.outbox.push(PersistOp::put(Bucket::Aborted, &group));
                    Bucket::Aborted
                }
                b => b,
            };
            store.by_bucket[bucket.index()].insert(id);
            store.entries.insert(
                id,
                Entry {
                    bucket,
                    aborts: group.max_aborts(),
                    group: Some(group),
                },
            );
        }
        store.push_counters();
        store
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Groups currently in `bucket`. Final buckets keep no data, only their count (derived from
    /// the persisted transition counters, so it survives restarts).
    pub fn count(&self, bucket: Bucket) -> u64 {
        if self.is_final(bucket) {
            self.counters
                .transitions
                .iter()
                .filter(|(t, _)| t.to == bucket)
                .map(|(_, v)| *v)
                .sum()
        } else {
            self.by_bucket[bucket.index()].len() as u64
        }
    }

    /// Whether a group in `bucket` is done for good (its data and id are forgotten).
    pub fn is_final(&self, bucket: Bucket) -> bool {
        matches!(
            bucket,
            Bucket::Consumed | Bucket::Failed | Bucket::Filtered | Bucket::Cleared
        ) || (bucket == Bucket::Expired && self.drop_expired)
    }

    /// Ids in `bucket`, oldest first.
    pub fn ids(&self, bucket: Bucket) -> impl Iterator<Item = GroupId> + '_ {
        self.by_bucket[bucket.index()].iter().copied()
    }

    /// The bucket a group is in.
    pub fn bucket_of(&self, id: GroupId) -> Option<Bucket> {
        self.entries.get(&id).map(|e| e.bucket)
    }

    /// The group's data (absent once final).
    pub fn group(&self, id: GroupId) -> Option<&RolloutGroup> {
        self.entries.get(&id).and_then(|e| e.group.as_ref())
    }

    /// Per-bucket counts and counters.
    pub fn snapshot(&self) -> StoreSnapshot {
        StoreSnapshot {
            buckets: Bucket::ALL.iter().map(|b| (*b, self.count(*b))).collect(),
            counters: self.counters.clone(),
        }
    }

    /// Takes the persistence ops accumulated since the last call (flush them before acknowledging).
    pub fn drain_outbox(&mut self) -> Vec<PersistOp> {
        std::mem::take(&mut self.outbox)
    }

    /// Records a newly published version.
    pub fn set_policy_version(&mut self, version: PolicyVersion) {
        if version.0 > self.counters.policy_version {
            self.counters.policy_version = version.0;
            self.push_counters();
        }
    }

    /// `groups` consumed groups trained in a step that published no version (every advantage
    /// was zero): they stay consumed (never trained again) but leave the admission load, as the
    /// step would have moved the bound by as many groups had it published.
    pub fn release_skipped(&mut self, groups: u64) {
        let groups = groups.min(self.counters.consumed_total - self.counters.skipped_total);
        if groups == 0 {
            return;
        }
        self.counters.skipped_total += groups;
        self.counters.released_total += groups;
        self.push_counters();
    }

    /// Admits a new group and marks it in flight (admission and submission are one decision):
    /// `Pending → InFlight`, both transitions counted.
    pub fn admit(&mut self, group: RolloutGroup) -> Result<(), ReplayError> {
        let id = group.id;
        if self.entries.contains_key(&id) {
            return Err(ReplayError::Duplicate { group: id });
        }
        self.counters.admitted_total += 1;
        self.counters.next_group_counter = self.counters.next_group_counter.max(id.counter + 1);
        self.entries.insert(
            id,
            Entry {
                bucket: Bucket::Pending,
                group: None,
                aborts: 0,
            },
        );
        self.by_bucket[Bucket::Pending.index()].insert(id);
        self.set_bucket(id, Bucket::InFlight, Some(group))?;
        self.push_counters();
        Ok(())
    }

    /// A group whose rollouts all ended: `InFlight → Completed | Failed | Filtered | Expired`.
    /// `current` and `max_version_lag` decide expiry; see the module docs of [`crate::bucket`].
    pub fn finish(
        &mut self,
        group: RolloutGroup,
        current: PolicyVersion,
        max_version_lag: u64,
    ) -> Result<FinishOutcome, ReplayError> {
        let trainable = group.rollouts.iter().any(|r| r.status.is_trainable());
        let bucket = if !trainable {
            Bucket::Failed
        } else if is_expired(&group, current, max_version_lag) {
            Bucket::Expired
        } else if self.filter_zero_advantage && group.has_uniform_reward() {
            Bucket::Filtered
        } else {
            Bucket::Completed
        };
        self.set_bucket(group.id, bucket, Some(group))?;
        self.push_counters();
        Ok(FinishOutcome { bucket })
    }

    /// A group interrupted by a weight update, with its partials: `InFlight → Aborted`.
    pub fn abort(&mut self, group: RolloutGroup) -> Result<(), ReplayError> {
        self.set_bucket(group.id, Bucket::Aborted, Some(group))?;
        self.push_counters();
        Ok(())
    }

    /// Takes an aborted or expired group back in flight and returns what to submit.
    ///
    /// - Aborted, tokens still within η of `current`, partials on: resumed as saved.
    /// - Aborted, partials off: the interrupted turns lose their partial completion.
    /// - Aborted but some token already older than `current − η`: it could never be trained, so
    ///   it expires and is regenerated from its prompts (or dropped under the drop policy).
    /// - Expired: regenerated from the prompts.
    ///
    /// Returns `None` when the group was dropped instead.
    pub fn resume(
        &mut self,
        id: GroupId,
        current: PolicyVersion,
        max_version_lag: u64,
        enable_partial_rollout: bool,
    ) -> Result<Option<RolloutGroup>, ReplayError> {
        let entry = self
            .entries
            .get_mut(&id)
            .ok_or(ReplayError::UnknownGroup { group: id })?;
        let from = entry.bucket;
        if !matches!(from, Bucket::Aborted | Bucket::Expired) {
            return Err(ReplayError::IllegalTransition {
                group: id,
                from,
                to: Bucket::InFlight,
            });
        }
        let mut group = entry
            .group
            .take()
            .ok_or(ReplayError::UnknownGroup { group: id })?;
        if from == Bucket::Aborted && is_expired(&group, current, max_version_lag) {
            self.set_bucket(id, Bucket::Expired, Some(group))?;
            if self.drop_expired {
                self.push_counters();
                return Ok(None);
            }
            group = self
                .entries
                .get_mut(&id)
                .and_then(|e| e.group.take())
                .expect("just stored");
            self.counters.discarded_tokens += regenerate(&mut group);
        } else if from == Bucket::Expired {
            self.counters.discarded_tokens += regenerate(&mut group);
        } else if !enable_partial_rollout {
            for r in &mut group.rollouts {
                if r.status == RolloutStatus::Aborted
                    && let Some(turn) = r.turns.last_mut()
                {
                    self.counters.discarded_tokens += turn.discard_completion() as u64;
                }
            }
        }
        let group = self
            .set_bucket(id, Bucket::InFlight, Some(group))?
            .expect("a group in flight is handed back");
        self.push_counters();
        Ok(Some(group))
    }

    /// Moves completed groups with a token older than `current − η` to `Expired` and returns their
    /// ids (the controller regenerates them unless the policy drops them).
    pub fn expire_stale(&mut self, current: PolicyVersion, max_version_lag: u64) -> Vec<GroupId> {
        let stale: Vec<GroupId> = self.by_bucket[Bucket::Completed.index()]
            .iter()
            .copied()
            .filter(|id| {
                self.group(*id)
                    .is_some_and(|g| is_expired(g, current, max_version_lag))
            })
            .collect();
        for id in &stale {
            let group = self.entries.get_mut(id).and_then(|e| e.group.take());
            // The group is in Completed, so the transition is legal and cannot fail.
            let _ = self.set_bucket(*id, Bucket::Expired, group);
        }
        if !stale.is_empty() {
            self.push_counters();
        }
        stale
    }

    /// The trainer, holding weights `current`, asks for `n` groups. Stale completed groups expire
    /// first, so every returned token has version ≥ `current − η`; then the `n` oldest are taken
    /// (`Completed → Consumed`), or nothing when fewer than `n` are eligible.
    pub fn take_batch(
        &mut self,
        n: usize,
        current: PolicyVersion,
        max_version_lag: u64,
    ) -> (TakeOutcome, Vec<GroupId>) {
        let expired = self.expire_stale(current, max_version_lag);
        let available = self.count(Bucket::Completed);
        if (available as usize) < n || n == 0 {
            return (TakeOutcome::NotEnough { available }, expired);
        }
        let ids: Vec<GroupId> = self.by_bucket[Bucket::Completed.index()]
            .iter()
            .take(n)
            .copied()
            .collect();
        let mut batch = Vec::with_capacity(n);
        for id in ids {
            let group = self.entries.get_mut(&id).and_then(|e| e.group.take());
            if let Some(g) = group {
                batch.push(g);
            }
            let _ = self.set_bucket(id, Bucket::Consumed, None);
        }
        self.counters.consumed_total += batch.len() as u64;
        self.push_counters();
        (TakeOutcome::Batch(batch), expired)
    }

    /// An operator's clear: every group in `buckets` (each one of [`Bucket::CLEARABLE`]) moves
    /// to `Cleared`, untrained, and leaves the admission load as a filtered group does. Their
    /// prompts are not sampled again: the operator chose to drop them. Refuses, changing nothing,
    /// when a bucket cannot be cleared.
    pub fn clear(&mut self, buckets: &[Bucket]) -> Result<ClearOutcome, ReplayError> {
        if let Some(b) = buckets.iter().find(|b| !Bucket::CLEARABLE.contains(b)) {
            return Err(ReplayError::NotClearable { bucket: *b });
        }
        let mut outcome = ClearOutcome::default();
        for &bucket in buckets {
            let ids: Vec<GroupId> = self.by_bucket[bucket.index()].iter().copied().collect();
            outcome.cleared.insert(bucket, ids.len() as u64);
            for id in ids {
                let group = self.entries.get_mut(&id).and_then(|e| e.group.take());
                outcome.discarded_tokens += group.as_ref().map_or(0, generated_tokens);
                // `bucket` is clearable and the id was in it, so the move is legal.
                self.set_bucket(id, Bucket::Cleared, None)?;
                outcome.ids.push(id);
            }
        }
        outcome.ids.sort();
        self.counters.discarded_tokens += outcome.discarded_tokens;
        self.push_counters();
        Ok(outcome)
    }

    /// Moves `id` to `to` with `group` as its data and writes the record; returns the data when
    /// `to` keeps none in memory (in flight: see [`Entry::group`]). A group that expires has
    /// every rollout marked [`RolloutStatus::Expired`] (a regeneration resets them).
    fn set_bucket(
        &mut self,
        id: GroupId,
        to: Bucket,
        mut group: Option<RolloutGroup>,
    ) -> Result<Option<RolloutGroup>, ReplayError> {
        let is_final = self.is_final(to);
        let entry = self
            .entries
            .get_mut(&id)
            .ok_or(ReplayError::UnknownGroup { group: id })?;
        let from = entry.bucket;
        if !from.can_move_to(to) {
            // Put back whatever data the caller handed over, so a refused move changes nothing
            // (a group in flight keeps none in memory).
            if entry.group.is_none() && !matches!(from, Bucket::Pending | Bucket::InFlight) {
                entry.group = group;
            }
            return Err(ReplayError::IllegalTransition {
                group: id,
                from,
                to,
            });
        }
        self.by_bucket[from.index()].remove(&id);
        if to == Bucket::Expired
            && let Some(g) = &mut group
        {
            for r in &mut g.rollouts {
                r.status = RolloutStatus::Expired;
            }
        }
        let mut handed_back = None;
        if is_final {
            if to == Bucket::Expired {
                // Dropped, never to be trained or regenerated: its tokens are thrown away.
                self.counters.discarded_tokens += group.as_ref().map_or(0, generated_tokens);
            }
            self.entries.remove(&id);
            if to != Bucket::Consumed {
                self.counters.released_total += 1;
            }
            self.outbox.push(PersistOp::Delete(id));
        } else {
            entry.bucket = to;
            self.by_bucket[to.index()].insert(id);
            match &group {
                Some(g) if to.is_persisted() => self.outbox.push(PersistOp::put(to, g)),
                _ => self.outbox.push(PersistOp::Delete(id)),
            }
            if let Some(g) = &group {
                entry.aborts = g.max_aborts();
            }
            if to == Bucket::InFlight {
                entry.group = None;
                handed_back = group;
            } else {
                entry.group = group;
            }
        }
        self.count_transition(from, to);
        Ok(handed_back)
    }

    fn count_transition(&mut self, from: Bucket, to: Bucket) {
        *self
            .counters
            .transitions
            .entry(Transition { from, to })
            .or_default() += 1;
    }

    fn push_counters(&mut self) {
        self.outbox.push(PersistOp::Counters(self.counters.clone()));
    }
}

/// Some generated token is older than `current − η`. A group whose oldest token is ahead of
/// `current` (weights the trainer never published) has no lag to trust: it is expired too.
fn is_expired(group: &RolloutGroup, current: PolicyVersion, max_version_lag: u64) -> bool {
    group.min_version().is_some_and(|v| {
        v.lag_to(current)
            .ok()
            .is_none_or(|lag| lag > max_version_lag)
    })
}

/// Resets every rollout to its first prompt; returns the tokens thrown away.
/// The completion tokens `group`'s rollouts generated.
fn generated_tokens(group: &RolloutGroup) -> u64 {
    group
        .rollouts
        .iter()
        .map(|r| r.completion_tokens() as u64)
        .sum()
}

fn regenerate(group: &mut RolloutGroup) -> u64 {
    let mut discarded = 0;
    for r in &mut group.rollouts {
        discarded += r.completion_tokens() as u64;
        r.turns.truncate(1);
        if let Some(t) = r.turns.first_mut() {
            t.discard_completion();
            t.env_messages.clear();
            t.env_reward = None;
        }
        r.status = RolloutStatus::Aborted;
        r.reward = 0.0;
        r.reward_components.clear();
    }
    discarded
}
