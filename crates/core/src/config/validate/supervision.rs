//! Phase two of `[supervision]` and `[faults]`.

use crate::config::check::{Ctx, optional_seconds, positive_seconds, u64_incl_zero};
use crate::config::error::ConfigError;
use crate::config::raw::{RawFaults, RawSupervision};
use crate::config::typed::{FaultsConfig, SupervisionConfig};

pub(crate) fn validate_supervision(
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

pub(crate) fn validate_faults(raw: RawFaults, ctx: &Ctx<'_>) -> Result<FaultsConfig, ConfigError> {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::parse;

    fn load(text: &str) -> Result<crate::config::Config, String> {
        parse(text, "t.toml", &[], &|_| None).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_off_and_round_trip() {
        let c = load("").unwrap();
        assert!(!c.faults.any());
        assert_eq!(
            c.supervision.engine_watchdog,
            Some(Duration::from_secs(300))
        );
        assert_eq!(c.supervision.checkpoint_every_steps, 0);
        let again = load(&c.to_toml()).unwrap();
        assert_eq!(again.supervision, c.supervision);
        assert_eq!(again.faults, c.faults);
        let off = load("[supervision]\nengine_watchdog_s = 0").unwrap();
        assert_eq!(off.supervision.engine_watchdog, None);
        assert_eq!(load(&off.to_toml()).unwrap().supervision, off.supervision);
    }

    #[test]
    fn bad_values_name_the_key() {
        for (text, key) in [
            (
                "[supervision]\nrestart_backoff_max_s = 0.01",
                "supervision.restart_backoff_max_s",
            ),
            (
                "[supervision]\nrestart_backoff_initial_s = 0",
                "supervision.restart_backoff_initial_s",
            ),
            (
                "[supervision]\nengine_watchdog_s = -1",
                "supervision.engine_watchdog_s",
            ),
            (
                "[supervision]\nshutdown_timeout_s = 0",
                "supervision.shutdown_timeout_s",
            ),
            (
                "[faults]\ntrainer_error_at_step = -2",
                "faults.trainer_error_at_step",
            ),
            (
                "[supervision]\nenv_step_timeout_s = 0",
                "supervision.env_step_timeout_s",
            ),
            (
                "[faults]\nenv_hang_every_steps = -1",
                "faults.env_hang_every_steps",
            ),
            (
                "[faults]\nreward_panic_every_episodes = 1.5",
                "faults.reward_panic_every_episodes",
            ),
            (
                "[faults]\nengine_crash_every = 3",
                "faults.engine_crash_every",
            ),
        ] {
            let err = load(text).unwrap_err();
            assert!(err.contains(key), "{text}: {err}");
        }
        let c = load("[faults]\nengine_crash_every_requests = 5").unwrap();
        assert!(c.faults.any());
        let c = load("[faults]\nenv_panic_every_steps = 7").unwrap();
        assert_eq!(c.faults.env_panic_every_steps, 7);
        assert!(c.faults.any());
        assert_eq!(
            load("").unwrap().supervision.env_step_timeout,
            Duration::from_secs(300)
        );
    }
}
