//! The groups at rest that wait to run again, as the [`super::ReplayStore`] owns them: aborted
//! groups, expired groups waiting to be regenerated, and tail candidates (DESIGN §4.2–4.3). The
//! store is the only place that knows which groups these are; the scheduler sees their counts
//! ([`Waiting`]) and asks for a number of them from a [`Lane`], oldest first.

use serde::Serialize;
use sluice_core::{GroupId, PolicyVersion, RolloutGroup};

use super::ReplayStore;
use crate::bucket::Bucket;
use crate::error::ReplayError;

/// Where a resume is taken from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    /// Aborted groups that are not tail candidates, then expired groups waiting to be
    /// regenerated: what an ordinary decision resumes before admitting fresh samples.
    #[default]
    Resume,
    /// Tail candidates: aborted groups whose rollouts were aborted more than
    /// `tail_batch_candidate_steps` times; only a tail round resumes them.
    Tail,
}

/// Groups waiting to be resumed, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Waiting {
    /// Aborted groups that are not tail candidates.
    pub aborted: u64,
    /// Expired groups waiting to be regenerated (0 when expired groups are dropped).
    pub expired: u64,
    /// Tail candidates.
    pub tail: u64,
}

impl Waiting {
    /// Every waiting group.
    pub fn total(&self) -> u64 {
        self.aborted + self.expired + self.tail
    }

    /// Groups an ordinary decision may resume.
    pub fn resumable(&self) -> u64 {
        self.aborted + self.expired
    }

    /// What is left once `n` more are taken from `lane` (a request on its way to the store):
    /// the resume lane serves aborted groups before expired ones, as the store does.
    pub fn less(mut self, lane: Lane, n: u64) -> Self {
        match lane {
            Lane::Tail => self.tail = self.tail.saturating_sub(n),
            Lane::Resume => {
                let from_aborted = n.min(self.aborted);
                self.aborted -= from_aborted;
                self.expired = self.expired.saturating_sub(n - from_aborted);
            }
        }
        self
    }
}

/// What a request for groups from a lane got.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResumedGroups {
    /// Groups back in flight, ready to submit, oldest first.
    pub groups: Vec<RolloutGroup>,
    /// Groups that were too old to resume and are dropped under the drop policy.
    pub dropped: Vec<GroupId>,
}

impl ReplayStore {
    /// Sets `tail_batch_candidate_steps` (k): an aborted group whose rollouts were aborted more
    /// than k times is a tail candidate; with k = 0 there are none. Returns whether it changed.
    pub fn set_tail_steps(&mut self, k: u32) -> bool {
        std::mem::replace(&mut self.tail_steps, k) != k
    }

    fn is_tail(&self, aborts: u32) -> bool {
        self.tail_steps > 0 && aborts > self.tail_steps
    }

    /// Groups waiting to be resumed, by kind.
    pub fn waiting(&self) -> Waiting {
        let tail = self.by_bucket[Bucket::Aborted.index()]
            .iter()
            .filter(|id| self.entries.get(id).is_some_and(|e| self.is_tail(e.aborts)))
            .count() as u64;
        Waiting {
            aborted: self.count(Bucket::Aborted) - tail,
            expired: if self.is_final(Bucket::Expired) {
                0
            } else {
                self.count(Bucket::Expired)
            },
            tail,
        }
    }

    /// The ids a request for `n` groups from `lane` takes, oldest first.
    pub fn lane_ids(&self, lane: Lane, n: usize) -> Vec<GroupId> {
        let aborted = self.by_bucket[Bucket::Aborted.index()]
            .iter()
            .copied()
            .filter(move |id| {
                let tail = self.entries.get(id).is_some_and(|e| self.is_tail(e.aborts));
                tail == (lane == Lane::Tail)
            });
        match lane {
            Lane::Tail => aborted.take(n).collect(),
            // Expired groups are final (kept nowhere) when the policy drops them.
            Lane::Resume => aborted.chain(self.ids(Bucket::Expired)).take(n).collect(),
        }
    }

    /// Takes up to `n` groups from `lane` back in flight, oldest first, each as
    /// [`ReplayStore::resume`] does.
    pub fn resume_from(
        &mut self,
        lane: Lane,
        n: usize,
        current: PolicyVersion,
        max_version_lag: u64,
        enable_partial_rollout: bool,
    ) -> Result<ResumedGroups, ReplayError> {
        let mut out = ResumedGroups::default();
        for id in self.lane_ids(lane, n) {
            match self.resume(id, current, max_version_lag, enable_partial_rollout)? {
                Some(group) => out.groups.push(group),
                None => out.dropped.push(id),
            }
        }
        Ok(out)
    }
}
