//! Outcome statistics of seed 001: a running exponential moving average of outcome rewards, and
//! the fractions of recent groups whose mean reward falls below / above a balance threshold (a
//! task that is too hard or too easy for the current policy shows up here first).

use std::collections::VecDeque;

use sluice_core::RolloutGroup;
use sluice_core::metrics::{
    ROLLOUT_ABOVE_BALANCE_RATIO, ROLLOUT_BELOW_BALANCE_RATIO, ROLLOUT_OUTCOME_EMA_REWARD,
};

/// Running outcome statistics. Bounded: only the last `window` group means are kept.
#[derive(Debug, Clone)]
pub struct OutcomeStats {
    alpha: f64,
    balance_threshold: f64,
    window: usize,
    ema: Option<f64>,
    recent: VecDeque<f64>,
}

impl OutcomeStats {
    /// `alpha` is the EMA weight of a new reward (0 < α ≤ 1); `window` groups (≥ 1) are kept for
    /// the balance fractions.
    pub fn new(alpha: f64, balance_threshold: f64, window: usize) -> Self {
        Self {
            alpha: alpha.clamp(f64::MIN_POSITIVE, 1.0),
            balance_threshold,
            window: window.max(1),
            ema: None,
            recent: VecDeque::new(),
        }
    }

    /// Folds one outcome reward into the EMA (the first reward sets it).
    pub fn record_reward(&mut self, reward: f64) {
        self.ema = Some(match self.ema {
            None => reward,
            Some(e) => e + self.alpha * (reward - e),
        });
    }

    /// Folds a scored group: every rollout's reward into the EMA, the group mean into the window.
    pub fn record_group(&mut self, group: &RolloutGroup) {
        if group.rollouts.is_empty() {
            return;
        }
        for r in &group.rollouts {
            self.record_reward(r.reward);
        }
        let mean =
            group.rollouts.iter().map(|r| r.reward).sum::<f64>() / group.rollouts.len() as f64;
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(mean);
    }

    /// The EMA of outcome rewards (`None` before the first).
    pub fn ema_reward(&self) -> Option<f64> {
        self.ema
    }

    /// (fraction below, fraction above) the balance threshold over the window; equal counts as
    /// neither. (0, 0) before any group.
    pub fn balance(&self) -> (f64, f64) {
        if self.recent.is_empty() {
            return (0.0, 0.0);
        }
        let n = self.recent.len() as f64;
        let below = self
            .recent
            .iter()
            .filter(|&&m| m < self.balance_threshold)
            .count();
        let above = self
            .recent
            .iter()
            .filter(|&&m| m > self.balance_threshold)
            .count();
        (below as f64 / n, above as f64 / n)
    }

    /// Sets the three gauges.
    pub fn publish_metrics(&self) {
        if let Some(e) = self.ema {
            metrics::gauge!(ROLLOUT_OUTCOME_EMA_REWARD).set(e);
        }
        let (below, above) = self.balance();
        metrics::gauge!(ROLLOUT_BELOW_BALANCE_RATIO).set(below);
        metrics::gauge!(ROLLOUT_ABOVE_BALANCE_RATIO).set(above);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::{DataSample, GroupId, NodeId, PolicyVersion, RunId};

    fn group(rewards: &[f64]) -> RolloutGroup {
        let id = GroupId {
            run: RunId::from_name("t"),
            node: NodeId(0),
            counter: 0,
        };
        let sample = DataSample {
            id: "0".into(),
            domain: "d".into(),
            dataset: "x".into(),
            input: serde_json::Value::Null,
            system_prompt: None,
        };
        let mut g = RolloutGroup::new(id, sample, rewards.len() as u32, PolicyVersion(0));
        for (r, &x) in g.rollouts.iter_mut().zip(rewards) {
            r.reward = x;
        }
        g
    }

    #[test]
    fn ema_and_balance() {
        let mut s = OutcomeStats::new(0.5, 0.5, 3);
        assert_eq!(s.ema_reward(), None);
        assert_eq!(s.balance(), (0.0, 0.0));
        s.record_reward(1.0);
        s.record_reward(0.0);
        assert_eq!(s.ema_reward(), Some(0.5));
        let mut s = OutcomeStats::new(0.5, 0.5, 3);
        s.record_group(&group(&[0.0, 0.0])); // mean 0 → below
        s.record_group(&group(&[1.0, 1.0])); // mean 1 → above
        s.record_group(&group(&[0.0, 1.0])); // mean 0.5 → neither
        let (b, a) = s.balance();
        assert!((b - 1.0 / 3.0).abs() < 1e-12 && (a - 1.0 / 3.0).abs() < 1e-12);
        s.record_group(&group(&[1.0])); // window of 3 drops the first (below)
        assert_eq!(s.balance(), (0.0, 2.0 / 3.0));
    }
}
