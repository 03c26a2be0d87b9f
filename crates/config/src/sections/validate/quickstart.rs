//! Phase two of `[warmup]` and `[eval]`.

use sluice_core::config::ConfigError;
use sluice_core::config::Device;
use sluice_core::config::check::{
    Ctx, choice, fraction, non_zero_u32, non_zero_u64, number, positive, u64_incl_zero,
};

use crate::sections::raw::{RawEval, RawWarmup};
use crate::sections::typed::{EvalConfig, WarmupConfig};

/// Phase two of `[warmup]`.
pub fn validate_warmup(raw: RawWarmup, ctx: &Ctx<'_>) -> Result<WarmupConfig, ConfigError> {
    Ok(WarmupConfig {
        enabled: raw.enabled,
        max_steps: non_zero_u64(ctx, "warmup.max_steps", raw.max_steps)?,
        batch_size: non_zero_u32(ctx, "warmup.batch_size", raw.batch_size)?,
        learning_rate: positive(ctx, "warmup.learning_rate", raw.learning_rate)?,
        target_accuracy: fraction(ctx, "warmup.target_accuracy", raw.target_accuracy)?,
        probe: choice(ctx, "warmup.probe", &raw.probe)?,
        check_every: non_zero_u64(ctx, "warmup.check_every", raw.check_every)?,
        probe_samples: non_zero_u32(ctx, "warmup.probe_samples", raw.probe_samples)?,
    })
}

/// Phase two of `[eval]`; `device` is `eval.device` resolved.
pub fn validate_eval(
    raw: RawEval,
    device: Device,
    ctx: &Ctx<'_>,
) -> Result<EvalConfig, ConfigError> {
    let task = match raw.task {
        Some(t) if t.trim().is_empty() => {
            return Err(ctx.value("eval.task", "expected a task name, got an empty string"));
        }
        t => t,
    };
    Ok(EvalConfig {
        every_steps: u64_incl_zero(ctx, "eval.every_steps", raw.every_steps)?,
        samples: non_zero_u32(ctx, "eval.samples", raw.samples)?,
        temperature: number(
            ctx,
            "eval.temperature",
            raw.temperature,
            "a number ≥ 0 (0 = greedy)",
            |v| v >= 0.0,
        )?,
        samples_per_problem: non_zero_u32(
            ctx,
            "eval.samples_per_problem",
            raw.samples_per_problem,
        )?,
        sample_temperature: number(
            ctx,
            "eval.sample_temperature",
            raw.sample_temperature,
            "a number > 0 (k replies of one problem must differ)",
            |v| v > 0.0,
        )?,
        stop_at_accuracy: raw
            .stop_at_accuracy
            .map(|v| fraction(ctx, "eval.stop_at_accuracy", v))
            .transpose()?,
        task,
        device,
    })
}
