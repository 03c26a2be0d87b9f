//! The seeded randomness every crate shares: SplitMix64 (Steele, Lea, Flood 2014) as a generator
//! ([`SplitMix64`]), as one step over a state ([`splitmix64`]) and as a hash of one word
//! ([`splitmix`]); [`mix`] folds several words into one seed; the simulated completion lengths are
//! drawn with it. Own code, not a dependency, so that seeds mean the same thing across releases.

use crate::config::LengthDistribution;

/// Mixes several words into one seed (order matters).
pub fn mix(words: &[u64]) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64;
    for w in words {
        h = SplitMix64::new(h ^ w).next_u64();
    }
    h
}

/// One SplitMix64 step: advances `state` by the golden gamma and returns the mixed value.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64 as a hash of one word: the value of one step from state `x`.
pub fn splitmix(x: u64) -> u64 {
    let mut state = x;
    splitmix64(&mut state)
}

/// SplitMix64 as a generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        splitmix64(&mut self.0)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn next_normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A completion length from `dist`, clamped to `[1, cap]`.
    pub fn length(&mut self, dist: &LengthDistribution, cap: u32) -> u32 {
        let raw = match *dist {
            LengthDistribution::Fixed { tokens } => f64::from(tokens),
            LengthDistribution::Uniform { min, max } => {
                f64::from(min) + (self.next_u64() % u64::from(max - min + 1)) as f64
            }
            LengthDistribution::Lognormal { median, sigma } => {
                median * (sigma * self.next_normal()).exp()
            }
        };
        (raw.round() as u64).clamp(1, u64::from(cap.max(1))) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_the_reference_stream() {
        // SplitMix64 seeded with 0: the first outputs of the reference implementation.
        let mut g = SplitMix64::new(0);
        assert_eq!(g.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(g.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(splitmix(0), 0xe220_a839_7b1d_cdaf);
        let mut state = 0;
        assert_eq!(splitmix64(&mut state), splitmix(0));
        assert_eq!(state, 0x9e37_79b9_7f4a_7c15);
    }

    #[test]
    fn lognormal_has_a_long_tail() {
        let mut rng = SplitMix64::new(7);
        let dist = LengthDistribution::Lognormal {
            median: 100.0,
            sigma: 1.0,
        };
        let mut xs: Vec<u32> = (0..20_000).map(|_| rng.length(&dist, 1_000_000)).collect();
        xs.sort_unstable();
        let (p50, p99) = (xs[xs.len() / 2], xs[xs.len() * 99 / 100]);
        assert!((90..=110).contains(&p50), "median {p50}");
        // exp(2.326) ≈ 10.2: σ = 1 puts p99 at about ten times the median.
        assert!(p99 >= 9 * p50, "p99 {p99} vs median {p50}");
    }

    #[test]
    fn lengths_respect_bounds_and_seeds() {
        let mut a = SplitMix64::new(1);
        let mut b = SplitMix64::new(1);
        let dist = LengthDistribution::Uniform { min: 3, max: 5 };
        for _ in 0..100 {
            let x = a.length(&dist, 100);
            assert!((3..=5).contains(&x));
            assert_eq!(x, b.length(&dist, 100));
        }
        assert_eq!(a.length(&LengthDistribution::Fixed { tokens: 50 }, 10), 10);
        assert_ne!(mix(&[1, 2]), mix(&[2, 1]));
    }
}
