//! The per-group state machine of §4.4.
//!
//! ```text
//! Pending → InFlight → Completed → Consumed
//!              │    ↘ Failed | Filtered            (final)
//!              ├──→ Aborted ──→ InFlight           (resume / regenerate)
//!              │       └─────→ Expired
//!              └──→ Expired ──→ InFlight           (regenerate policy) — or stays (drop policy)
//! Completed → Expired                              (fell past η before it was taken)
//! Completed | Aborted | Expired → Cleared          (an operator cleared the store)
//! ```
//! A group's *final* buckets are `Consumed`, `Failed`, `Filtered`, `Cleared` and `Expired` when
//! the expired policy is `drop`; every admitted group ends in exactly one of them or is still
//! live.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where a group stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bucket {
    /// Admitted, not yet submitted to an engine.
    Pending,
    /// Generating (or waiting for its environment).
    InFlight,
    /// Every rollout ended; trainable, waiting for `take_batch`.
    Completed,
    /// Interrupted by a weight update; partial output saved, resumable.
    Aborted,
    /// Its oldest token fell more than η versions behind.
    Expired,
    /// Nothing trainable came out (every rollout failed).
    Failed,
    /// All rewards equal: zero advantage, filtered out.
    Filtered,
    /// Handed to the trainer.
    Consumed,
    /// Thrown away untrained by an operator's clear (`POST /v1/replay/clear`).
    Cleared,
}

impl Bucket {
    /// Every bucket, in state-machine order.
    pub const ALL: [Self; 9] = [
        Self::Pending,
        Self::InFlight,
        Self::Completed,
        Self::Aborted,
        Self::Expired,
        Self::Failed,
        Self::Filtered,
        Self::Consumed,
        Self::Cleared,
    ];

    /// The buckets an operator's clear empties: the groups at rest, trainable or resumable.
    /// Pending and in-flight groups belong to the controller and the engines until they settle.
    pub const CLEARABLE: [Self; 3] = [Self::Completed, Self::Aborted, Self::Expired];

    /// Short stable name (metric label, API).
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::InFlight => "in_flight",
            Self::Completed => "completed",
            Self::Aborted => "aborted",
            Self::Expired => "expired",
            Self::Failed => "failed",
            Self::Filtered => "filtered",
            Self::Consumed => "consumed",
            Self::Cleared => "cleared",
        }
    }

    /// Index into per-bucket arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether the state machine allows `self → to`.
    pub fn can_move_to(self, to: Self) -> bool {
        use Bucket::*;
        matches!(
            (self, to),
            (Pending, InFlight)
                | (InFlight, Completed | Aborted | Expired | Failed | Filtered)
                | (Aborted, InFlight | Expired)
                | (Expired, InFlight)
                | (Completed, Consumed | Expired)
                | (Completed | Aborted | Expired, Cleared)
        )
    }

    /// The group's generated tokens must survive a crash in this bucket.
    pub fn is_persisted(self) -> bool {
        matches!(
            self,
            Self::Pending | Self::InFlight | Self::Completed | Self::Aborted | Self::Expired
        )
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_label())
    }
}

impl FromStr for Bucket {
    type Err = String;

    /// A bucket from its label ([`Bucket::as_label`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|b| b.as_label() == s)
            .ok_or_else(|| format!("unknown bucket `{s}`"))
    }
}

/// Counts per bucket (`/v1/status`'s `replay.buckets`; written by label in JSON).
pub type BucketCounts = std::collections::BTreeMap<Bucket, u64>;

/// A move of a group from one bucket to another: the key of the transition counters, written
/// `from->to` in JSON and in the persisted counters (the format before the key was typed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Transition {
    /// The bucket the group left.
    pub from: Bucket,
    /// The bucket it entered.
    pub to: Bucket,
}

impl fmt::Display for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}->{}", self.from, self.to)
    }
}

impl FromStr for Transition {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (from, to) = s
            .split_once("->")
            .ok_or_else(|| format!("transition `{s}` is not written `from->to`"))?;
        Ok(Self {
            from: from.parse()?,
            to: to.parse()?,
        })
    }
}

impl Serialize for Transition {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Transition {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumed_is_reached_only_from_completed() {
        for b in Bucket::ALL {
            assert_eq!(
                b.can_move_to(Bucket::Consumed),
                b == Bucket::Completed,
                "{b}"
            );
        }
        for b in Bucket::ALL {
            assert!(!Bucket::Consumed.can_move_to(b), "consumed is final");
            assert!(!Bucket::Filtered.can_move_to(b), "filtered is final");
            assert!(!Bucket::Failed.can_move_to(b), "failed is final");
            assert!(!Bucket::Cleared.can_move_to(b), "cleared is final");
        }
    }

    #[test]
    fn only_groups_at_rest_can_be_cleared() {
        for b in Bucket::ALL {
            assert_eq!(
                b.can_move_to(Bucket::Cleared),
                Bucket::CLEARABLE.contains(&b),
                "{b}"
            );
        }
    }

    #[test]
    fn transitions_read_back_what_they_write() {
        for from in Bucket::ALL {
            for to in Bucket::ALL {
                let t = Transition { from, to };
                assert_eq!(t.to_string().parse::<Transition>(), Ok(t));
                let json = serde_json::to_string(&t).unwrap();
                assert_eq!(json, format!("\"{from}->{to}\""));
                assert_eq!(serde_json::from_str::<Transition>(&json).unwrap(), t);
            }
        }
        for bad in [
            "completed",
            "completed->",
            "done->consumed",
            "completed->->consumed",
        ] {
            assert!(bad.parse::<Transition>().is_err(), "{bad}");
        }
    }

    #[test]
    fn labels_are_distinct() {
        let labels: std::collections::HashSet<_> =
            Bucket::ALL.iter().map(|b| b.as_label()).collect();
        assert_eq!(labels.len(), Bucket::ALL.len());
    }
}
