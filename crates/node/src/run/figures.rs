//! The `metrics.jsonl` keys of a step beyond the record's own fields: the trainer's figures
//! (entropy, clipping, KL, importance weights, the gradient's norm, …), what the run's rollouts
//! look like per domain, the length bias and the train/inference mismatch
//! (`sluice_report::keys`).
//! Shapes and the bias come from the controller's view at the monitor's last look (windowed
//! figures, not the step's alone); the trained mean and the mismatch are the step's own.

use std::collections::BTreeMap;

use sluice_actors::controller::{DomainShapeStatus, LengthBiasStatus};
use sluice_actors::trainer::{MismatchStatus, StepEvent};
use sluice_report::keys as k;

/// The controller's figures as of the monitor's last look.
#[derive(Debug, Clone, Default)]
pub(super) struct Shapes {
    /// Each domain's rollouts.
    pub domains: BTreeMap<String, DomainShapeStatus>,
    /// Generated against trained lengths.
    pub length_bias: Option<LengthBiasStatus>,
}

/// The run-wide figures the plot draws: group times weighted by each domain's timed groups,
/// the truncated ratio by each domain's window of rollouts.
fn add_run_wide(put: &mut impl FnMut(String, f64), shapes: &Shapes) {
    let weighted = |weight: &dyn Fn(&DomainShapeStatus) -> f64,
                    value: &dyn Fn(&DomainShapeStatus) -> Option<f64>| {
        let (sum, weights) = shapes
            .domains
            .values()
            .filter_map(|s| value(s).map(|v| (v * weight(s), weight(s))))
            .fold((0.0, 0.0), |(a, b), (v, w)| (a + v, b + w));
        (weights > 0.0).then(|| sum / weights)
    };
    let timed = |s: &DomainShapeStatus| s.timed_groups as f64;
    for (key, value) in [
        (
            k::TIME_GROUP_SECONDS,
            weighted(&timed, &|s| s.group_seconds),
        ),
        (
            k::TIME_ENGINE_SECONDS,
            weighted(&timed, &|s| s.engine_seconds),
        ),
        (k::TIME_ENV_SECONDS, weighted(&timed, &|s| s.env_seconds)),
        (
            k::TRUNCATED_RATIO,
            weighted(&|s| s.window_rollouts as f64, &|s| Some(s.truncated_ratio)),
        ),
    ] {
        if let Some(v) = value {
            put(key.into(), v);
        }
    }
}

/// Adds `step`'s trainer, rollout, length and mismatch keys to `extra`.
pub(super) fn add(extra: &mut BTreeMap<String, f64>, step: &StepEvent, shapes: &Shapes) {
    let mut put = |key: String, v: f64| {
        if v.is_finite() {
            extra.insert(key, v);
        }
    };
    let trained = &step.response_tokens;
    if !trained.is_empty() {
        let sum: f64 = trained.iter().map(|&n| f64::from(n)).sum();
        put(k::LENGTH_TRAINED_MEAN.into(), sum / trained.len() as f64);
    }
    if let Some(b) = &shapes.length_bias {
        put(k::LENGTH_GENERATED_MEAN.into(), b.generated_mean);
        put(k::LENGTH_BIAS.into(), b.bias_ratio);
        put(k::LENGTH_KS_DISTANCE.into(), b.ks_distance);
    }
    add_run_wide(&mut put, shapes);
    for (domain, s) in &shapes.domains {
        let key = |figure: &str| format!("{}{domain}.{figure}", k::ROLLOUT_PREFIX);
        put(key("response_tokens_mean"), s.response_tokens_mean);
        put(key("response_tokens_p90"), f64::from(s.response_tokens_p90));
        put(key("turns_mean"), s.turns_mean);
        put(key("truncated_ratio"), s.truncated_ratio);
        for (figure, v) in [
            ("group_seconds", s.group_seconds),
            ("engine_seconds", s.engine_seconds),
            ("env_seconds", s.env_seconds),
        ] {
            if let Some(v) = v {
                put(key(figure), v);
            }
        }
    }
    for (key, metric) in k::TRAINER_FIGURES {
        if let Some(&v) = step.metrics.get(*metric) {
            put((*key).into(), v);
        }
    }
    if let Some(m) = MismatchStatus::of(step.step, &step.metrics) {
        put(k::MISMATCH_TOKENS.into(), m.tokens as f64);
        put(k::MISMATCH_LOGPROB_ABS_MEAN.into(), m.logprob_abs_mean);
        put(k::MISMATCH_LOGPROB_ABS_MAX.into(), m.logprob_abs_max);
        put(k::MISMATCH_KL.into(), m.kl);
    }
}
