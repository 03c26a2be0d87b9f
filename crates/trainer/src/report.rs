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
    /// Clipping and AdamW updates.
    pub optimizer: f64,
    /// The published snapshot of the new weights.
    pub publish: f64,
}

impl StepParts {
    /// `(name, seconds)` of every part, in step order.
    pub fn named(&self) -> [(&'static str, f64); 7] {
        [
            ("packing", self.packing),
            ("scoring", self.scoring),
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
        put(m::TRAINER_SKIPPED_STEPS, 1.0);
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
    out
}
