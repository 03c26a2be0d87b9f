//! Opening the store (recovered from redb when it is persisted) and what is read off it: the
//! counts every notice carries, and the [`Recovery`] the controller continues a run from.

use sluice_core::{GroupId, PolicyVersion, RolloutGroup};
use sluice_replay::{Bucket, Persister, ReplayStore};

use super::{Recovery, ReplayCounts, ReplayOptions};
use crate::ActorError;

pub(super) fn open(options: ReplayOptions) -> Result<(ReplayStore, Option<Persister>), ActorError> {
    match &options.dir {
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
            Ok((store, Some(persister)))
        }
        None => Ok((
            ReplayStore::new(options.drop_expired, options.filter_zero_advantage),
            None,
        )),
    }
}

pub(super) fn counts(store: &ReplayStore) -> ReplayCounts {
    let c = store.counters();
    ReplayCounts {
        completed: store.count(Bucket::Completed),
        released_total: c.released_total,
        consumed_total: c.consumed_total,
        trainer_waiting: false,
    }
}

pub(super) fn recovery_of(store: &ReplayStore) -> Recovery {
    let c = store.counters();
    let max_aborts = |id: GroupId| {
        store.group(id).map_or(0, |g| {
            g.rollouts.iter().map(|r| r.abort_count).max().unwrap_or(0)
        })
    };
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
        aborted: store
            .ids(Bucket::Aborted)
            .map(|id| (id, max_aborts(id)))
            .collect(),
        expired: if store.is_final(Bucket::Expired) {
            Vec::new()
        } else {
            store.ids(Bucket::Expired).collect()
        },
        counts: counts(store),
    }
}
