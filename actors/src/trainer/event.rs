//! How a trained step leaves the trainer: one [`StepEvent`], built once per step and published
//! once by the [`StepPublisher`], which hands the same `Arc` to every reader.
//!
//! Readers and what happens when one lags:
//! - the controller's sink (its mailbox): every step, never blocks the trainer (one message per
//!   step, read at once);
//! - the step feed ([`StepFeed`], the run monitor and through it `metrics.jsonl`): every step in
//!   order, bounded by [`STEP_FEED_CAPACITY`]; a reader that falls that far behind holds the
//!   trainer (back-pressure, never a lost step); a reader that is gone is ignored;
//! - the status watch ([`TrainerStatus`], the admin view, the periodic checkpoint): the newest
//!   totals only, a busy reader sees one change and reads the latest;
//! - the run's events ([`RunEvents`]): a wake-up for the node's watchers, no payload.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use sluice_core::{PolicyVersion, SituationAdvantages, WeightSnapshot};
use tokio::sync::{mpsc, watch};

use crate::Sink;
use crate::events::RunEvents;

/// Steps the feed holds before the trainer waits for its reader (far more than a run monitor
/// falls behind while it evaluates).
pub const STEP_FEED_CAPACITY: usize = 1024;

/// The trainer's step feed: every completed step, in order (see [`StepEvent`]). Bounded: a
/// reader that falls [`STEP_FEED_CAPACITY`] steps behind holds the trainer; a dropped reader is
/// ignored.
pub type StepFeed = mpsc::Sender<Arc<StepEvent>>;

/// One completed training step: the only report of it the trainer makes.
#[derive(Debug, Clone)]
pub struct StepEvent {
    /// The run's step number (restarts included; the first step of a fresh run is 1).
    pub step: u64,
    /// Version the step trained (the weights it started from).
    pub version: PolicyVersion,
    /// Mean final reward of the batch's rollouts.
    pub reward_mean: f64,
    /// Mean version lag of the batch's completion tokens against `version`.
    pub version_lag_mean: f64,
    /// Mean of each named reward component over the batch's rollouts that carry it.
    pub reward_components: BTreeMap<String, f64>,
    /// The advantages the step's texts got, per (domain, situation label).
    pub situations: SituationAdvantages,
    /// Groups of each domain in the batch (the trained domain mix).
    pub domain_groups: BTreeMap<String, u64>,
    /// Completion tokens trained.
    pub trained_tokens: u64,
    /// Seconds the step computed (the demand-aware admission's trainer pace).
    pub seconds: f64,
    /// The backend's own metrics (loss, clip fraction, entropy, …).
    pub metrics: BTreeMap<String, f64>,
    /// The weights it published; `None` when the step was skipped (every advantage zero).
    pub weights: Option<WeightSnapshot>,
}

/// A point-in-time view of the trainer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TrainerStatus {
    /// Version of the weights the next step starts from.
    pub version: PolicyVersion,
    /// Steps the run has taken (restarts included).
    pub steps: u64,
    /// Groups trained on (the run's, restarts included).
    pub trained_groups: u64,
    /// Steps that published nothing (every advantage zero); their groups were released from
    /// admission.
    pub skipped_steps: u64,
    /// Groups consumed by a step that failed (their training is lost; they are never retried).
    pub failed_groups: u64,
    /// Rollouts trained on.
    pub trained_samples: u64,
    /// Completion tokens trained on.
    pub trained_tokens: u64,
    /// Sum of token lags (mean lag = this / tokens).
    pub lag_sum: u64,
    /// Largest token lag trained on.
    pub max_lag: u64,
    /// Tokens trained whose lag exceeded η at training time (must stay 0).
    pub lag_violations: u64,
    /// Groups trained a second time (must stay 0).
    pub duplicate_groups: u64,
    /// Seconds spent waiting for a batch.
    pub idle_seconds: f64,
    /// Seconds since the trainer started.
    pub uptime_seconds: f64,
    /// The step budget is used up.
    pub done: bool,
    /// The last step's error, if training failed.
    pub error: Option<String>,
}

impl TrainerStatus {
    /// Mean version lag of trained tokens.
    pub fn mean_lag(&self) -> f64 {
        if self.trained_tokens == 0 {
            0.0
        } else {
            self.lag_sum as f64 / self.trained_tokens as f64
        }
    }

    /// Fraction of wall time spent waiting for data.
    pub fn idle_ratio(&self) -> f64 {
        if self.uptime_seconds > 0.0 {
            (self.idle_seconds / self.uptime_seconds).min(1.0)
        } else {
            0.0
        }
    }
}

/// The trainer thread's one way out (see the module docs for each reader's lag policy).
pub(super) struct StepPublisher {
    /// The newest status (shared with the thread's panic guard, which records the panic).
    status: Arc<watch::Sender<TrainerStatus>>,
    /// The controller: pace and weights to relay.
    controller: Sink<Arc<StepEvent>>,
    /// The run monitor, when one follows the run.
    feed: Option<StepFeed>,
    /// The node's watchers.
    events: RunEvents,
}

impl StepPublisher {
    /// A publisher starting from `status`; returns the status channel too (the handle's
    /// receiver is subscribed from it).
    pub(super) fn new(
        status: TrainerStatus,
        controller: Sink<Arc<StepEvent>>,
        feed: Option<StepFeed>,
        events: RunEvents,
    ) -> Self {
        Self {
            status: Arc::new(watch::channel(status).0),
            controller,
            feed,
            events,
        }
    }

    /// The status channel (the handle's view, the panic guard's way to record a panic).
    pub(super) fn status_channel(&self) -> Arc<watch::Sender<TrainerStatus>> {
        Arc::clone(&self.status)
    }

    /// The run's events (announced by the panic guard too).
    pub(super) fn events(&self) -> RunEvents {
        self.events.clone()
    }

    /// The status changed without a step (idle time, a failure, the end): readers see it and
    /// the node's watchers wake when `announce`.
    pub(super) fn status(&self, status: &TrainerStatus, announce: bool) {
        self.status.send_replace(status.clone());
        if announce {
            self.events.announce();
        }
    }

    /// A step was trained: the status first (so a reader woken by the step sees its totals),
    /// then the event to the feed and the controller, then the wake-up.
    pub(super) fn step(&self, status: &TrainerStatus, event: StepEvent) {
        self.status.send_replace(status.clone());
        let event = Arc::new(event);
        if let Some(feed) = &self.feed {
            // The thread is the trainer's own: waiting here is the feed's back-pressure. A
            // reader that is gone (the run ended) is not an error.
            let _ = feed.blocking_send(Arc::clone(&event));
        }
        (self.controller)(event);
        self.events.announce();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    fn event(step: u64) -> StepEvent {
        StepEvent {
            step,
            version: PolicyVersion(step - 1),
            reward_mean: 0.0,
            version_lag_mean: 0.0,
            reward_components: BTreeMap::new(),
            situations: SituationAdvantages::new(),
            domain_groups: BTreeMap::new(),
            trained_tokens: 0,
            seconds: 0.0,
            metrics: BTreeMap::new(),
            weights: None,
        }
    }

    /// A feed reader slower than the trainer holds it instead of losing steps: with a feed of 2
    /// and 6 steps, the reader gets all 6 in order, the same `Arc`s the controller got; the
    /// status watch shows the newest totals and every step announced.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_feed_reader_loses_no_step_and_shares_the_event() {
        let seen: Arc<Mutex<Vec<Arc<StepEvent>>>> = Arc::default();
        let controller: Sink<Arc<StepEvent>> = {
            let seen = Arc::clone(&seen);
            Arc::new(move |e| seen.lock().unwrap().push(e))
        };
        let (feed, mut rx) = mpsc::channel(2);
        let events = RunEvents::default();
        let announced = events.subscribe();
        let publisher = StepPublisher::new(
            TrainerStatus::default(),
            controller,
            Some(feed),
            events.clone(),
        );
        let status = publisher.status_channel().subscribe();
        let trainer = std::thread::spawn(move || {
            let mut s = TrainerStatus::default();
            for step in 1..=6 {
                s.steps = step;
                publisher.step(&s, event(step));
            }
        });
        let mut got = Vec::new();
        while let Some(e) = rx.recv().await {
            // Slower than the trainer: the feed fills and the trainer waits.
            tokio::task::yield_now().await;
            got.push(e);
        }
        tokio::task::spawn_blocking(move || trainer.join().unwrap())
            .await
            .unwrap();
        assert_eq!(
            got.iter().map(|e| e.step).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5, 6]
        );
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 6, "the controller hears every step");
        assert!(got.iter().zip(seen.iter()).all(|(a, b)| Arc::ptr_eq(a, b)));
        assert_eq!(status.borrow().steps, 6);
        assert_eq!(announced.borrow().seq, 6);
    }
}
