//! Token choice from one row of logits: temperature, top-k, top-p and a per-request seed.
//! Public for `sluice bench engine`, which times it at a real vocabulary.
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
pub(crate) const GREEDY_BELOW: f64 = 1e-5;

/// Buckets per nat of the nucleus (top-p) search's histogram, and how many: tokens more than
/// 64 nats below the likeliest share the last bucket.
const NUCLEUS_BUCKETS_PER_NAT: f32 = 4.0;
const NUCLEUS_BUCKETS: usize = 256;

/// Probabilities summed per block when the inverse CDF looks for its block first.
const CDF_BLOCK: usize = 1024;

/// One chosen token and its behaviour log-probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// `log softmax(logits / T)[token]`, before truncation.
    pub logprob: f32,
}

/// A row of logits under temperature `T` (`T <= 0` read as 1): `exp = e^((logits − max) / T)`
/// and `log_z = ln Σ exp` (summed in f64), so `log softmax = (logits − max) / T − log_z`. The
/// exponentials run 8 to a vector on AVX2 CPUs, and the row is read a few times in all: at a
/// real vocabulary that is most of what choosing a token costs.
struct Scaled<'a> {
    logits: &'a [f32],
    max: f32,
    inv_t: f32,
    exp: Vec<f32>,
    z: f64,
    log_z: f64,
}

impl<'a> Scaled<'a> {
    fn new(logits: &'a [f32], temperature: f64) -> Self {
        let t = if temperature > GREEDY_BELOW {
            temperature
        } else {
            1.0
        };
        let max = max(logits);
        let inv_t = (1.0 / t) as f32;
        let mut exp: Vec<f32> = logits.iter().map(|&x| (x - max) * inv_t).collect();
        sluice_model::fused::exp_f32_slice(&mut exp);
        let z = sum_f64(&exp);
        Self {
            logits,
            max,
            inv_t,
            exp,
            z,
            log_z: z.ln(),
        }
    }

    /// `log softmax(logits / T)[token]`.
    fn logprob(&self, token: u32) -> f32 {
        let scaled = (self.logits[token as usize] - self.max) * self.inv_t;
        (f64::from(scaled) - self.log_z) as f32
    }
}

/// The largest element (NaNs never win), in 8 lanes so it vectorises.
fn max(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    lanes
        .into_iter()
        .chain(tail.iter().copied())
        .fold(f32::NEG_INFINITY, |m, x| if x > m { x } else { m })
}

/// The sum in f64, in 4 lanes so it vectorises.
fn sum_f64(xs: &[f32]) -> f64 {
    let mut lanes = [0f64; 4];
    let chunks = xs.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += f64::from(x);
        }
    }
    (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]) + tail.iter().map(|&x| f64::from(x)).sum::<f64>()
}

/// `log softmax(logits / T)`, `T <= 0` read as 1.
pub(crate) fn log_softmax(logits: &[f32], temperature: f64) -> Vec<f32> {
    let s = Scaled::new(logits, temperature);
    (0..logits.len() as u32).map(|t| s.logprob(t)).collect()
}

/// Chooses a token from `logits` for completion position `position`.
pub fn sample(logits: &[f32], params: &SamplingParams, seed: u64, position: u64) -> Sampled {
    if params.temperature <= GREEDY_BELOW {
        let token = argmax(logits);
        return Sampled {
            token,
            logprob: Scaled::new(logits, params.temperature).logprob(token),
        };
    }
    let s = Scaled::new(logits, params.temperature);
    let u = uniform(seed, position);
    let truncated = params.top_k > 0 || params.top_p < 1.0;
    let token = if truncated {
        let (kept, mass) = nucleus(&s, params.top_k as usize, params.top_p);
        let mut acc = 0.0f64;
        let target = u * mass;
        kept.iter()
            .copied()
            .find(|&t| {
                acc += f64::from(s.exp[t as usize]) / s.z;
                acc > target
            })
            .unwrap_or_else(|| *kept.last().expect("a nucleus keeps at least one token"))
    } else {
        inverse_cdf(&s.exp, u * s.z)
    };
    Sampled {
        token,
        logprob: s.logprob(token),
    }
}

/// Samples every row (`rows[i]` with `params[i]`, seed and position), in parallel on the
/// current thread pool when the rows are many and wide (a real vocabulary): each row's draw
/// depends on its own seed and position only, so the result is the same either way.
pub fn sample_rows(rows: &[(&[f32], &SamplingParams, u64, u64)]) -> Vec<Sampled> {
    use rayon::prelude::*;
    /// Logits below which one thread samples everything (waking the pool costs more).
    const MIN_PARALLEL: usize = 1 << 16;
    let one = |&(logits, params, seed, position): &(&[f32], &SamplingParams, u64, u64)| {
        sample(logits, params, seed, position)
    };
    let total: usize = rows.iter().map(|r| r.0.len()).sum();
    if rows.len() > 1 && total >= MIN_PARALLEL && rayon::current_num_threads() > 1 {
        rows.par_iter().map(one).collect()
    } else {
        rows.iter().map(one).collect()
    }
}

/// The most likely tokens, most likely first, up to `top_k` (0: no limit) and until their
/// probability reaches `top_p` of the top `k`'s (as transformers' and vLLM's top-p applies
/// after top-k, to the renormalised distribution), with that probability. Sorts only
/// candidates: the `top_k`
/// likeliest (a selection), or every token down to the histogram bucket where the mass crosses
/// `top_p` (a real vocabulary is not sorted whole per token).
fn nucleus(s: &Scaled, top_k: usize, top_p: f64) -> (Vec<u32>, f64) {
    let v = s.logits.len();
    // Temperature scales and shifts every logit alike: the logits' order is the
    // probabilities'.
    let by_desc = |a: &u32, b: &u32| {
        s.logits[*b as usize]
            .total_cmp(&s.logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut order: Vec<u32> = if top_k > 0 && top_k < v {
        let mut all: Vec<u32> = (0..v as u32).collect();
        all.select_nth_unstable_by(top_k - 1, by_desc);
        all.truncate(top_k);
        all
    } else {
        likeliest_holding(s, top_p)
    };
    order.sort_unstable_by(by_desc);
    // The nucleus is `top_p` of what top-k left: of the whole distribution without a top-k.
    let left = if top_k > 0 && top_k < v {
        // Summed as `mass` is below, so that `top_p = 1` keeps every one of the `k`.
        order
            .iter()
            .map(|&t| f64::from(s.exp[t as usize]) / s.z)
            .sum::<f64>()
    } else {
        1.0
    };
    let mut mass = 0.0f64;
    let mut kept = 0;
    for &t in &order {
        mass += f64::from(s.exp[t as usize]) / s.z;
        kept += 1;
        if mass >= top_p * left {
            break;
        }
    }
    order.truncate(kept);
    (order, mass)
}

/// Every token at least as likely as the least likely one a nucleus of mass `top_p` can hold
/// (a superset of it, unsorted): a histogram of `ln p` in quarter nats, summed from the
/// likeliest bucket until the mass reaches `top_p`, then the tokens of those buckets and of
/// one more (the running sums round differently from the nucleus's own, token by token).
fn likeliest_holding(s: &Scaled, top_p: f64) -> Vec<u32> {
    if top_p >= 1.0 {
        return (0..s.logits.len() as u32).collect();
    }
    let scale = s.inv_t * NUCLEUS_BUCKETS_PER_NAT;
    let bucket = |x: f32| (((s.max - x) * scale) as usize).min(NUCLEUS_BUCKETS - 1);
    let mut mass = [0f64; NUCLEUS_BUCKETS];
    for (&x, &e) in s.logits.iter().zip(&s.exp) {
        mass[bucket(x)] += f64::from(e);
    }
    let target = top_p * s.z;
    let mut acc = 0.0;
    let last = mass
        .iter()
        .position(|&m| {
            acc += m;
            acc >= target
        })
        .map_or(NUCLEUS_BUCKETS - 1, |b| (b + 1).min(NUCLEUS_BUCKETS - 1));
    (0..s.logits.len() as u32)
        .filter(|&t| bucket(s.logits[t as usize]) <= last)
        .collect()
}

/// Inverse CDF of unnormalised weights in index order: the first index whose running sum
/// exceeds `target` (the last one absorbs rounding). Finds the block first from block sums.
fn inverse_cdf(weights: &[f32], target: f64) -> u32 {
    let mut acc = 0.0f64;
    let mut start = 0;
    for block in weights.chunks(CDF_BLOCK) {
        let sum = sum_f64(block);
        if acc + sum > target {
            break;
        }
        acc += sum;
        start += block.len();
    }
    let mut last = start.min(weights.len().saturating_sub(1));
    for (i, &w) in weights.iter().enumerate().skip(start) {
        acc += f64::from(w);
        last = i;
        if acc > target {
            break;
        }
    }
    last as u32
}

/// First index of the largest logit (ties break low, so batched and single runs agree; NaNs
/// never win). The maximum first, in vectors, then the first place it occurs.
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let m = max(logits);
    logits.iter().position(|&x| x == m).unwrap_or(0) as u32
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
pub fn uniform(seed: u64, position: u64) -> f64 {
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

    /// Top-p applies to the distribution top-k left, renormalised: p = [0.4, 0.3, 0.2, 0.1]
    /// with top_k 2 leaves [4/7, 3/7], whose 0.5-nucleus is the first token alone. Over the
    /// whole distribution (the sampler's old reading) 0.4 < 0.5 and both were drawn.
    #[test]
    fn top_p_applies_after_top_k() {
        let logits = [0.4f32.ln(), 0.3f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        for pos in 0..200 {
            assert_eq!(sample(&logits, &params(1.0, 0.5, 2), 3, pos).token, 0);
        }
        let seen: std::collections::BTreeSet<u32> = (0..200)
            .map(|pos| sample(&logits, &params(1.0, 0.6, 2), 3, pos).token)
            .collect();
        assert_eq!(seen, [0, 1].into(), "0.6 of [4/7, 3/7] takes both");
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

    /// Logits of a `v`-token vocabulary spread uniformly over `spread` nats, seeded.
    fn wide_logits(v: usize, spread: f32, seed: u64) -> Vec<f32> {
        (0..v as u64)
            .map(|i| (uniform(seed, i) as f32 - 0.5) * spread)
            .collect()
    }

    #[test]
    fn log_softmax_matches_an_f64_reference_at_a_real_vocabulary() {
        let logits = wide_logits(151_936, 30.0, 5);
        for t in [0.7, 1.0] {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z: f64 = logits.iter().map(|&x| ((x as f64 - max) / t).exp()).sum();
            let got = log_softmax(&logits, t);
            for (&x, &g) in logits.iter().zip(&got).step_by(997) {
                let want = (x as f64 - max) / t - z.ln();
                assert!((g as f64 - want).abs() < 2e-5, "{g} vs {want}");
            }
        }
    }

    #[test]
    fn the_blocked_inverse_cdf_is_the_plain_scan() {
        let weights: Vec<f32> = (0..5000u64).map(|i| uniform(9, i) as f32).collect();
        let total: f64 = weights.iter().map(|&w| w as f64).sum();
        for k in 0..200u64 {
            let target = uniform(10, k) * total;
            let mut acc = 0.0;
            let plain = weights
                .iter()
                .position(|&w| {
                    acc += w as f64;
                    acc > target
                })
                .unwrap_or(weights.len() - 1);
            assert_eq!(
                inverse_cdf(&weights, target),
                plain as u32,
                "target {target}"
            );
        }
        assert_eq!(inverse_cdf(&weights, total * 2.0), 4999);
        assert_eq!(inverse_cdf(&weights, 0.0), 0);
    }

    #[test]
    fn the_nucleus_is_the_sorted_prefix_that_holds_top_p() {
        // Spread logits (the nucleus holds thousands of tokens, across many buckets) and
        // peaked ones (a few), at two temperatures.
        for (spread, temperature) in [(2.0, 1.0), (2.0, 0.5), (80.0, 1.0), (80.0, 1.7)] {
            let logits = wide_logits(20_000, spread, 3);
            let s = Scaled::new(&logits, temperature);
            let mut order: Vec<u32> = (0..logits.len() as u32).collect();
            order.sort_by(|a, b| {
                logits[*b as usize]
                    .total_cmp(&logits[*a as usize])
                    .then(a.cmp(b))
            });
            for (top_k, top_p) in [(0, 0.9), (0, 0.3), (500, 0.99), (10, 1.0), (0, 1.0)] {
                let (kept, mass) = nucleus(&s, top_k, top_p);
                let mut want = 0;
                let mut want_mass = 0.0;
                let cap = if top_k > 0 { top_k } else { order.len() };
                // Top-p of the distribution top-k left, renormalised.
                let left: f64 = if top_k > 0 {
                    order
                        .iter()
                        .take(cap)
                        .map(|&t| f64::from(s.exp[t as usize]) / s.z)
                        .sum()
                } else {
                    1.0
                };
                for &t in order.iter().take(cap) {
                    want_mass += f64::from(s.exp[t as usize]) / s.z;
                    want += 1;
                    if want_mass >= top_p * left {
                        break;
                    }
                }
                let case =
                    format!("spread {spread}, T {temperature}, top_k {top_k}, top_p {top_p}");
                assert_eq!(kept, order[..want], "{case}");
                assert!((mass - want_mass).abs() < 1e-9, "{case}");
            }
        }
    }

    #[test]
    fn rows_sampled_together_equal_rows_sampled_alone() {
        let rows: Vec<Vec<f32>> = (0..6).map(|r| wide_logits(40_000, 12.0, r)).collect();
        let settings = [
            params(1.0, 1.0, 0),
            params(0.7, 0.9, 0),
            params(0.0, 1.0, 0),
        ];
        let jobs: Vec<(&[f32], &SamplingParams, u64, u64)> = rows
            .iter()
            .enumerate()
            .map(|(r, row)| (row.as_slice(), &settings[r % 3], r as u64, 3 * r as u64))
            .collect();
        let together = sample_rows(&jobs);
        for (job, got) in jobs.iter().zip(&together) {
            assert_eq!(*got, sample(job.0, job.1, job.2, job.3));
        }
        let lp = log_softmax(jobs[0].0, 1.0);
        assert_eq!(together[0].logprob, lp[together[0].token as usize]);
    }

    #[test]
    fn top_n_is_sorted() {
        let lp = log_softmax(&[0.0, 3.0, 1.0, 2.0], 1.0);
        let top: Vec<u32> = top_n(&lp, 3).into_iter().map(|(t, _)| t).collect();
        assert_eq!(top, vec![1, 3, 2]);
        assert_eq!(top_n(&lp, 10).len(), 4);
    }
}
