//! Supervision policy as pure logic (no actors, no clocks of its own): the restart [`Backoff`]
//! and the progress [`Watchdog`]. The engine actor applies both to its replicas; the node applies
//! the restart policy table in the node (`sluice_node::node`).
//!
//! Both take `now` as an argument, so tests drive them with made-up instants. The instants are
//! tokio's ([`tokio::time::Instant`]): the engine actor reads the runtime's clock, so a test that
//! pauses it (`#[tokio::test(start_paused = true)]`) moves the backoff, the watchdog and the
//! actor's timers together instead of sleeping them out.

use std::time::Duration;

use sluice_config::SupervisionConfig;
use tokio::time::Instant;

/// Exponential restart backoff: the `k`-th consecutive failure waits
/// `min(initial · 2^(k−1), max)`. An incarnation that stayed up at least `max` counts as healthy,
/// so its next failure starts from `initial` again.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    /// Consecutive failures (reset by a healthy incarnation).
    failures: u32,
    /// When the current incarnation started.
    started: Option<Instant>,
}

impl Backoff {
    /// A policy with these bounds (`max ≥ initial`).
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            failures: 0,
            started: None,
        }
    }

    /// The policy of `[supervision]`.
    pub fn from_config(config: &SupervisionConfig) -> Self {
        Self::new(config.restart_backoff_initial, config.restart_backoff_max)
    }

    /// Records that the supervised thing (re)started at `now`.
    pub fn started(&mut self, now: Instant) {
        self.started = Some(now);
    }

    /// Records a failure at `now` and returns how long to wait before the restart.
    pub fn failed(&mut self, now: Instant) -> Duration {
        let healthy = self
            .started
            .is_some_and(|s| now.saturating_duration_since(s) >= self.max);
        if healthy {
            self.failures = 0;
        }
        self.failures = self.failures.saturating_add(1);
        self.started = None;
        let doublings = (self.failures - 1).min(30);
        self.initial.saturating_mul(1u32 << doublings).min(self.max)
    }

    /// Consecutive failures so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// Notices a worker that has work but makes no progress for `limit`.
///
/// The owner reports work and progress; [`Watchdog::check`] answers whether the limit passed
/// since the last progress while work was outstanding. Idle time never counts.
#[derive(Debug, Clone)]
pub struct Watchdog {
    limit: Duration,
    /// Last progress counter seen (e.g. tokens generated).
    counter: u64,
    /// Since when the worker has had work without progress.
    stalled_since: Option<Instant>,
}

impl Watchdog {
    /// A watchdog that fires after `limit` without progress.
    pub fn new(limit: Duration) -> Self {
        Self {
            limit,
            counter: 0,
            stalled_since: None,
        }
    }

    /// Forgets the past (a fresh incarnation whose progress counter starts at `counter`).
    pub fn reset(&mut self, counter: u64) {
        self.counter = counter;
        self.stalled_since = None;
    }

    /// Something finished: that is progress too.
    pub fn progressed(&mut self) {
        self.stalled_since = None;
    }

    /// One observation: `busy` (work outstanding) and the progress `counter`. Returns `true` when
    /// the worker has been stuck for at least the limit.
    pub fn check(&mut self, now: Instant, busy: bool, counter: u64) -> bool {
        if counter != self.counter || !busy {
            self.counter = counter;
            self.stalled_since = None;
            return false;
        }
        let since = *self.stalled_since.get_or_insert(now);
        now.saturating_duration_since(since) >= self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets_after_a_healthy_run() {
        let t0 = Instant::now();
        let mut b = Backoff::new(100 * MS, 800 * MS);
        b.started(t0);
        let delays: Vec<Duration> = (0..6)
            .map(|i| {
                let d = b.failed(t0 + i * MS);
                b.started(t0 + i * MS);
                d
            })
            .collect();
        assert_eq!(
            delays,
            [100, 200, 400, 800, 800, 800].map(|ms| ms * MS).to_vec()
        );
        assert_eq!(b.failures(), 6);
        // Up for the whole cap: healthy again.
        b.started(t0);
        assert_eq!(b.failed(t0 + 800 * MS), 100 * MS);
        assert_eq!(b.failures(), 1);
    }

    #[test]
    fn watchdog_fires_only_when_busy_without_progress_for_the_limit() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(100 * MS);
        w.reset(0);
        assert!(!w.check(t0, true, 0));
        assert!(!w.check(t0 + 50 * MS, true, 0));
        // Progress resets the clock.
        assert!(!w.check(t0 + 60 * MS, true, 5));
        assert!(!w.check(t0 + 120 * MS, true, 5));
        assert!(!w.check(t0 + 200 * MS, true, 5));
        assert!(w.check(t0 + 220 * MS, true, 5));
        // Idle never counts.
        w.reset(5);
        assert!(!w.check(t0, false, 5));
        assert!(!w.check(t0 + 1000 * MS, false, 5));
        assert!(!w.check(t0 + 1001 * MS, true, 5));
        w.progressed();
        assert!(!w.check(t0 + 1050 * MS, true, 5));
        assert!(!w.check(t0 + 1100 * MS, true, 5));
        assert!(w.check(t0 + 1150 * MS, true, 5));
    }
}
