//! Opening the store (recovered from redb when it is persisted) and what is read off it: the
//! counts every notice carries (the groups waiting to resume among them), and the [`Recovery`]
//! the controller continues a run from.

use sluice_core::{PolicyVersion, RolloutGroup};
use sluice_replay::{Bucket, Persister, ReplayStore};

use super::{Recovery, ReplayCounts, ReplayOptions};
use crate::ActorError;

pub(super) fn open(options: ReplayOptions) -> Result<(ReplayStore, Option<Persister>), ActorError> {
    let (mut store, persister) = match &options.dir {
        Some(dir) => {
            let (persister, recovered) =
                Persister::open(dir).map_err(|e| ActorError::Setup(e.to_string()))?;
            let mut store = ReplayStore::recover(
                options.drop_expired,
                options.filter_zero_advantage,
                recovered.counters,
                recovered.groups,
            );
            persister
                .apply(&store.drain_outbox())
                .map_err(|e| ActorError::Setup(e.to_string()))?;
            (store, Some(persister))
        }
        None => (
            ReplayStore::new(options.drop_expired, options.filter_zero_advantage),
            None,
        ),
    };
    store.set_tail_steps(options.tail_batch_candidate_steps);
    Ok((store, persister))
}

pub(super) fn counts(store: &ReplayStore) -> ReplayCounts {
    let c = store.counters();
    ReplayCounts {
        completed: store.count(Bucket::Completed),
        released_total: c.released_total,
        consumed_total: c.consumed_total,
        waiting: store.waiting(),
        trainer_waiting: false,
    }
}

pub(super) fn recovery_of(store: &ReplayStore) -> Recovery {
    let c = store.counters();
    // A token can carry a version the store never heard published (the process died between
    // the publish and its relay here); the run continues past it, never below.
    let newest_token = Bucket::ALL
        .iter()
        .filter(|b| !store.is_final(**b))
        .flat_map(|b| store.ids(*b))
        .filter_map(|id| store.group(id).and_then(RolloutGroup::max_version))
        .max()
        .unwrap_or_default();
    Recovery {
        admitted_total: c.admitted_total,
        next_group_counter: c.next_group_counter,
        policy_version: PolicyVersion(c.policy_version).max(newest_token),
        counts: counts(store),
        skipped_total: c.skipped_total,
    }
}
