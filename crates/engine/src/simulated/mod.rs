//! Simulated backends: real components that model time instead of computing.
//!
//! - [`SimEngine`]: continuous batching on a dedicated thread; a step costs
//!   `prefill · new_prompt_tokens + a + b · running_sequences` simulated seconds, run in scaled real
//!   time; completion lengths come from a per-domain distribution; tokens carry the version that
//!   produced them; aborts return honest partials.
//! - [`SimTrainer`]: a step costs `c + d · tokens` and publishes `version + 1`.
//!
//! The simulated task (the environment side) lives in `sluice_env::simulated`.
//!
//! Everything is seeded; a run is reproducible up to thread timing.

mod engine;
mod trainer;

pub use engine::{SimEngine, SimEngineParams};
pub use sluice_core::rng::{SplitMix64, mix};
pub use trainer::SimTrainer;

use std::time::Duration;

/// Longest real time one simulated step may take, seconds (about 115 days). The config bounds
/// every simulated cost, but a cost is also multiplied by counts (sequences, tokens) and the
/// time scale; clamping here keeps `Duration` and `Instant` arithmetic from panicking whatever
/// the product.
const MAX_REAL_STEP_SECONDS: f64 = 1e7;

/// The real duration of `seconds` (scaled simulated time): clamped to
/// [`MAX_REAL_STEP_SECONDS`], zero for a negative or NaN value.
pub(crate) fn real_duration(seconds: f64) -> Duration {
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
