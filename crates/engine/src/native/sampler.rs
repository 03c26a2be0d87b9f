//! Token choice from one row of logits: temperature, top-k, top-p and a per-request seed.
//!
//! The behaviour log-probability reported for a token is `log softmax(logits / T)[token]` with
//! `T` the request's temperature (`T = 0`, greedy, reports `T = 1`), computed in f64 over the
//! whole vocabulary **before** top-k/top-p truncation. That is the quantity a trainer can
//! recompute from its own forward pass (divide the logits by the rollout temperature, take a
//! log-softmax), so the importance ratio is exactly 1 for on-policy tokens; the truncated
//! distribution depends on a sort the trainer does not reproduce. Keep `top_p = 1`, `top_k = 0`
//! for RL, as every framework we follow recommends.
//!
//! Randomness: the uniform draw for completion position `i` is a hash of `(seed, i)`, so a
//! request's tokens do not depend on what else is in the batch, and a resumed request draws the
//! same numbers at the same positions as it would have uninterrupted.

use crate::backend::SamplingParams;

/// Temperatures at or below this are greedy.
const GREEDY_BELOW: f64 = 1e-5;

/// One chosen token and its behaviour log-probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Sampled {
    /// The token.
    pub token: u32,
    /// `log softmax(logits / T)[token]`, before truncation.
    pub logprob: f32,
}

/// `log softmax(logits / T)`, `T <= 0` read as 1.
pub(crate) fn log_softmax(logits: &[f32], temperature: f64) -> Vec<f32> {
    let t = if temperature > GREEDY_BELOW {
        temperature
    } else {
        1.0
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| ((x as f64 - max) / t).exp()).sum();
    let log_z = sum.ln();
    logits
        .iter()
        .map(|&x| ((x as f64 - max) / t - log_z) as f32)
        .collect()
}

/// Chooses a token from `logits` for completion position `position`.
pub(crate) fn sample(logits: &[f32], params: &SamplingParams, seed: u64, position: u64) -> Sampled {
    let lp = log_softmax(logits, params.temperature);
    if params.temperature <= GREEDY_BELOW {
        let token = argmax(logits);
        return Sampled {
            token,
            logprob: lp[token as usize],
        };
    }
    let u = uniform(seed, position);
    let truncated = params.top_k > 0 || params.top_p < 1.0;
    let token = if truncated {
        let mut order: Vec<u32> = (0..lp.len() as u32).collect();
        let by_desc = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
        let k = params.top_k as usize;
        if k > 0 && k < order.len() {
            order.select_nth_unstable_by(k - 1, by_desc);
            order.truncate(k);
        }
        order.sort_unstable_by(by_desc);
        let mut kept = 0;
        let mut mass = 0.0f64;
        for &t in &order {
            mass += (lp[t as usize] as f64).exp();
            kept += 1;
            if mass >= params.top_p {
                break;
            }
        }
        pick(order[..kept].iter().copied(), &lp, u * mass)
    } else {
        pick(0..lp.len() as u32, &lp, u)
    };
    Sampled {
        token,
        logprob: lp[token as usize],
    }
}

/// Inverse CDF over `candidates` in order; the last candidate absorbs rounding.
fn pick(candidates: impl Iterator<Item = u32>, lp: &[f32], target: f64) -> u32 {
    let mut acc = 0.0f64;
    let mut last = 0;
    for t in candidates {
        acc += (lp[t as usize] as f64).exp();
        last = t;
        if acc > target {
            return t;
        }
    }
    last
}

/// First index of the largest logit (ties break low, so batched and single runs agree).
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The `n` most likely tokens of a log-probability row, most likely first.
pub(crate) fn top_n(lp: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut order: Vec<u32> = (0..lp.len() as u32).collect();
    let by_desc = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
    let n = n.min(order.len());
    if n < order.len() {
        order.select_nth_unstable_by(n - 1, by_desc);
        order.truncate(n);
    }
    order.sort_unstable_by(by_desc);
    order.into_iter().map(|t| (t, lp[t as usize])).collect()
}

/// A uniform draw in `[0, 1)` for `(seed, position)`.
pub(crate) fn uniform(seed: u64, position: u64) -> f64 {
    let h = splitmix(splitmix(seed) ^ position.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// SplitMix64 as a hash of one word (the core crate's, so seeds mean the same everywhere).
pub(crate) use sluice_core::rng::splitmix;

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f64, top_p: f64, top_k: u32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            max_tokens: 1,
            seed: None,
            stop_token_ids: vec![],
        }
    }

    #[test]
    fn log_softmax_normalizes_and_scales_with_temperature() {
        let logits = [1.0f32, 2.0, 3.0];
        for t in [0.5, 1.0, 2.0] {
            let lp = log_softmax(&logits, t);
            let total: f64 = lp.iter().map(|&x| (x as f64).exp()).sum();
            assert!((total - 1.0).abs() < 1e-6);
            // lp[2] - lp[1] == (3 - 2) / T
            assert!(((lp[2] - lp[1]) as f64 - 1.0 / t).abs() < 1e-5);
        }
        assert_eq!(log_softmax(&logits, 0.0), log_softmax(&logits, 1.0));
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let s = sample(&[0.0, 5.0, 5.0, 1.0], &params(0.0, 1.0, 0), 1, 0);
        assert_eq!(s.token, 1);
        assert!(s.logprob < 0.0);
    }

    #[test]
    fn top_k_one_is_greedy_and_logprob_is_untruncated() {
        let logits = [0.1f32, 0.3, 0.2];
        for pos in 0..20 {
            let s = sample(&logits, &params(1.0, 1.0, 1), 7, pos);
            assert_eq!(s.token, 1);
            assert!((s.logprob - log_softmax(&logits, 1.0)[1]).abs() < 1e-7);
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // p = [0.7, 0.2, 0.1]: top_p 0.6 keeps the first token only.
        let logits = [0.7f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        for pos in 0..50 {
            assert_eq!(sample(&logits, &params(1.0, 0.6, 0), 3, pos).token, 0);
        }
        let seen: std::collections::BTreeSet<u32> = (0..200)
            .map(|pos| sample(&logits, &params(1.0, 0.85, 0), 3, pos).token)
            .collect();
        assert_eq!(seen, [0, 1].into());
    }

    #[test]
    fn draws_follow_the_distribution_and_the_seed() {
        let logits = [0.5f32.ln(), 0.25f32.ln(), 0.25f32.ln()];
        let draws: Vec<u32> = (0..4000)
            .map(|pos| sample(&logits, &params(1.0, 1.0, 0), 11, pos).token)
            .collect();
        let zeros = draws.iter().filter(|&&t| t == 0).count() as f64 / 4000.0;
        assert!((zeros - 0.5).abs() < 0.05, "{zeros}");
        let again: Vec<u32> = (0..4000)
            .map(|pos| sample(&logits, &params(1.0, 1.0, 0), 11, pos).token)
            .collect();
        assert_eq!(draws, again);
        let other: Vec<u32> = (0..4000)
            .map(|pos| sample(&logits, &params(1.0, 1.0, 0), 12, pos).token)
            .collect();
        assert_ne!(draws, other);
    }

    #[test]
    fn top_n_is_sorted() {
        let lp = log_softmax(&[0.0, 3.0, 1.0, 2.0], 1.0);
        let top: Vec<u32> = top_n(&lp, 3).into_iter().map(|(t, _)| t).collect();
        assert_eq!(top, vec![1, 3, 2]);
        assert_eq!(top_n(&lp, 10).len(), 4);
    }
}
