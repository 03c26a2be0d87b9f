//! A small seeded random generator (xoshiro256**, seeded through SplitMix64) whose entire state is
//! four integers. The sampler checkpoints it verbatim, so a restored run draws the same sequence it
//! would have drawn without the restart.

use serde::{Deserialize, Serialize};

/// xoshiro256** state. Not cryptographic; fast and well distributed for sampling.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng {
    s: [u64; 4],
}

/// One SplitMix64 step (the core crate's): seeds the generator, and derives independent
/// sub-seeds (per domain, per epoch) from the master seed.
pub use sluice_core::rng::splitmix64;

/// Mixes several values into one seed (order matters).
pub fn derive_seed(parts: &[u64]) -> u64 {
    let mut state = 0x5EED_u64;
    for &p in parts {
        state ^= p;
        splitmix64(&mut state);
    }
    splitmix64(&mut state)
}

/// 64-bit FNV-1a of a string, to turn names into seed parts.
pub fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Rng {
    /// A generator seeded from `seed`.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        Self {
            s: [
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
            ],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n > 0`), by the multiply-shift map (bias below 2⁻³² for any `n` we use).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Shuffles `items` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_state_roundtrips() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..10 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let saved: Rng = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        let mut c = saved;
        assert_eq!(a.next_u64(), c.next_u64());
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
    }

    #[test]
    fn below_and_f64_stay_in_range_and_cover_it() {
        let mut r = Rng::new(1);
        let mut seen = [0u32; 5];
        for _ in 0..5000 {
            let x = r.below(5) as usize;
            seen[x] += 1;
            let f = r.next_f64();
            assert!((0.0..1.0).contains(&f));
        }
        for (i, &n) in seen.iter().enumerate() {
            assert!((800..1200).contains(&n), "bucket {i}: {n}");
        }
        let mut v: Vec<u32> = (0..50).collect();
        r.shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(
            v, sorted,
            "a 50-element shuffle is the identity with probability 1/50!"
        );
    }
}
