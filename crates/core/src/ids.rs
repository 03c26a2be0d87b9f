//! Identifiers that stay unique across runs, nodes and engine replicas, and the policy version.
//!
//! A group id is `run/node/counter`: the run id is derived from the run's name (so a restarted run
//! keeps its ids), the node id is assigned by the launcher, and the counter is a per-node atomic that
//! the replay store persists. Two nodes never share a `(run, node)` pair, so no coordination is needed
//! to mint ids. A rollout is `group/index`; an engine request adds the turn and the attempt, so a
//! resumed or regenerated turn never reuses the id of the request it replaces.
//!
//! All ids serialize as their display strings: they appear in JSON, logs and the admin API, and a
//! human must be able to paste them back.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why an id string could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} `{input}`: expected {expected}")]
pub struct IdParseError {
    /// Which id type was being parsed.
    pub what: &'static str,
    /// The offending input.
    pub input: String,
    /// The expected shape.
    pub expected: &'static str,
}

/// Identifies one training run. Derived from the run name so that restarting the same run (same
/// `run.name`, same output dir) keeps minting ids in the same namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(pub u64);

impl RunId {
    /// The run id of a run called `name`: 64-bit FNV-1a of the UTF-8 bytes, stable across
    /// platforms and releases (it is persisted in replay stores).
    pub fn from_name(name: &str) -> Self {
        const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        let hash = name
            .bytes()
            .fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME));
        Self(hash)
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl FromStr for RunId {
    type Err = IdParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || IdParseError {
            what: "run id",
            input: s.to_owned(),
            expected: "16 hex digits",
        };
        if s.len() != 16 {
            return Err(err());
        }
        u64::from_str_radix(s, 16).map(Self).map_err(|_| err())
    }
}

/// Identifies one node (process) of a run. Assigned by the launcher; unique within a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Identifies one group (the `group_size` rollouts of one data sample): `run/node/counter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId {
    /// The run that minted it.
    pub run: RunId,
    /// The node that minted it.
    pub node: NodeId,
    /// The node-local counter, increasing in admission order.
    pub counter: u64,
}

impl GroupId {
    /// The id of rollout `index` of this group.
    pub fn rollout(self, index: u32) -> RolloutId {
        RolloutId { group: self, index }
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.run, self.node, self.counter)
    }
}

impl FromStr for GroupId {
    type Err = IdParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || IdParseError {
            what: "group id",
            input: s.to_owned(),
            expected: "`run/node/counter` (16 hex digits / integer / integer)",
        };
        let mut parts = s.split('/');
        let (Some(run), Some(node), Some(counter), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(err());
        };
        Ok(Self {
            run: run.parse().map_err(|_| err())?,
            node: NodeId(node.parse().map_err(|_| err())?),
            counter: counter.parse().map_err(|_| err())?,
        })
    }
}

/// Identifies one rollout: `group/index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RolloutId {
    /// The group it belongs to.
    pub group: GroupId,
    /// Its index within the group, `0..group_size`.
    pub index: u32,
}

impl RolloutId {
    /// The id of the engine request for `turn` of this rollout, on its `attempt`-th submission
    /// (attempts count resumes and regenerations, so ids are never reused).
    pub fn request(self, turn: u32, attempt: u32) -> RequestId {
        RequestId {
            rollout: self,
            turn,
            attempt,
        }
    }
}

impl fmt::Display for RolloutId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.group, self.index)
    }
}

impl FromStr for RolloutId {
    type Err = IdParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || IdParseError {
            what: "rollout id",
            input: s.to_owned(),
            expected: "`run/node/counter/index`",
        };
        let (group, index) = s.rsplit_once('/').ok_or_else(err)?;
        Ok(Self {
            group: group.parse().map_err(|_| err())?,
            index: index.parse().map_err(|_| err())?,
        })
    }
}

/// Identifies one submission to an inference engine: `rollout/t<turn>/a<attempt>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId {
    /// The rollout this request generates for.
    pub rollout: RolloutId,
    /// The turn within the rollout (0-based).
    pub turn: u32,
    /// How many earlier submissions this turn had (resumes and regenerations).
    pub attempt: u32,
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/t{}/a{}", self.rollout, self.turn, self.attempt)
    }
}

impl FromStr for RequestId {
    type Err = IdParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || IdParseError {
            what: "request id",
            input: s.to_owned(),
            expected: "`run/node/counter/index/t<turn>/a<attempt>`",
        };
        let (rest, attempt) = s.rsplit_once('/').ok_or_else(err)?;
        let (rollout, turn) = rest.rsplit_once('/').ok_or_else(err)?;
        let turn = turn.strip_prefix('t').ok_or_else(err)?;
        let attempt = attempt.strip_prefix('a').ok_or_else(err)?;
        Ok(Self {
            rollout: rollout.parse().map_err(|_| err())?,
            turn: turn.parse().map_err(|_| err())?,
            attempt: attempt.parse().map_err(|_| err())?,
        })
    }
}

macro_rules! serde_via_display {
    ($($ty:ty),*) => {$(
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    )*};
}
serde_via_display!(RunId, GroupId, RolloutId, RequestId);

/// Mints group ids for one node of one run. Cheap to share (`&self` methods, one atomic).
#[derive(Debug)]
pub struct GroupIdGenerator {
    run: RunId,
    node: NodeId,
    next: AtomicU64,
}

impl GroupIdGenerator {
    /// A generator whose first id has counter `next` (0 for a new run; the persisted counter when
    /// a run resumes).
    pub fn new(run: RunId, node: NodeId, next: u64) -> Self {
        Self {
            run,
            node,
            next: AtomicU64::new(next),
        }
    }

    /// A fresh id, never returned before by this generator.
    pub fn next_id(&self) -> GroupId {
        // Relaxed is enough: uniqueness comes from the atomic read-modify-write itself.
        let counter = self.next.fetch_add(1, Ordering::Relaxed);
        GroupId {
            run: self.run,
            node: self.node,
            counter,
        }
    }

    /// The counter the next id will carry (what a checkpoint must persist).
    pub fn peek_next(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }
}

/// The version of the policy weights: 0 for the initial weights, +1 each time the trainer publishes.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct PolicyVersion(pub u64);

impl PolicyVersion {
    /// The initial weights.
    pub const INITIAL: Self = Self(0);

    /// The version the next publish produces.
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }

    /// How many versions `self` is behind `current` (0 when it is `current`). A version ahead of
    /// `current` has no lag: it is an error ([`FutureVersion`]), never a silent 0, since no
    /// engine can hold weights the trainer has not published yet, unless they were replaced
    /// behind the head's back.
    pub fn lag_to(self, current: Self) -> Result<u64, FutureVersion> {
        current.0.checked_sub(self.0).ok_or(FutureVersion {
            version: self,
            current,
        })
    }
}

/// A token version ahead of the version it is compared with (see [`PolicyVersion::lag_to`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("version {version} is ahead of {current}, the newest published")]
pub struct FutureVersion {
    /// The version found.
    pub version: PolicyVersion,
    /// The newest version published when it was found.
    pub current: PolicyVersion,
}

impl fmt::Display for PolicyVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(counter: u64) -> GroupId {
        GroupId {
            run: RunId::from_name("demo"),
            node: NodeId(3),
            counter,
        }
    }

    #[test]
    fn run_id_is_stable_and_distinguishes_names() {
        // FNV-1a of the empty string is the offset basis: guards against an accidental change of the
        // hash, which would orphan every persisted replay store.
        assert_eq!(RunId::from_name("").0, 0xcbf2_9ce4_8422_2325);
        assert_eq!(RunId::from_name("a").0, 0xaf63_dc4c_8601_ec8c);
        assert_ne!(RunId::from_name("run-1"), RunId::from_name("run-2"));
    }

    #[test]
    fn ids_display_and_parse_back() {
        let g = group(42);
        assert_eq!(g.to_string().parse::<GroupId>().unwrap(), g);
        let r = g.rollout(7);
        assert_eq!(r.to_string().parse::<RolloutId>().unwrap(), r);
        let q = r.request(2, 5);
        assert!(q.to_string().ends_with("/42/7/t2/a5"), "{q}");
        assert_eq!(q.to_string().parse::<RequestId>().unwrap(), q);
    }

    #[test]
    fn malformed_ids_are_rejected_with_the_input() {
        for bad in [
            "",
            "x/1/2",
            "0123456789abcdef/1",
            "0123456789abcdef/1/2/3",
            "zz",
        ] {
            let err = bad.parse::<GroupId>().unwrap_err();
            assert_eq!(err.input, bad);
        }
        assert!("0123456789abcdef/1/2/3/t1".parse::<RequestId>().is_err());
        assert!("0123456789abcdef/1/2/3/x1/a1".parse::<RequestId>().is_err());
    }

    #[test]
    fn version_lag_saturates() {
        assert_eq!(PolicyVersion(3).lag_to(PolicyVersion(5)), Ok(2));
        assert_eq!(PolicyVersion(5).lag_to(PolicyVersion(5)), Ok(0));
        let e = PolicyVersion(999_999).lag_to(PolicyVersion(3)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "version v999999 is ahead of v3, the newest published"
        );
        assert_eq!(PolicyVersion::INITIAL.next(), PolicyVersion(1));
    }
}
