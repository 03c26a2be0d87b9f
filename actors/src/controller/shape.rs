//! What the run's rollouts look like, per domain, and how far the response lengths the trainer
//! sees drift from those the policy writes: bookkeeping the controller feeds (finished groups,
//! group times, the partials of groups that never finish, the trained lengths of each step) and
//! reads back as metrics and as `/v1/status`'s `shape` and `length_bias`.
//!
//! Everything is windowed, so memory stays bounded however long the run: the shape of a domain
//! over its last [`SHAPE_WINDOW`] finished rollouts and [`TIMING_WINDOW`] timed groups, the
//! length bias over the last [`LENGTH_WINDOW`] rollouts on each side. Domains come from the
//! config, so the per-domain maps and label values are bounded too.
//!
//! **Length bias** compares the response lengths of the rollouts generated (every rollout that
//! ended with model output, whatever the store then did with its group: trained, expired,
//! filtered; and the partials thrown away, at the length they had reached: regenerated from the
//! prompt, or of groups cleared or dropped while aborted) with those of the
//! rollouts trained on. The gauge is the signed relative gap of their means,
//! `(trained − generated) / generated`: 0 when the trainer sees what the policy writes,
//! −0.1 when it sees responses 10 % shorter on average. The mean is what a token-level loss
//! weighs, and it moves with the long tail, which is where the bias lives: a group expires or is
//! aborted for its longest rollout, so the shape of the body hardly changes. The two-sample
//! Kolmogorov–Smirnov distance of the two distributions (largest gap between their empirical
//! CDFs, in [0, 1]) is reported beside it, for a bias in the body (truncation, filtering).

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;
use sluice_core::metrics as m;
use sluice_core::{RolloutGroup, RolloutStatus};

/// Finished rollouts per domain the shape (means, quantiles, truncation) is taken over.
pub const SHAPE_WINDOW: usize = 256;
/// Timed groups per domain the time means are taken over.
pub const TIMING_WINDOW: usize = 64;
/// Rollouts on each side (generated, trained) the length bias is taken over.
pub const LENGTH_WINDOW: usize = 4096;

/// One group's time from admission to stored, and the mean per rollout of what it waited on.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GroupTime {
    /// Wall seconds from admission to stored (aborted trips included).
    pub total: f64,
    /// Mean seconds per rollout waiting on the engine.
    pub engine: f64,
    /// Mean seconds per rollout waiting on the environment.
    pub env: f64,
}

/// A domain's rollouts, as `/v1/status` shows them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DomainShapeStatus {
    /// Finished rollouts since the start.
    pub finished_rollouts: u64,
    /// Those rollouts by final status (`completed`, `truncated`, `error`, …): how episodes end.
    pub finish_reasons: BTreeMap<String, u64>,
    /// Rollouts the figures below are taken over (the last 256, `SHAPE_WINDOW`).
    pub window_rollouts: usize,
    /// Mean response tokens (completion tokens of every turn).
    pub response_tokens_mean: f64,
    /// Median response tokens.
    pub response_tokens_p50: u32,
    /// 90th percentile of response tokens.
    pub response_tokens_p90: u32,
    /// Longest response.
    pub response_tokens_max: u32,
    /// Mean model turns per episode.
    pub turns_mean: f64,
    /// Fraction truncated (hit `max_new_tokens`).
    pub truncated_ratio: f64,
    /// Groups timed since the start (stored in a bucket other than aborted).
    pub timed_groups: u64,
    /// Mean seconds from admission to stored, over the last 64 groups (`TIMING_WINDOW`).
    pub group_seconds: Option<f64>,
    /// Of that, mean seconds per rollout waiting on the engine.
    pub engine_seconds: Option<f64>,
    /// Of that, mean seconds per rollout waiting on the environment.
    pub env_seconds: Option<f64>,
}

/// The length bias, as `/v1/status` shows it (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LengthBiasStatus {
    /// Generated rollouts in the window.
    pub generated_rollouts: usize,
    /// Trained rollouts in the window.
    pub trained_rollouts: usize,
    /// Mean response tokens generated.
    pub generated_mean: f64,
    /// Mean response tokens trained.
    pub trained_mean: f64,
    /// The length bias: `(trained_mean − generated_mean) / generated_mean` (0 when nothing
    /// was generated); negative when training sees shorter responses.
    pub bias_ratio: f64,
    /// Kolmogorov–Smirnov distance of the two length distributions, in [0, 1].
    pub ks_distance: f64,
}

/// One finished rollout's figures.
#[derive(Debug, Clone, Copy)]
struct Figures {
    tokens: u32,
    turns: u32,
    truncated: bool,
}

#[derive(Debug, Default)]
struct DomainShape {
    recent: VecDeque<Figures>,
    finished: u64,
    by_status: BTreeMap<&'static str, u64>,
    times: VecDeque<GroupTime>,
    timed: u64,
}

/// The controller's record of rollout shapes, group times and the length bias.
#[derive(Debug, Default)]
pub struct RolloutShape {
    domains: BTreeMap<String, DomainShape>,
    generated: VecDeque<u32>,
    trained: VecDeque<u32>,
    bias: Option<LengthBiasStatus>,
}

fn push_bounded<T>(window: &mut VecDeque<T>, item: T, cap: usize) {
    if window.len() == cap {
        window.pop_front();
    }
    window.push_back(item);
}

fn tokens_of(r: &sluice_core::Rollout) -> u32 {
    u32::try_from(r.completion_tokens()).unwrap_or(u32::MAX)
}

impl RolloutShape {
    /// A finished group of `domain`: each rollout's length, turns and finish reason, exported;
    /// those with model output count as generated.
    pub fn record_group(&mut self, domain: &str, group: &RolloutGroup) {
        let d = self.domains.entry(domain.to_owned()).or_default();
        for r in &group.rollouts {
            let f = Figures {
                tokens: tokens_of(r),
                turns: r.turns.len() as u32,
                truncated: r.status == RolloutStatus::Truncated,
            };
            let label = r.status.as_label();
            d.finished += 1;
            *d.by_status.entry(label).or_insert(0) += 1;
            push_bounded(&mut d.recent, f, SHAPE_WINDOW);
            let dom = || domain.to_owned();
            metrics::histogram!(m::ROLLOUT_RESPONSE_TOKENS, "domain" => dom())
                .record(f64::from(f.tokens));
            metrics::histogram!(m::ROLLOUT_EPISODE_TURNS, "domain" => dom())
                .record(f64::from(f.turns));
            metrics::counter!(m::DOMAIN_FINISHED_ROLLOUTS, "domain" => dom(), "status" => label)
                .increment(1);
            if r.status.is_trainable() {
                push_bounded(&mut self.generated, f.tokens, LENGTH_WINDOW);
            }
        }
        let truncated = d.recent.iter().filter(|f| f.truncated).count();
        let ratio = truncated as f64 / d.recent.len().max(1) as f64;
        metrics::gauge!(m::ROLLOUT_TRUNCATED_RATIO, "domain" => domain.to_owned()).set(ratio);
    }

    /// A group of `domain` was stored after `time`.
    pub fn record_time(&mut self, domain: &str, time: GroupTime) {
        let d = self.domains.entry(domain.to_owned()).or_default();
        d.timed += 1;
        push_bounded(&mut d.times, time, TIMING_WINDOW);
        let dom = || domain.to_owned();
        metrics::histogram!(m::ROLLOUT_GROUP_SECONDS, "domain" => dom()).record(time.total);
        metrics::histogram!(m::ROLLOUT_GROUP_ENGINE_SECONDS, "domain" => dom()).record(time.engine);
        metrics::histogram!(m::ROLLOUT_GROUP_ENV_SECONDS, "domain" => dom()).record(time.env);
    }

    /// Response tokens of partials thrown away (regenerated from the prompt, or a cleared or
    /// dropped aborted group's): generated, never trained.
    pub fn record_unfinished(&mut self, lengths: &[u32]) {
        for &n in lengths {
            push_bounded(&mut self.generated, n, LENGTH_WINDOW);
        }
    }

    /// A step trained rollouts of these lengths: the bias is measured again and exported.
    pub fn record_trained(&mut self, lengths: &[u32]) {
        for &n in lengths {
            push_bounded(&mut self.trained, n, LENGTH_WINDOW);
        }
        self.bias = length_bias(
            self.generated.make_contiguous(),
            self.trained.make_contiguous(),
        );
        if let Some(b) = &self.bias {
            metrics::gauge!(m::ROLLOUT_LENGTH_BIAS_RATIO).set(b.bias_ratio);
        }
    }

    /// The length bias at the last step (`None` before both sides have rollouts).
    pub fn length_bias(&self) -> Option<LengthBiasStatus> {
        self.bias
    }

    /// Each domain's shape.
    pub fn status(&self) -> BTreeMap<String, DomainShapeStatus> {
        self.domains
            .iter()
            .map(|(name, d)| (name.clone(), domain_status(d)))
            .collect()
    }
}

fn domain_status(d: &DomainShape) -> DomainShapeStatus {
    let n = d.recent.len();
    let mut tokens: Vec<u32> = d.recent.iter().map(|f| f.tokens).collect();
    tokens.sort_unstable();
    let quantile = |q: f64| -> u32 {
        let i = ((n as f64 - 1.0) * q).round() as usize;
        tokens.get(i).copied().unwrap_or(0)
    };
    let mean = |f: &dyn Fn(&Figures) -> f64| d.recent.iter().map(f).sum::<f64>() / n.max(1) as f64;
    let times = d.times.len();
    let time_mean = |f: &dyn Fn(&GroupTime) -> f64| {
        (times > 0).then(|| d.times.iter().map(f).sum::<f64>() / times as f64)
    };
    DomainShapeStatus {
        finished_rollouts: d.finished,
        finish_reasons: d
            .by_status
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect(),
        window_rollouts: n,
        response_tokens_mean: mean(&|f| f64::from(f.tokens)),
        response_tokens_p50: quantile(0.5),
        response_tokens_p90: quantile(0.9),
        response_tokens_max: tokens.last().copied().unwrap_or(0),
        turns_mean: mean(&|f| f64::from(f.turns)),
        truncated_ratio: mean(&|f| if f.truncated { 1.0 } else { 0.0 }),
        timed_groups: d.timed,
        group_seconds: time_mean(&|t| t.total),
        engine_seconds: time_mean(&|t| t.engine),
        env_seconds: time_mean(&|t| t.env),
    }
}

/// The length bias of `generated` against `trained` (`None` when either is empty).
pub fn length_bias(generated: &[u32], trained: &[u32]) -> Option<LengthBiasStatus> {
    if generated.is_empty() || trained.is_empty() {
        return None;
    }
    let mean = |v: &[u32]| v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
    let (g, t) = (mean(generated), mean(trained));
    Some(LengthBiasStatus {
        generated_rollouts: generated.len(),
        trained_rollouts: trained.len(),
        generated_mean: g,
        trained_mean: t,
        bias_ratio: if g > 0.0 { (t - g) / g } else { 0.0 },
        ks_distance: ks_distance(generated, trained),
    })
}

/// The two-sample Kolmogorov–Smirnov statistic: the largest gap between the empirical CDFs of
/// `a` and `b`, in [0, 1] (0 when either is empty).
pub fn ks_distance(a: &[u32], b: &[u32]) -> f64 {
    if a.is_empty() || b.is_empty() {
        return 0.0;
    }
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort_unstable();
    b.sort_unstable();
    let (n, m) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut d) = (0, 0, 0.0f64);
    // Past the end of either side the gap only closes: the largest is found before.
    while i < a.len() && j < b.len() {
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / n - j as f64 / m).abs());
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::{DataSample, GroupId, NodeId, PolicyVersion, RolloutTurn, RunId};

    #[test]
    fn ks_distance_is_zero_for_equal_samples_one_for_disjoint_and_exact_between() {
        assert_eq!(ks_distance(&[3, 1, 2], &[1, 2, 3]), 0.0);
        assert_eq!(ks_distance(&[1, 2], &[10, 20, 30]), 1.0);
        assert_eq!(ks_distance(&[10, 20, 30], &[1, 2]), 1.0);
        // F_a jumps to 1/2 at 1 and 1 at 3; F_b to 1/2 at 2 and 1 at 4: the gap is 1/2.
        assert_eq!(ks_distance(&[1, 3], &[2, 4]), 0.5);
        // Ties count on both sides at once.
        assert_eq!(ks_distance(&[5, 5, 5, 9], &[5, 9, 9, 9]), 0.5);
        assert_eq!(ks_distance(&[], &[1]), 0.0);
    }

    #[test]
    fn length_bias_leans_negative_when_training_loses_the_long_ones() {
        let generated: Vec<u32> = (1..=100).collect();
        let trained: Vec<u32> = (1..=50).collect();
        let b = length_bias(&generated, &trained).unwrap();
        assert_eq!((b.generated_rollouts, b.trained_rollouts), (100, 50));
        assert!((b.ks_distance - 0.5).abs() < 1e-9, "{b:?}");
        assert!((b.bias_ratio - (25.5 - 50.5) / 50.5).abs() < 1e-9);
        assert_eq!(length_bias(&generated, &[]), None);
    }

    fn group(statuses: &[(RolloutStatus, usize, usize)]) -> RolloutGroup {
        let id = GroupId {
            run: RunId::from_name("shape"),
            node: NodeId(0),
            counter: 1,
        };
        let sample = DataSample {
            id: "1".into(),
            domain: "math".into(),
            dataset: "toy".into(),
            input: serde_json::Value::Null,
            system_prompt: None,
        };
        let mut g = RolloutGroup::new(id, sample, statuses.len() as u32, PolicyVersion(0));
        for (r, (status, turns, tokens)) in g.rollouts.iter_mut().zip(statuses) {
            for _ in 0..*turns {
                let mut t = RolloutTurn::new(vec![1]);
                let n = tokens / turns;
                t.append_tokens(&vec![7; n], &vec![-0.1; n], &vec![PolicyVersion(0); n])
                    .unwrap();
                r.turns.push(t);
            }
            r.status = status.clone();
        }
        g
    }

    #[test]
    fn a_domain_shows_its_lengths_turns_truncation_reasons_and_times() {
        let mut shape = RolloutShape::default();
        let g = group(&[
            (RolloutStatus::Completed, 1, 10),
            (RolloutStatus::Truncated, 2, 40),
            (RolloutStatus::Error("env".into()), 1, 0),
            (RolloutStatus::Completed, 3, 30),
        ]);
        shape.record_group("math", &g);
        shape.record_time(
            "math",
            GroupTime {
                total: 2.0,
                engine: 1.0,
                env: 0.5,
            },
        );
        let s = &shape.status()["math"];
        assert_eq!((s.finished_rollouts, s.window_rollouts), (4, 4));
        assert_eq!(s.finish_reasons["completed"], 2);
        assert_eq!(s.finish_reasons["truncated"], 1);
        assert_eq!(s.finish_reasons["error"], 1);
        assert!((s.response_tokens_mean - 20.0).abs() < 1e-9);
        assert_eq!(
            (s.response_tokens_p50, s.response_tokens_max),
            (30, 40),
            "{s:?}"
        );
        assert!((s.turns_mean - 1.75).abs() < 1e-9);
        assert!((s.truncated_ratio - 0.25).abs() < 1e-9);
        assert_eq!(
            (s.group_seconds, s.engine_seconds, s.env_seconds),
            (Some(2.0), Some(1.0), Some(0.5))
        );
        // The failed rollout wrote nothing to train on: three lengths count as generated.
        shape.record_trained(&[10]);
        let b = shape.length_bias().unwrap();
        assert_eq!((b.generated_rollouts, b.trained_rollouts), (3, 1));
        assert!((b.generated_mean - 80.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn windows_stay_bounded() {
        let mut shape = RolloutShape::default();
        let g = group(&vec![(RolloutStatus::Completed, 1, 4); 16]);
        for _ in 0..(LENGTH_WINDOW / 16 + 40) {
            shape.record_group("math", &g);
            shape.record_time("math", GroupTime::default());
        }
        shape.record_unfinished(&[1; 100]);
        shape.record_trained(&vec![4; LENGTH_WINDOW + 10]);
        let s = &shape.status()["math"];
        assert_eq!(s.window_rollouts, SHAPE_WINDOW);
        assert_eq!(s.finished_rollouts, 16 * (LENGTH_WINDOW as u64 / 16 + 40));
        let b = shape.length_bias().unwrap();
        assert_eq!(
            (b.generated_rollouts, b.trained_rollouts),
            (LENGTH_WINDOW, LENGTH_WINDOW)
        );
        // The 100 partials of a cleared group are the newest generated lengths.
        assert!(
            (b.ks_distance - 100.0 / LENGTH_WINDOW as f64).abs() < 1e-9,
            "{b:?}"
        );
    }
}
