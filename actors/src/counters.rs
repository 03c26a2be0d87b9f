//! The four counters every actor reports (`DESIGN.md` §8), in a module of their own so that every
//! actor can count without depending on the metrics plumbing of `sluice_node::telemetry`, which in
//! turn reads the engine.

use metrics::Counter;
use sluice_core::metrics as m;

/// Every value of the `actor` label: the actors of `DESIGN.md` §3.
pub const ACTORS: [&str; 6] = [
    "sampler",
    "controller",
    "engine",
    "env",
    "replay",
    "trainer",
];

/// The four counters every actor reports (`DESIGN.md` §8, after vector's component contract):
/// messages received, sent downstream and dropped, and errors by stable kind. Each actor holds one
/// in its state; handles are resolved once, so counting costs an atomic add. Cloning is cheap
/// (an actor whose work runs on a thread, or whose handle routes messages, shares it).
#[derive(Clone)]
pub struct ActorCounters {
    actor: &'static str,
    received: Counter,
    sent: Counter,
    dropped: Counter,
}

impl ActorCounters {
    /// Counters of `actor`, one of [`ACTORS`] (a fixed set keeps the label bounded).
    pub fn new(actor: &'static str) -> Self {
        debug_assert!(ACTORS.contains(&actor), "unknown actor label `{actor}`");
        Self {
            actor,
            received: metrics::counter!(m::ACTOR_RECEIVED, "actor" => actor),
            sent: metrics::counter!(m::ACTOR_SENT, "actor" => actor),
            dropped: metrics::counter!(m::ACTOR_DROPPED, "actor" => actor),
        }
    }

    /// `n` messages were handled.
    pub fn received(&self, n: u64) {
        self.received.increment(n);
    }

    /// `n` messages went downstream.
    pub fn sent(&self, n: u64) {
        self.sent.increment(n);
    }

    /// `n` messages were thrown away (stale results, a peer that is gone, a full queue).
    pub fn dropped(&self, n: u64) {
        self.dropped.increment(n);
    }

    /// One error of a stable `kind` (an error type's `kind()`, never a message). Errors are rare,
    /// so this handle is looked up per call (its `kind` label is only known here).
    pub fn error(&self, kind: &'static str) {
        metrics::counter!(m::ACTOR_ERRORS, "actor" => self.actor, "kind" => kind).increment(1);
    }
}
