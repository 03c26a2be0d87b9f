//! Shared helpers of the pipeline tests: a fast simulated config and invariant checks.

#![allow(dead_code)]

use sluice_actors::NodeStatus;
use sluice_core::Config;

/// A small, fast simulated pipeline; `extra` is appended (later keys win via sections given once).
pub fn config(rollout_extra: &str, sim_extra: &str) -> Config {
    let text = format!(
        r#"
[run]
name = "test"
max_steps = 6
seed = 7

[engine]
backend = "simulated"
max_running_sequences = 16
replicas = 2

[engine.simulated]
prompt_tokens = 8
env_reply_tokens = 2
decode_step_base_seconds = 0.0005
decode_step_per_sequence_seconds = 0.0
prefill_seconds_per_token = 0.0
{sim_extra}

[engine.simulated.lengths.default]
distribution = "uniform"
min = 4
max = 60

[trainer.simulated]
step_base_seconds = 0.002
step_seconds_per_token = 0.0

[rollout]
group_size = 3
groups_per_step = 4
max_new_tokens = 64
{rollout_extra}

[replay]
filter_zero_advantage = false
"#
    );
    sluice_core::config::parse(&text, "test.toml", &[], &|_| None).expect("test config is valid")
}

/// The invariants every run must keep.
pub fn check_invariants(status: &NodeStatus) {
    let t = &status.trainer;
    assert_eq!(
        t.lag_violations, 0,
        "trained tokens older than η: {status:#?}"
    );
    assert_eq!(t.duplicate_groups, 0, "a group was trained twice");
    let c = &status.replay.counters;
    let buckets: u64 = status.replay.buckets.values().sum();
    assert_eq!(
        buckets, c.admitted_total,
        "every admitted group is in exactly one bucket: {:?}",
        status.replay
    );
    assert_eq!(
        status.replay.buckets["consumed"], t.trained_groups,
        "consumed = trained"
    );
}
