//! What the simulated backends share: turning scaled simulated seconds into a real duration.

use std::time::Duration;

/// Longest real time one simulated step may take, seconds (about 115 days). The config bounds
/// every simulated cost, but a cost is also multiplied by counts (sequences, tokens) and the
/// time scale; clamping here keeps `Duration` and `Instant` arithmetic from panicking whatever
/// the product.
const MAX_REAL_STEP_SECONDS: f64 = 1e7;

/// The real duration of `seconds` (scaled simulated time): clamped to
/// `MAX_REAL_STEP_SECONDS` (10⁷ s), zero for a negative or NaN value.
pub fn real_duration(seconds: f64) -> Duration {
    if seconds.is_nan() {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(seconds.min(MAX_REAL_STEP_SECONDS)).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_durations_never_panic() {
        assert_eq!(real_duration(1.5), Duration::from_millis(1500));
        assert_eq!(real_duration(1e300), Duration::from_secs(10_000_000));
        assert_eq!(
            real_duration(f64::INFINITY),
            Duration::from_secs(10_000_000)
        );
        assert_eq!(real_duration(f64::NAN), Duration::ZERO);
        assert_eq!(real_duration(-1.0), Duration::ZERO);
    }
}
