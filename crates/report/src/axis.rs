//! Axis ranges with "nice" ticks (1, 2 or 5 × 10^k apart) and their labels.

/// A numeric axis: the range it spans and where its ticks are.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Axis {
    /// Value at the start of the axis.
    pub lo: f64,
    /// Value at the end of the axis.
    pub hi: f64,
    /// Distance between ticks.
    pub step: f64,
    /// Tick values from `lo` to `hi`, both included.
    pub ticks: Vec<f64>,
}

impl Axis {
    /// An axis covering [lo, hi] with about `target` intervals, widened to whole ticks.
    /// `min_step` keeps ticks apart, e.g. 1 for training steps. A range that is empty or not
    /// finite becomes a small one around its value (or [0, 1]).
    pub fn nice(lo: f64, hi: f64, target: usize, min_step: f64) -> Self {
        let (mut lo, mut hi) = if lo.is_finite() && hi.is_finite() && lo <= hi {
            (lo, hi)
        } else {
            (0.0, 1.0)
        };
        if hi - lo <= f64::EPSILON * lo.abs().max(1.0) {
            let pad = (lo.abs() * 0.1).max(min_step).max(0.05);
            // Steps and seconds are never negative: their axis should not be either.
            lo = if lo >= 0.0 {
                (lo - pad).max(0.0)
            } else {
                lo - pad
            };
            hi += pad;
        }
        let step = nice_step((hi - lo) / target.max(1) as f64).max(min_step);
        // A small slack absorbs rounding when a bound already sits on a tick.
        let first = (lo / step + 1e-9).floor();
        let last = (hi / step - 1e-9).ceil();
        Self::from_ticks(first as i64, last as i64, step)
    }

    /// An axis from `lo` to `hi` with ticks every `step` (the caller picks values that divide).
    pub fn fixed(lo: f64, hi: f64, step: f64) -> Self {
        Self::from_ticks((lo / step).round() as i64, (hi / step).round() as i64, step)
    }

    fn from_ticks(first: i64, last: i64, step: f64) -> Self {
        let last = last.max(first + 1);
        let ticks: Vec<f64> = (first..=last).map(|k| k as f64 * step).collect();
        Self {
            lo: ticks[0],
            hi: ticks[ticks.len() - 1],
            step,
            ticks,
        }
    }

    /// Where `value` falls along the axis: 0 at `lo`, 1 at `hi`.
    pub fn fraction(&self, value: f64) -> f64 {
        (value - self.lo) / (self.hi - self.lo)
    }

    /// The label of a tick: as many decimals as the step needs, thousands as `k` when large.
    pub fn label(&self, value: f64) -> String {
        let (value, step, suffix) =
            if self.hi.abs().max(self.lo.abs()) >= 10_000.0 && self.step >= 1000.0 {
                (value / 1000.0, self.step / 1000.0, "k")
            } else {
                (value, self.step, "")
            };
        let decimals = if step >= 1.0 {
            0
        } else {
            (-step.log10().floor()).clamp(0.0, 9.0) as usize
        };
        let text = format!("{value:.decimals$}");
        // Rounding can leave "-0" or "-0.0"; a tick at zero is just zero.
        let text = if text.starts_with('-') && text[1..].chars().all(|c| c == '0' || c == '.') {
            text[1..].to_string()
        } else {
            text
        };
        format!("{text}{suffix}")
    }
}

/// The smallest of 1, 2, 5 × 10^k that is at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powi(raw.log10().floor() as i32);
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * magnitude)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_steps_are_one_two_five() {
        assert_eq!(nice_step(0.3), 0.5);
        assert_eq!(nice_step(1.0), 1.0);
        assert_eq!(nice_step(1.1), 2.0);
        assert_eq!(nice_step(37.0), 50.0);
        assert_eq!(nice_step(0.0), 1.0);
    }

    #[test]
    fn nice_axis_covers_the_data_with_whole_ticks() {
        let axis = Axis::nice(1.0, 137.0, 5, 1.0);
        assert_eq!((axis.lo, axis.hi, axis.step), (0.0, 150.0, 50.0));
        assert_eq!(axis.ticks, vec![0.0, 50.0, 100.0, 150.0]);
        assert_eq!(axis.fraction(75.0), 0.5);
    }

    #[test]
    fn degenerate_ranges_get_room() {
        let single = Axis::nice(5.0, 5.0, 5, 1.0);
        assert!(single.lo < 5.0 && single.hi > 5.0, "{single:?}");
        assert!(single.step >= 1.0);
        let zero = Axis::nice(0.0, 0.0, 5, 1.0);
        assert_eq!((zero.lo, zero.hi), (0.0, 1.0));
        let nan = Axis::nice(f64::NAN, f64::NAN, 5, 0.0);
        assert_eq!((nan.lo, nan.hi), (0.0, 1.0));
    }

    #[test]
    fn labels_use_the_decimals_the_step_needs() {
        let axis = Axis::nice(-0.3, 0.9, 6, 0.0);
        assert_eq!(axis.step, 0.2);
        let labels: Vec<String> = axis.ticks.iter().map(|&t| axis.label(t)).collect();
        assert_eq!(
            labels,
            ["-0.4", "-0.2", "0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]
        );
        let big = Axis::nice(0.0, 40_000.0, 4, 1.0);
        assert_eq!(big.label(20_000.0), "20k");
    }
}
