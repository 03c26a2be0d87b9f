//! [`StepStats`]: what a training step measured, and [`step_metrics`], the same as
//! catalog-named metrics for `TrainStepOutput::metrics`.

use std::collections::BTreeMap;

use sluice_core::PolicyVersion;
use sluice_core::metrics as m;

use crate::loss::LossStats;
use crate::optim::StepReport;

/// What a step measured, before it is turned into catalog-named metrics.
#[derive(Debug, Clone, Default)]
pub struct StepStats {
    /// Loss counters over every micro-batch.
    pub loss: LossStats,
    /// Optimizer report (`None` for a skipped step).
    pub optim: Option<StepReport>,
    /// Micro-batches run.
    pub micro_batches: usize,
    /// Packing efficiency.
    pub packing_efficiency: f64,
    /// Tokens through forward and backward (non-padding slots).
    pub processed_tokens: usize,
    /// Completion tokens trained on.
    pub trained_tokens: usize,
    /// Texts left out by the batcher.
    pub rejected_texts: usize,
    /// Mean and max version lag of trained tokens against the step's starting weights.
    pub mean_lag: f64,
    /// See `mean_lag`.
    pub max_lag: u64,
    /// Wall time of the step.
    pub seconds: f64,
    /// Groups kept / dropped by advantage filtering.
    pub groups_kept: usize,
    /// See `groups_kept`.
    pub groups_filtered: usize,
    /// Where `seconds` went.
    pub parts: StepParts,
    /// The advantages the step gave its texts, per (domain, situation) (computed with them).
    pub situations: sluice_core::SituationAdvantages,
    /// Trainer against engine log-probs on the lag-0 tokens (train/inference mismatch).
    pub mismatch: Mismatch,
    /// With `advantage = "gae"`, the critic's figures.
    pub critic: Option<crate::critic::CriticStats>,
    /// With `kl_in_reward`, the penalty's coefficient and the rollouts' KL.
    pub kl_reward: Option<crate::kl_reward::KlRewardStep>,
}

/// The train/inference mismatch of a step, summed over the tokens it compares: those generated
/// by the weights the step starts from (lag 0), scored by the trainer on those same weights, so
/// any difference is the two implementations' (kernels, precision, sampling temperature), not
/// learning. With `r = trainer − behaviour` log-prob of a token, the step reports the mean and
/// max of `|r|` and the k3 estimate of KL(engine ‖ trainer), the mean of `exp(r) − 1 − r` (≥ 0
/// token by token, unbiased since the tokens were sampled from the engine).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mismatch {
    /// Tokens compared.
    pub tokens: u64,
    /// Sum of `|r|`.
    pub abs_sum: f64,
    /// Largest `|r|`.
    pub abs_max: f64,
    /// Sum of `exp(r) − 1 − r`.
    pub k3_sum: f64,
}

impl Mismatch {
    /// Adds one token: the trainer's and the engine's log-prob of it.
    pub fn add(&mut self, trainer: f32, behaviour: f32) {
        let r = f64::from(trainer) - f64::from(behaviour);
        if !r.is_finite() {
            return;
        }
        self.tokens += 1;
        self.abs_sum += r.abs();
        self.abs_max = self.abs_max.max(r.abs());
        // exp(r) − 1 − r loses everything to cancellation for tiny r: exp_m1 keeps it.
        self.k3_sum += r.exp_m1() - r;
    }

    /// Adds another sum (another micro-batch's).
    pub fn merge(&mut self, other: &Mismatch) {
        self.tokens += other.tokens;
        self.abs_sum += other.abs_sum;
        self.abs_max = self.abs_max.max(other.abs_max);
        self.k3_sum += other.k3_sum;
    }

    /// Mean `|r|` (`None` without compared tokens).
    pub fn abs_mean(&self) -> Option<f64> {
        (self.tokens > 0).then(|| self.abs_sum / self.tokens as f64)
    }

    /// The k3 KL estimate (`None` without compared tokens).
    pub fn kl(&self) -> Option<f64> {
        (self.tokens > 0).then(|| self.k3_sum / self.tokens as f64)
    }
}

/// Wall seconds of each part of a step (they add up to about the step's `seconds`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepParts {
    /// Advantages, aggregation weights and packing into micro-batches.
    pub packing: f64,
    /// Extra forwards for proximal (`decoupled_ppo`, later minibatches) and reference
    /// (`kl_coef`) log-probs.
    pub scoring: f64,
    /// Training forwards: log-probs and entropies of every target.
    pub forward: f64,
    /// Loss coefficients and statistics on the host, with the copies to and from the model.
    pub loss: f64,
    /// Backward passes and gradient accumulation.
    pub backward: f64,
    /// With `advantage = "gae"`, the critic's updates (its starting values count as scoring).
    pub critic: f64,
    /// Clipping and AdamW updates.
    pub optimizer: f64,
    /// The published snapshot of the new weights.
    pub publish: f64,
}

impl StepParts {
    /// `(name, seconds)` of every part, in step order.
    pub fn named(&self) -> [(&'static str, f64); 8] {
        [
            ("packing", self.packing),
            ("scoring", self.scoring),
            ("critic", self.critic),
            ("forward", self.forward),
            ("loss", self.loss),
            ("backward", self.backward),
            ("optimizer", self.optimizer),
            ("publish", self.publish),
        ]
    }

    /// Adds `other` part by part.
    pub fn add(&mut self, other: &StepParts) {
        self.packing += other.packing;
        self.scoring += other.scoring;
        self.forward += other.forward;
        self.loss += other.loss;
        self.backward += other.backward;
        self.critic += other.critic;
        self.optimizer += other.optimizer;
        self.publish += other.publish;
    }
}

/// Catalog-named metrics of a step.
pub fn step_metrics(stats: &StepStats, version: PolicyVersion) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let mut put = |name: &str, v: f64| {
        if v.is_finite() {
            out.insert(name.to_owned(), v);
        }
    };
    let Some(optim) = stats.optim else {
        // No policy update: a batch without signal, or a critic warm-up step (which reports
        // the critic's figures and the penalty's).
        put(m::TRAINER_SKIPPED_STEPS, 1.0);
        reward_side_metrics(stats, &mut put);
        return out;
    };
    let s = stats.loss.summary();
    put(m::TRAINER_POLICY_VERSION, version.0 as f64);
    put(m::TRAINER_LOSS_VALUE, s.loss);
    put(
        m::TRAINER_CLIP_RATIO,
        s.clip_low_fraction + s.clip_high_fraction,
    );
    put(m::TRAINER_CLIP_LOW_RATIO, s.clip_low_fraction);
    put(m::TRAINER_CLIP_HIGH_RATIO, s.clip_high_fraction);
    put(m::TRAINER_DUAL_CLIP_RATIO, s.dual_clip_fraction);
    put(m::TRAINER_ENTROPY_NATS, s.entropy);
    put(m::TRAINER_KL_NATS, s.kl);
    put(m::TRAINER_IMPORTANCE_WEIGHT_MEAN_RATIO, s.is_mean);
    put(m::TRAINER_IMPORTANCE_WEIGHT_MAX_RATIO, s.is_max);
    put(m::TRAINER_EFFECTIVE_SAMPLE_SIZE_RATIO, s.ess_fraction);
    put(m::TRAINER_GRAD_NORM_VALUE, optim.grad_norm);
    put(m::TRAINER_LEARNING_RATE_VALUE, optim.learning_rate);
    put(
        m::TRAINER_PACKING_EFFICIENCY_RATIO,
        stats.packing_efficiency,
    );
    put(m::TRAINER_STEP_SECONDS, stats.seconds);
    put(
        m::TRAINER_TOKENS_PER_SECOND,
        stats.processed_tokens as f64 / stats.seconds.max(1e-9),
    );
    put(m::TRAINER_TOKEN_VERSION_LAG_VERSIONS, stats.mean_lag);
    let mismatch = &stats.mismatch;
    put(m::TRAINER_MISMATCH_COMPARED_TOKENS, mismatch.tokens as f64);
    if let (Some(mean), Some(kl)) = (mismatch.abs_mean(), mismatch.kl()) {
        put(m::TRAINER_MISMATCH_LOGPROB_ABS_MEAN_NATS, mean);
        put(m::TRAINER_MISMATCH_LOGPROB_ABS_MAX_NATS, mismatch.abs_max);
        put(m::TRAINER_MISMATCH_KL_NATS, kl);
    }
    reward_side_metrics(stats, &mut put);
    out
}

/// The figures of the KL penalty in the reward and of the critic, for a step that has them.
fn reward_side_metrics(stats: &StepStats, put: &mut impl FnMut(&str, f64)) {
    if let Some(k) = &stats.kl_reward {
        put(m::TRAINER_KL_IN_REWARD_COEF_VALUE, k.coef);
        put(m::TRAINER_KL_IN_REWARD_NATS, k.kl.mean());
    }
    let Some(c) = &stats.critic else {
        return;
    };
    put(
        m::TRAINER_CRITIC_LOSS_VALUE,
        c.loss / c.updates.max(1) as f64,
    );
    put(m::TRAINER_CRITIC_VALUE_CLIP_RATIO, c.clip_fraction());
    put(m::TRAINER_CRITIC_VALUES_MEAN_VALUE, c.values_mean());
    put(m::TRAINER_CRITIC_RETURNS_MEAN_VALUE, c.returns_mean());
    if let Some(ev) = c.explained_variance() {
        put(m::TRAINER_CRITIC_EXPLAINED_VARIANCE_RATIO, ev);
    }
    put(m::TRAINER_CRITIC_GRAD_NORM_VALUE, c.grad_norm);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_is_zero_for_equal_log_probs_and_grows_with_the_gap() {
        let mut same = Mismatch::default();
        for lp in [-0.1f32, -2.0, -7.5] {
            same.add(lp, lp);
        }
        assert_eq!(same.tokens, 3);
        assert_eq!(
            (same.abs_mean(), same.abs_max, same.kl()),
            (Some(0.0), 0.0, Some(0.0))
        );
        let mut apart = Mismatch::default();
        apart.add(-1.0, -1.5);
        apart.add(-2.0, -1.9);
        assert_eq!(apart.tokens, 2);
        assert!((apart.abs_mean().unwrap() - 0.3).abs() < 1e-6);
        assert!((apart.abs_max - 0.5).abs() < 1e-6);
        let k3 = |r: f64| r.exp() - 1.0 - r;
        let want = (k3(0.5) + k3(-0.1)) / 2.0;
        assert!(
            (apart.kl().unwrap() - want).abs() < 1e-6,
            "{:?}",
            apart.kl()
        );
        let mut merged = same;
        merged.merge(&apart);
        assert_eq!(merged.tokens, 5);
        assert!((merged.abs_max - 0.5).abs() < 1e-6);
        // A token with a non-finite log-prob (a masked one) is not compared.
        apart.add(f32::NEG_INFINITY, -1.0);
        assert_eq!(apart.tokens, 2);
        assert_eq!(Mismatch::default().kl(), None);
    }
}
