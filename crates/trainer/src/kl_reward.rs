//! The KL penalty in the reward (`trainer.kl_in_reward`, verl's `use_kl_in_reward`), and its
//! adaptive coefficient.
//!
//! Each completion token `t` of a rollout gets the reward `−β·k_t`, with `k_t` an estimate from
//! `d_t = log π_behaviour(t) − log π_ref(t)`, the engine's log-prob less the reference policy's
//! (the frozen initial weights): `k1 = d_t` by default, whose sum over a text is an unbiased
//! estimate of the text's KL (verl's default `kl_penalty = "kl"`), or `k2 = ½d_t²` (`mse`) or
//! `k3 = e^{−d_t} + d_t − 1` (`low_var_kl`, never negative), `trainer.kl_in_reward_estimator`. Under `advantage = "gae"`
//! these are the per-token rewards GAE discounts, the rollout's reward arriving after its last
//! token; under every other advantage the rollout's reward becomes `R − β·Σ_t k_t` before its
//! group's baseline is taken.
//!
//! With a target `KL*` (`trainer.kl_in_reward_target`) `β` adapts after every step as Ziegler
//! et al. (2019) steer it: with `KL` the step's mean over rollouts of each rollout's mean `k_t`
//! and `n` its rollouts, `β ← β·(1 + clip(KL/KL* − 1, −0.2, 0.2)·n/H)`, `H` the horizon
//! (`trainer.kl_in_reward_horizon`). Without one `β` stays as set.

/// `trainer.kl_in_reward`'s settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlRewardConfig {
    /// The starting coefficient `β` (> 0).
    pub coef: f64,
    /// The adaptive controller's target KL per token; `None`: `β` stays fixed.
    pub target: Option<f64>,
    /// The controller's horizon `H`, in rollouts (> 0).
    pub horizon: f64,
    /// The per-token estimate `k_t` of the log-ratio `d_t` (`trainer.kl_in_reward_estimator`).
    pub estimator: crate::config::KlEstimator,
}

/// The coefficient `β` and its controller.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlController {
    coef: f64,
    config: KlRewardConfig,
}

impl KlController {
    /// `β` at its configured start.
    pub fn new(config: KlRewardConfig) -> Self {
        Self {
            coef: config.coef,
            config,
        }
    }

    /// The per-token estimate the penalty takes.
    pub fn estimator(&self) -> crate::config::KlEstimator {
        self.config.estimator
    }

    /// The coefficient the next step applies.
    pub fn coef(&self) -> f64 {
        self.coef
    }

    /// Sets the coefficient (a resumed run's).
    pub fn set_coef(&mut self, coef: f64) {
        self.coef = coef;
    }

    /// After a step whose rollouts (`rollouts` of them) had the mean KL `kl` per token: moves
    /// `β` toward the target, at most 20 % of `rollouts / H` a step; nothing without a target.
    pub fn update(&mut self, kl: f64, rollouts: usize) {
        let Some(target) = self.config.target else {
            return;
        };
        if !kl.is_finite() {
            return;
        }
        let error = (kl / target - 1.0).clamp(-0.2, 0.2);
        self.coef *= 1.0 + error * rollouts as f64 / self.config.horizon;
    }
}

/// The KL of one step's rollouts: each rollout's per-token estimates `k_t` (its texts' tokens in
/// order), summed into what the step reports.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepKl {
    /// Rollouts with tokens.
    pub rollouts: usize,
    /// Sum over rollouts of each rollout's mean `k_t`.
    pub mean_sum: f64,
}

impl StepKl {
    /// Adds a rollout's estimates.
    pub fn add(&mut self, k: &[f64]) {
        if k.is_empty() {
            return;
        }
        self.rollouts += 1;
        self.mean_sum += k.iter().sum::<f64>() / k.len() as f64;
    }

    /// The mean over rollouts of each one's mean KL per token (0 with none).
    pub fn mean(&self) -> f64 {
        self.mean_sum / self.rollouts.max(1) as f64
    }
}

/// What a step reports of the penalty: the coefficient it applied and its rollouts' KL.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KlRewardStep {
    /// `β` this step.
    pub coef: f64,
    /// The rollouts' KL.
    pub kl: StepKl,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn controller(target: Option<f64>) -> KlController {
        KlController::new(KlRewardConfig {
            coef: 0.1,
            target,
            horizon: 100.0,
            estimator: crate::config::KlEstimator::K1,
        })
    }

    #[test]
    fn a_fixed_coefficient_never_moves() {
        let mut c = controller(None);
        c.update(5.0, 64);
        assert_eq!(c.coef(), 0.1);
    }

    #[test]
    fn the_adaptive_coefficient_follows_the_kl_by_at_most_a_fifth_per_horizon() {
        // Far above the target: the error clips at +0.2; 50 rollouts of a horizon of 100.
        let mut c = controller(Some(0.01));
        c.update(1.0, 50);
        assert!((c.coef() - 0.1 * 1.1).abs() < 1e-12, "{}", c.coef());
        // Below: down, the error in proportion (0.009 / 0.01 − 1 = −0.1).
        let mut c = controller(Some(0.01));
        c.update(0.009, 100);
        assert!((c.coef() - 0.1 * 0.9).abs() < 1e-12, "{}", c.coef());
        // On target: unchanged; a NaN KL leaves it too.
        let mut c = controller(Some(0.01));
        c.update(0.01, 100);
        c.update(f64::NAN, 100);
        assert!((c.coef() - 0.1).abs() < 1e-12);
    }

    #[test]
    fn the_step_kl_is_the_mean_of_the_rollouts_means() {
        let mut k = StepKl::default();
        k.add(&[1.0, 3.0]);
        k.add(&[]);
        k.add(&[0.5]);
        assert_eq!(k.rollouts, 2);
        assert!((k.mean() - 1.25).abs() < 1e-12);
    }

    #[test]
    fn the_estimates_are_schulmans_at_a_log_ratio() {
        use crate::config::KlEstimator::{K1, K2, K3};
        for d in [-1.5, -0.1, 0.0, 0.3, 2.0] {
            assert_eq!(K1.at(d), d);
            assert_eq!(K2.at(d), d * d / 2.0);
            // r − log r − 1 with r = π_ref/π = e^{−d}.
            let r = (-d).exp();
            assert!((K3.at(d) - (r - r.ln() - 1.0)).abs() < 1e-12);
            assert!(K3.at(d) >= 0.0 && K2.at(d) >= 0.0);
        }
    }
}
