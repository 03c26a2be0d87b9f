//! Run events: the actors announce that something a watcher of the run acts on has changed — a
//! step trained, the trainer finished or failed, the controller found no progress, the engine gave
//! up, an actor ended (the node's supervisor actor says which) — and watchers (the node's `Node::wait_done` in `sluice-node`, the binary's run
//! monitor) wake on it and read the status, instead of polling it on a timer.
//!
//! A `tokio::sync::watch` channel carries a sequence number that every announcement bumps, so a
//! watcher that was busy when several events came sees one change and reads the newest status:
//! nothing is queued, nothing grows, and no announcement blocks its sender.

use std::sync::Arc;

use tokio::sync::watch;

/// What the run's watchers last heard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunEvent {
    /// Announcements so far.
    pub seq: u64,
    /// The first actor that ended while the run went on, if one did.
    pub ended: Option<&'static str>,
}

/// Where actors announce changes; clones share the channel. [`RunEvents::default`] makes a fresh
/// channel (an actor started alone, as in tests, announces to nobody in particular).
#[derive(Clone)]
pub struct RunEvents {
    tx: Arc<watch::Sender<RunEvent>>,
}

impl Default for RunEvents {
    fn default() -> Self {
        Self {
            tx: Arc::new(watch::channel(RunEvent::default()).0),
        }
    }
}

impl std::fmt::Debug for RunEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RunEvents")
            .field(&*self.tx.borrow())
            .finish()
    }
}

impl RunEvents {
    /// Something watchers act on changed: they wake and read the status.
    pub fn announce(&self) {
        self.tx.send_modify(|e| e.seq += 1);
    }

    /// `actor` ended; the first one to end is kept.
    pub fn actor_ended(&self, actor: &'static str) {
        self.tx.send_modify(|e| {
            e.seq += 1;
            e.ended.get_or_insert(actor);
        });
    }

    /// The first actor that ended, if any.
    pub fn ended(&self) -> Option<&'static str> {
        self.tx.borrow().ended
    }

    /// A receiver that wakes at the next announcement.
    pub fn subscribe(&self) -> watch::Receiver<RunEvent> {
        self.tx.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_busy_watcher_sees_one_change_and_the_first_actor_that_ended() {
        let events = RunEvents::default();
        let mut rx = events.subscribe();
        events.announce();
        events.announce();
        events.actor_ended("sampler");
        events.actor_ended("trainer");
        rx.changed().await.unwrap();
        let seen = *rx.borrow_and_update();
        assert_eq!(seen.seq, 4);
        assert_eq!(seen.ended, Some("sampler"));
        assert!(!rx.has_changed().unwrap());
    }
}
