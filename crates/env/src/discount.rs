//! Episode-aware discounting (seed 001): when a multi-step episode ends with outcome reward `R`,
//! step `i` of `n` is credited `gamma^(n−1−i) · R`, so earlier actions get geometrically less
//! credit. With `only_keep_outcome`, only the final step keeps a reward; earlier steps carry none
//! (`None`), which downstream reads as "not a training step".

use serde::{Deserialize, Serialize};
use sluice_core::Rollout;

/// Discounting parameters of an episodic task.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EpisodeDiscount {
    /// Discount factor in (0, 1].
    pub gamma: f64,
    /// Keep only the final step's reward.
    pub only_keep_outcome: bool,
}

/// Per-step rewards of an `n`-step episode with outcome `outcome`.
pub fn discounted_rewards(n: usize, outcome: f64, d: EpisodeDiscount) -> Vec<Option<f64>> {
    (0..n)
        .map(|i| {
            let from_end = (n - 1 - i) as i32;
            if d.only_keep_outcome && from_end > 0 {
                None
            } else {
                Some(d.gamma.powi(from_end) * outcome)
            }
        })
        .collect()
}

/// Writes the discounted reward of `rollout.reward` into every turn's `env_reward`.
pub fn apply_discount(rollout: &mut Rollout, d: EpisodeDiscount) {
    let rewards = discounted_rewards(rollout.turns.len(), rollout.reward, d);
    for (turn, r) in rollout.turns.iter_mut().zip(rewards) {
        turn.env_reward = r;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_example() {
        let d = EpisodeDiscount {
            gamma: 0.9,
            only_keep_outcome: false,
        };
        let r = discounted_rewards(3, 1.0, d);
        assert_eq!(r[2], Some(1.0));
        assert!((r[1].unwrap() - 0.9).abs() < 1e-12);
        assert!((r[0].unwrap() - 0.81).abs() < 1e-12);
        let keep = discounted_rewards(
            3,
            2.0,
            EpisodeDiscount {
                only_keep_outcome: true,
                ..d
            },
        );
        assert_eq!(keep, vec![None, None, Some(2.0)]);
        assert!(discounted_rewards(0, 1.0, d).is_empty());
    }
}
