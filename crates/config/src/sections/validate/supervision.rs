//! Phase two of `[supervision]` and `[faults]`.

use sluice_core::config::ConfigError;
use sluice_core::config::check::{Ctx, optional_seconds, positive_seconds, u64_incl_zero};

use crate::sections::raw::{RawFaults, RawSupervision};
use crate::sections::typed::{FaultsConfig, SupervisionConfig};

/// Phase two of `[supervision]`.
pub fn validate_supervision(
    raw: RawSupervision,
    ctx: &Ctx<'_>,
) -> Result<SupervisionConfig, ConfigError> {
    let restart_backoff_initial = positive_seconds(
        ctx,
        "supervision.restart_backoff_initial_s",
        raw.restart_backoff_initial_s,
    )?;
    let restart_backoff_max = positive_seconds(
        ctx,
        "supervision.restart_backoff_max_s",
        raw.restart_backoff_max_s,
    )?;
    if restart_backoff_max < restart_backoff_initial {
        return Err(ctx.value(
            "supervision.restart_backoff_max_s",
            format!(
                "expected at least restart_backoff_initial_s ({}), got {}",
                raw.restart_backoff_initial_s, raw.restart_backoff_max_s
            ),
        ));
    }
    Ok(SupervisionConfig {
        restart_backoff_initial,
        restart_backoff_max,
        engine_watchdog: optional_seconds(
            ctx,
            "supervision.engine_watchdog_s",
            raw.engine_watchdog_s,
        )?,
        checkpoint_every_steps: u64_incl_zero(
            ctx,
            "supervision.checkpoint_every_steps",
            raw.checkpoint_every_steps,
        )?,
        shutdown_timeout: positive_seconds(
            ctx,
            "supervision.shutdown_timeout_s",
            raw.shutdown_timeout_s,
        )?,
        env_step_timeout: positive_seconds(
            ctx,
            "supervision.env_step_timeout_s",
            raw.env_step_timeout_s,
        )?,
        engine_max_restarts: u64_incl_zero(
            ctx,
            "supervision.engine_max_restarts",
            raw.engine_max_restarts,
        )?,
        engine_unavailable_timeout: optional_seconds(
            ctx,
            "supervision.engine_unavailable_timeout_s",
            raw.engine_unavailable_timeout_s,
        )?,
        no_progress_groups: u64_incl_zero(
            ctx,
            "supervision.no_progress_groups",
            raw.no_progress_groups,
        )?,
    })
}

/// Phase two of `[faults]`.
pub fn validate_faults(raw: RawFaults, ctx: &Ctx<'_>) -> Result<FaultsConfig, ConfigError> {
    let RawFaults {
        engine_crash_every_requests,
        engine_hang_every_requests,
        trainer_error_at_step,
        trainer_panic_at_step,
        trainer_skip_every_steps,
        env_panic_every_steps,
        env_hang_every_steps,
        reward_panic_every_episodes,
    } = raw;
    let period = |key: &str, v: i64| u64_incl_zero(ctx, &format!("faults.{key}"), v);
    Ok(FaultsConfig {
        engine_crash_every_requests: period(
            "engine_crash_every_requests",
            engine_crash_every_requests,
        )?,
        engine_hang_every_requests: period(
            "engine_hang_every_requests",
            engine_hang_every_requests,
        )?,
        trainer_error_at_step: period("trainer_error_at_step", trainer_error_at_step)?,
        trainer_panic_at_step: period("trainer_panic_at_step", trainer_panic_at_step)?,
        trainer_skip_every_steps: period("trainer_skip_every_steps", trainer_skip_every_steps)?,
        env_panic_every_steps: period("env_panic_every_steps", env_panic_every_steps)?,
        env_hang_every_steps: period("env_hang_every_steps", env_hang_every_steps)?,
        reward_panic_every_episodes: period(
            "reward_panic_every_episodes",
            reward_panic_every_episodes,
        )?,
    })
}
