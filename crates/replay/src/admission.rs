//! The two numbers the rollout controller decides with (§4.1), as pure functions.
//!
//! - Admission (AReaL): with current version `v`, a new group may start only while
//!   `admitted < (v + η + 1) · groups_per_step`. Here `admitted` is running + completed + trained
//!   groups since the start of the run: groups that ended filtered, failed or expired-and-dropped
//!   are given back, otherwise a run with many zero-advantage groups could never fill a batch.
//! - Over-sending: the controller keeps `ceil((1 + s) · remaining)` groups in flight, where
//!   `remaining` is what the step being filled still needs.
//! - Demand (Sluice's own, `admission = "demand"`): below the η ceiling, a new group is admitted
//!   only while the groups not yet trained (ready + in flight + waiting to resume) fall short of
//!   [`Pace::demand`]: as many batches as the trainer takes while a group admitted now
//!   generates, at least one. A trainer-bound run then keeps about one batch ahead instead of η;
//!   an engine-bound run, whose groups take many steps, is held by η as before.

/// Whether a new group may be admitted.
pub fn admission_allows(
    admitted: u64,
    version: u64,
    max_version_lag: u64,
    groups_per_step: u32,
) -> bool {
    let bound = version
        .saturating_add(max_version_lag)
        .saturating_add(1)
        .saturating_mul(u64::from(groups_per_step));
    admitted < bound
}

/// Groups the step being filled still needs, given the completed groups waiting in the store.
///
/// A full batch waiting to be taken means the *next* step is being filled, so the answer is never
/// 0: it is `groups_per_step − (completed mod groups_per_step)`.
pub fn remaining_for_step(groups_per_step: u32, completed_ready: u64) -> u64 {
    let b = u64::from(groups_per_step.max(1));
    b - completed_ready % b
}

/// Groups to keep in flight: `ceil((1 + s) · remaining)`. With `s = 0` it is exactly `remaining`.
pub fn in_flight_target(staleness_threshold: f64, remaining: u64) -> u64 {
    let s = if staleness_threshold.is_finite() {
        staleness_threshold.max(0.0)
    } else {
        0.0
    };
    // Multiply in integer-friendly order so that s = 0.2, remaining = 10 gives exactly 12, not 13
    // from 12.000000000000002.
    let target = ((1.0 + s) * remaining as f64 * 1e9).round() / 1e9;
    target.ceil() as u64
}

/// The most groups kept in flight: `max_concurrent_rollouts / group_size` (at least one), or,
/// with `max_concurrent_rollouts = 0` (no cap beyond admission), admission's own bound
/// `(η + 1) · groups_per_step`, read from the live η so that raising it at runtime opens room.
pub fn in_flight_cap(
    max_concurrent_rollouts: u32,
    max_version_lag: u64,
    groups_per_step: u32,
    group_size: u32,
) -> u64 {
    if max_concurrent_rollouts == 0 {
        max_version_lag
            .saturating_add(1)
            .saturating_mul(u64::from(groups_per_step))
    } else {
        u64::from((max_concurrent_rollouts / group_size.max(1)).max(1))
    }
}

/// Headroom of [`Pace::demand`], in batches: groups slower than the average still leave a full
/// batch at the trainer's next take.
const DEMAND_HEADROOM_BATCHES: f64 = 0.25;

/// Weight of a new measurement in [`Pace`]'s moving averages.
const PACE_EMA_ALPHA: f64 = 0.2;

/// How fast the trainer consumes and the engine produces, as moving averages of measured times.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pace {
    /// Seconds a training step computes (skipped steps included), once measured.
    pub train_step_seconds: Option<f64>,
    /// Seconds from a group's start (admission or resume) until it is stored, once measured.
    pub group_seconds: Option<f64>,
}

impl Pace {
    /// Records a training step's compute time.
    pub fn record_train_step(&mut self, seconds: f64) {
        ema(&mut self.train_step_seconds, seconds);
    }

    /// Records how long a group took from its start until it was stored.
    pub fn record_group(&mut self, seconds: f64) {
        ema(&mut self.group_seconds, seconds);
    }

    /// Groups worth keeping between admission and training. The trainer takes a batch every
    /// `t_step`; a group admitted now is ready `t_group` later, so it can join the batch
    /// `k = ceil(t_group / t_step)` takes from now at the earliest. For a batch to be ready at
    /// every take, `k` batches must be on their way: `B · k`, plus a quarter batch of headroom for
    /// groups slower than the average. Keeping more only makes the data older; `k ≥ 1` always.
    /// Until both times are measured (the first step of a run), `k` is taken as 1.
    pub fn demand(&self, groups_per_step: u32) -> u64 {
        let b = f64::from(groups_per_step.max(1));
        let batches = match (self.group_seconds, self.train_step_seconds) {
            (Some(group), Some(step)) if step > 0.0 => (group / step).ceil().max(1.0),
            (Some(_), Some(_)) => f64::INFINITY,
            _ => 1.0,
        };
        let groups = (b * (batches + DEMAND_HEADROOM_BATCHES)).ceil();
        if groups.is_finite() && groups < u64::MAX as f64 {
            groups as u64
        } else {
            u64::MAX
        }
    }
}

fn ema(slot: &mut Option<f64>, x: f64) {
    if !x.is_finite() || x < 0.0 {
        return;
    }
    *slot = Some(match *slot {
        Some(old) => old + PACE_EMA_ALPHA * (x - old),
        None => x,
    });
}

/// Whether demand-aware admission lets one more group in, given the groups admitted and not yet
/// trained (`pending`: ready, in flight, waiting to resume). The η bound is checked separately
/// ([`admission_allows`]) and always applies.
pub fn demand_allows(pending: u64, demand: u64) -> bool {
    pending < demand
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_bound_is_exclusive() {
        // v = 0, η = 1, B = 4: at most 8 groups before the first publish.
        assert!(admission_allows(7, 0, 1, 4));
        assert!(!admission_allows(8, 0, 1, 4));
        // η = 0 is synchronous: one batch per version.
        assert!(!admission_allows(4, 0, 0, 4));
        assert!(admission_allows(4, 1, 0, 4));
    }

    #[test]
    fn over_sending_rounds_up_and_is_exact_at_zero() {
        assert_eq!(in_flight_target(0.0, 7), 7);
        assert_eq!(in_flight_target(0.2, 10), 12);
        assert_eq!(in_flight_target(0.2, 8), 10);
        assert_eq!(in_flight_target(0.2, 1), 2);
        assert_eq!(in_flight_target(0.0, 0), 0);
    }

    #[test]
    fn remaining_counts_the_step_being_filled() {
        assert_eq!(remaining_for_step(8, 0), 8);
        assert_eq!(remaining_for_step(8, 5), 3);
        assert_eq!(remaining_for_step(8, 8), 8);
        assert_eq!(remaining_for_step(8, 9), 7);
    }

    #[test]
    fn demand_is_one_batch_plus_what_the_trainer_eats_meanwhile() {
        let mut pace = Pace::default();
        assert_eq!(pace.demand(8), 10, "unmeasured: one batch and the headroom");
        pace.record_train_step(1.0);
        assert_eq!(pace.demand(8), 10);
        pace.record_group(0.25);
        // Trainer-bound: a group admitted now is ready for the next take.
        assert_eq!(pace.demand(8), 10);
        assert!(demand_allows(9, pace.demand(8)));
        assert!(!demand_allows(10, pace.demand(8)));
        // A group takes 1.5 steps: it makes the take after next, so two batches are under way.
        pace.record_group(4.0);
        assert!((pace.group_seconds.unwrap() - 1.0).abs() < 1e-12);
        pace.record_group(3.0);
        assert!(pace.group_seconds.unwrap() > 1.0);
        assert_eq!(pace.demand(8), 18);
        // Engine-bound: a group takes 10 steps, demand is past any η ceiling.
        let slow = Pace {
            train_step_seconds: Some(0.1),
            group_seconds: Some(1.0),
        };
        assert_eq!(slow.demand(8), 82);
        // A trainer that takes no time at all: only η bounds admission.
        let instant = Pace {
            train_step_seconds: Some(0.0),
            group_seconds: Some(1.0),
        };
        assert_eq!(instant.demand(4), u64::MAX);
    }

    #[test]
    fn pace_averages_and_ignores_nonsense() {
        let mut pace = Pace::default();
        pace.record_group(1.0);
        pace.record_group(2.0);
        assert!((pace.group_seconds.unwrap() - 1.2).abs() < 1e-12);
        pace.record_group(f64::NAN);
        pace.record_group(-1.0);
        assert!((pace.group_seconds.unwrap() - 1.2).abs() < 1e-12);
    }
}
