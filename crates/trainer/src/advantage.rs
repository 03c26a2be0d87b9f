//! Advantages (`DESIGN.md` §5): turns a batch of scored [`RolloutGroup`]s into training texts,
//! one per model turn, each with a scalar advantage.
//!
//! Three ideas compose here:
//! - **Group baseline** (GRPO): a rollout's advantage is its reward minus the mean reward of the
//!   trainable rollouts of its group, optionally divided by their (population) standard deviation.
//!   RLOO takes the mean of the *other* rollouts instead (`n/(n−1)` times GRPO's difference), an
//!   unbiased baseline; REINFORCE++-baseline takes the group mean, then whitens the whole step's
//!   advantages over its tokens (mean 0, variance 1) in place of a per-group std.
//! - **Situational baseline** (seed 002): each turn may carry a situation label; the baseline of a
//!   turn is taken within (group × situation), so a decision is compared with the same kind of
//!   decision in sibling rollouts. With padding on, a rollout that has fewer turns in a situation
//!   than its longest sibling adds rows held at its own reward: they shape the baseline only.
//! - **Episode discounting** (seed 001): in a rollout with `n` kept turns, turn `i` carries
//!   `gamma^(n−1−i)` of the final signal, so the last turn gets it whole and earlier turns less;
//!   `only_keep_outcome` keeps the last turn only.
//!
//! Rollouts that did not end trainably (error, timeout, expired, …) take no part: they neither
//! produce texts nor enter a baseline. Turns without completion tokens produce no text.

use std::collections::BTreeMap;

use crate::config::AdvantageKind;
pub use sluice_core::SituationAdvantage;
use sluice_core::{RolloutGroup, RolloutTurn, SituationAdvantages};

/// Added to the standard deviation before dividing, so a near-constant group does not explode.
pub const STD_EPSILON: f64 = 1e-6;

/// Advantages at or below this magnitude count as zero for filtering.
pub const ZERO_ADVANTAGE: f64 = 1e-8;

/// How advantages are computed; built from `[trainer]` (and `[replay]` for filtering).
#[derive(Debug, Clone, PartialEq)]
pub struct AdvantageConfig {
    /// Group (GRPO) or situational baseline.
    pub kind: AdvantageKind,
    /// Divide by the standard deviation of the baseline set.
    pub normalize_std: bool,
    /// Discount of the final signal per turn back from the end, in (0, 1].
    pub gamma: f64,
    /// The discount of the domains with their own (`data.domains.<d>.gamma`, or the task's own
    /// discount): a group takes its sample's domain's, else `gamma`.
    pub domain_gamma: BTreeMap<String, f64>,
    /// Keep only the last turn of each rollout.
    pub only_keep_outcome: bool,
    /// Situational only: pad shorter rollouts so every rollout enters every situation baseline
    /// of its group with as many rows as the longest one.
    pub pad_situations: bool,
    /// Situational only: leave out every (group × situation) bucket whose texts all have zero
    /// advantage (seed 002's "gold absent" case): they carry no signal, and left in they would
    /// only grow the loss denominators and dilute the situations that do.
    pub drop_zero_signal_situations: bool,
    /// Drop groups whose texts all have zero advantage.
    pub filter_zero_advantage: bool,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        Self {
            kind: AdvantageKind::Group,
            normalize_std: true,
            gamma: 1.0,
            domain_gamma: BTreeMap::new(),
            only_keep_outcome: false,
            pad_situations: false,
            drop_zero_signal_situations: false,
            filter_zero_advantage: true,
        }
    }
}

impl AdvantageConfig {
    /// The discount of `domain`'s episodes.
    pub fn gamma_for(&self, domain: &str) -> f64 {
        self.domain_gamma.get(domain).copied().unwrap_or(self.gamma)
    }
}

/// One training text: a model turn (prompt + completion) and its advantage.
#[derive(Debug, Clone, Copy)]
pub struct ScoredText<'a> {
    /// Index of the group in the batch.
    pub group: usize,
    /// Index of the rollout in its group.
    pub rollout: usize,
    /// Index of the turn in its rollout.
    pub turn: usize,
    /// The turn: prompt ids, completion ids, behaviour log-probs, versions.
    pub text: &'a RolloutTurn,
    /// Advantage of every completion token of this text.
    pub advantage: f32,
}

/// What [`compute_advantages`] produced.
#[derive(Debug, Clone, Default)]
pub struct AdvantageBatch<'a> {
    /// Training texts of the groups kept, in batch order.
    pub texts: Vec<ScoredText<'a>>,
    /// Groups that contributed texts.
    pub groups_kept: usize,
    /// Groups dropped: every advantage was zero (with filtering on) or no rollout was trainable.
    pub groups_filtered: usize,
}

impl AdvantageBatch<'_> {
    /// Nothing to train on: the step must be skipped and nothing published.
    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }
}

/// `gamma^(n−1−i) · reward` for `i` in `0..n`: the final reward propagated back over `n` steps.
pub fn discounted(reward: f64, n: usize, gamma: f64) -> Vec<f64> {
    (0..n)
        .map(|i| gamma.powi((n - 1 - i) as i32) * reward)
        .collect()
}

/// Mean and population standard deviation of `xs` (0, 0 when empty).
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Scores every group of `groups` (see the module docs) and drops zero-advantage groups when
/// `config.filter_zero_advantage` is set.
pub fn compute_advantages<'a>(
    groups: &'a [RolloutGroup],
    config: &AdvantageConfig,
) -> AdvantageBatch<'a> {
    let mut out = AdvantageBatch::default();
    for (g, group) in groups.iter().enumerate() {
        if let Some(why) = overflowing(group) {
            tracing::error!(group = %group.id, "group left out of the step: {why}");
            out.groups_filtered += 1;
            continue;
        }
        let texts = match config.kind {
            AdvantageKind::Group
            | AdvantageKind::Rloo
            | AdvantageKind::ReinforcePlusPlusBaseline => group_texts(g, group, config),
            AdvantageKind::Situational => situational_texts(g, group, config),
            AdvantageKind::Gae => gae_texts(g, group, config),
        };
        if let Some(bad) = texts.iter().find(|t| !t.advantage.is_finite()) {
            tracing::error!(
                group = %group.id,
                "group left out of the step: rollout {} has a non-finite advantage ({}); its rewards are too large to compare",
                bad.rollout,
                bad.advantage
            );
            out.groups_filtered += 1;
            continue;
        }
        let all_zero = texts
            .iter()
            .all(|t| f64::from(t.advantage).abs() <= ZERO_ADVANTAGE);
        // GAE's advantages come from the critic later: a group of equal rewards still has them.
        let filter = config.filter_zero_advantage && config.kind != AdvantageKind::Gae;
        if texts.is_empty() || (filter && all_zero) {
            out.groups_filtered += 1;
            continue;
        }
        out.groups_kept += 1;
        out.texts.extend(texts);
    }
    if config.kind == AdvantageKind::ReinforcePlusPlusBaseline {
        whiten_over_tokens(&mut out.texts);
    }
    out
}

/// REINFORCE++'s batch normalisation: every text's advantage shifted and scaled so that over the
/// step's completion tokens (each text counted once per token) they have mean 0 and variance 1.
fn whiten_over_tokens(texts: &mut [ScoredText<'_>]) {
    let tokens = |t: &ScoredText<'_>| t.text.completion_tokens() as f64;
    let total: f64 = texts.iter().map(tokens).sum();
    if total == 0.0 {
        return;
    }
    let mean = texts
        .iter()
        .map(|t| tokens(t) * f64::from(t.advantage))
        .sum::<f64>()
        / total;
    let var = texts
        .iter()
        .map(|t| tokens(t) * (f64::from(t.advantage) - mean).powi(2))
        .sum::<f64>()
        / total;
    let scale = 1.0 / (var.sqrt() + STD_EPSILON);
    for t in texts {
        t.advantage = ((f64::from(t.advantage) - mean) * scale) as f32;
    }
}

/// Why `group`'s rewards cannot be turned into advantages: a trainable rollout's reward that is
/// not finite, or a mean or standard deviation that overflows f64 (rewards near ±1e308; env
/// servers are bounded well below, but a reward function is not). Such a group would make the
/// loss NaN and stop the run with an error blaming the weights; left out, the step goes on.
fn overflowing(group: &RolloutGroup) -> Option<String> {
    let rewards: Vec<f64> = group
        .rollouts
        .iter()
        .filter(|r| r.status.is_trainable())
        .map(|r| r.reward)
        .collect();
    if let Some(r) = rewards.iter().find(|r| !r.is_finite()) {
        return Some(format!("a rollout's reward is {r}"));
    }
    let (mean, std) = mean_std(&rewards);
    (!mean.is_finite() || !std.is_finite()).then(|| {
        format!(
            "its rewards overflow the group statistics (mean {mean}, std {std}; rewards {:e} … {:e})",
            rewards.iter().copied().fold(f64::INFINITY, f64::min),
            rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        )
    })
}

/// The kept turns of one rollout: `(turn index, turn)`, in order.
fn kept_turns(turns: &[RolloutTurn], only_keep_outcome: bool) -> Vec<(usize, &RolloutTurn)> {
    let mut kept: Vec<_> = turns
        .iter()
        .enumerate()
        .filter(|(_, t)| t.completion_tokens() > 0)
        .collect();
    if only_keep_outcome && kept.len() > 1 {
        kept.drain(..kept.len() - 1);
    }
    kept
}

/// GRPO, RLOO and REINFORCE++-baseline: one advantage per rollout against its group's baseline,
/// then discounted over its turns.
fn group_texts<'a>(
    g: usize,
    group: &'a RolloutGroup,
    config: &AdvantageConfig,
) -> Vec<ScoredText<'a>> {
    let trainable: Vec<(usize, &_)> = group
        .rollouts
        .iter()
        .enumerate()
        .filter(|(_, r)| r.status.is_trainable())
        .collect();
    let rewards: Vec<f64> = trainable.iter().map(|(_, r)| r.reward).collect();
    let (mean, std) = mean_std(&rewards);
    let n = rewards.len() as f64;
    // RLOO's leave-one-out mean: `r − (Σ − r)/(n − 1) = n/(n − 1) · (r − mean)`; a rollout
    // alone in its group has no other to compare with, and no signal.
    let loo_scale = if n > 1.0 { n / (n - 1.0) } else { 0.0 };
    // REINFORCE++ divides by the step's spread, not the group's (`whiten_over_tokens`).
    let divide = config.normalize_std && config.kind != AdvantageKind::ReinforcePlusPlusBaseline;
    let gamma = config.gamma_for(&group.sample.domain);
    let mut texts = Vec::new();
    for (ri, rollout) in trainable {
        let mut adv = rollout.reward - mean;
        if config.kind == AdvantageKind::Rloo {
            adv *= loo_scale;
        }
        if divide {
            adv /= std + STD_EPSILON;
        }
        let kept = kept_turns(&rollout.turns, config.only_keep_outcome);
        let scales = discounted(1.0, kept.len(), gamma);
        for ((ti, turn), scale) in kept.into_iter().zip(scales) {
            texts.push(ScoredText {
                group: g,
                rollout: ri,
                turn: ti,
                text: turn,
                advantage: (scale * adv) as f32,
            });
        }
    }
    texts
}

/// GAE: every kept turn of every trainable rollout, in order, its advantage 0 until the critic's
/// values give each token its own (`crate::critic`).
fn gae_texts<'a>(
    g: usize,
    group: &'a RolloutGroup,
    config: &AdvantageConfig,
) -> Vec<ScoredText<'a>> {
    let mut texts = Vec::new();
    for (ri, rollout) in group.rollouts.iter().enumerate() {
        if !rollout.status.is_trainable() {
            continue;
        }
        for (ti, turn) in kept_turns(&rollout.turns, config.only_keep_outcome) {
            texts.push(ScoredText {
                group: g,
                rollout: ri,
                turn: ti,
                text: turn,
                advantage: 0.0,
            });
        }
    }
    texts
}

/// Situational: each text's discounted reward against the mean of its (group × situation) bucket.
fn situational_texts<'a>(
    g: usize,
    group: &'a RolloutGroup,
    config: &AdvantageConfig,
) -> Vec<ScoredText<'a>> {
    struct Pending<'a> {
        rollout: usize,
        turn: usize,
        text: &'a RolloutTurn,
        value: f64,
    }
    // Situation → texts of the group in it, and each rollout's representative reward.
    let mut buckets: BTreeMap<Option<&str>, Vec<Pending<'a>>> = BTreeMap::new();
    let mut rollout_rewards: Vec<(usize, f64)> = Vec::new();
    let gamma = config.gamma_for(&group.sample.domain);
    for (ri, rollout) in group.rollouts.iter().enumerate() {
        if !rollout.status.is_trainable() {
            continue;
        }
        rollout_rewards.push((ri, rollout.reward));
        let kept = kept_turns(&rollout.turns, config.only_keep_outcome);
        let values = discounted(rollout.reward, kept.len(), gamma);
        for ((ti, turn), value) in kept.into_iter().zip(values) {
            buckets
                .entry(turn.situation.as_deref())
                .or_default()
                .push(Pending {
                    rollout: ri,
                    turn: ti,
                    text: turn,
                    value,
                });
        }
    }
    let mut texts = Vec::new();
    for members in buckets.into_values() {
        let mut baseline_set: Vec<f64> = members.iter().map(|p| p.value).collect();
        if config.pad_situations {
            let count = |ri: usize| members.iter().filter(|p| p.rollout == ri).count();
            let longest = rollout_rewards.iter().map(|&(ri, _)| count(ri)).max();
            for &(ri, reward) in &rollout_rewards {
                let missing = longest.unwrap_or(0) - count(ri);
                baseline_set.extend(std::iter::repeat_n(reward, missing));
            }
        }
        let (mean, std) = mean_std(&baseline_set);
        let signal = |v: f64| {
            let mut adv = v - mean;
            if config.normalize_std {
                adv /= std + STD_EPSILON;
            }
            adv
        };
        if config.drop_zero_signal_situations
            && members
                .iter()
                .all(|p| signal(p.value).abs() <= ZERO_ADVANTAGE)
        {
            continue;
        }
        for p in members {
            texts.push(ScoredText {
                group: g,
                rollout: p.rollout,
                turn: p.turn,
                text: p.text,
                advantage: signal(p.value) as f32,
            });
        }
    }
    // Batch order (rollout, turn) keeps packing and resumption deterministic.
    texts.sort_by_key(|t| (t.rollout, t.turn));
    texts
}

/// Label of turns without a situation.
pub const NO_SITUATION: &str = "none";

/// The advantages `config` gives `groups`' training texts, summed per (domain, situation).
pub fn situation_advantages(
    groups: &[RolloutGroup],
    config: &AdvantageConfig,
) -> SituationAdvantages {
    situation_summary(groups, &compute_advantages(groups, config))
}

/// The advantages already computed for `groups` (`batch`), summed per (domain, situation).
pub fn situation_summary(
    groups: &[RolloutGroup],
    batch: &AdvantageBatch<'_>,
) -> SituationAdvantages {
    let mut out = SituationAdvantages::new();
    for t in &batch.texts {
        let key = (
            groups[t.group].sample.domain.clone(),
            t.text
                .situation
                .as_deref()
                .unwrap_or(NO_SITUATION)
                .to_owned(),
        );
        let e = out.entry(key).or_default();
        let a = f64::from(t.advantage);
        e.texts += 1;
        e.mean += a;
        e.abs_mean += a.abs();
    }
    for e in out.values_mut() {
        e.mean /= e.texts as f64;
        e.abs_mean /= e.texts as f64;
    }
    out
}
