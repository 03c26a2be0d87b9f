//! The two numbers the rollout controller decides with (§4.1), as pure functions.
//!
//! - Admission (AReaL): with current version `v`, a new group may start only while
//!   `admitted < (v + η + 1) · groups_per_step`. Here `admitted` is running + completed + trained
//!   groups since the start of the run: groups that ended filtered, failed or expired-and-dropped
//!   are given back, otherwise a run with many zero-advantage groups could never fill a batch.
//! - Over-sending: the controller keeps `ceil((1 + s) · remaining)` groups in flight, where
//!   `remaining` is what the step being filled still needs.

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
}
