//! `[supervision]` and `[faults]`: defaults, round trips and bad values naming their key.

use std::time::Duration;

use sluice_config::parse;

fn load(text: &str) -> Result<sluice_config::Config, String> {
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
