//! Property test over random workloads with random knob changes mid-run: no trained token older
//! than η at training time, no group trained twice, every admitted group in exactly one bucket,
//! and the counts reconcile.

use crate::common;

use std::time::Duration;

use proptest::prelude::*;
use sluice_core::{KnobPatch, WeightUpdateMode};
use sluice_node::{Node, NodeOptions};

fn mode() -> impl Strategy<Value = WeightUpdateMode> {
    prop_oneof![
        Just(WeightUpdateMode::AbortResume),
        Just(WeightUpdateMode::InFlight),
        Just(WeightUpdateMode::Drain)
    ]
}

fn patch() -> impl Strategy<Value = KnobPatch> {
    (
        proptest::option::of(0.0f64..1.5),
        proptest::option::of(0u64..4),
        proptest::option::of(any::<bool>()),
        proptest::option::of(0u32..3),
        proptest::option::of(1u32..5),
        proptest::option::of(mode()),
        proptest::option::of(1u32..24),
    )
        .prop_map(|(s, eta, partial, k, trigger, mode, cap)| KnobPatch {
            staleness_threshold: s,
            max_version_lag: eta,
            enable_partial_rollout: partial,
            tail_batch_candidate_steps: k,
            tail_batch_trigger_size: trigger,
            weight_update_mode: mode,
            max_concurrent_rollouts: cap,
            ..KnobPatch::default()
        })
}

#[derive(Debug, Clone)]
struct Workload {
    group_size: u32,
    groups_per_step: u32,
    replicas: u32,
    max_running: u32,
    max_len: u32,
    turns: u32,
    drop_expired: bool,
    initial: KnobPatch,
    changes: Vec<(u64, KnobPatch)>,
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        (
            2u32..4,
            1u32..5,
            1u32..3,
            2u32..12,
            8u32..80,
            1u32..3,
            any::<bool>(),
        ),
        patch(),
        proptest::collection::vec((1u64..6, patch()), 0..4),
    )
        .prop_map(
            |(
                (group_size, groups_per_step, replicas, max_running, max_len, turns, drop_expired),
                initial,
                changes,
            )| {
                Workload {
                    group_size,
                    groups_per_step,
                    replicas,
                    max_running,
                    max_len,
                    turns,
                    drop_expired,
                    initial,
                    changes,
                }
            },
        )
}

fn run(w: Workload) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let text = format!(
            r#"
[run]
name = "prop"
max_steps = 6
[engine]
backend = "simulated"
replicas = {replicas}
max_running_sequences = {max_running}
[engine.simulated]
prompt_tokens = 4
env_reply_tokens = 1
decode_step_base_seconds = 0.0002
decode_step_per_sequence_seconds = 0.0
prefill_seconds_per_token = 0.0
[engine.simulated.lengths.default]
distribution = "uniform"
min = 1
max = {max_len}
[trainer.simulated]
step_base_seconds = 0.001
step_seconds_per_token = 0.0
[rollout]
group_size = {group_size}
groups_per_step = {groups_per_step}
max_turns = {turns}
max_new_tokens = 64
[replay]
expired = "{expired}"
filter_zero_advantage = true
"#,
            replicas = w.replicas,
            max_running = w.max_running,
            max_len = w.max_len,
            group_size = w.group_size,
            groups_per_step = w.groups_per_step,
            turns = w.turns,
            expired = if w.drop_expired { "drop" } else { "regenerate" },
        );
        let config = sluice_config::parse(&text, "prop.toml", &[], &|_| None).unwrap();
        let node = Node::start(
            &config,
            NodeOptions {
                track_ids: true,
                ..NodeOptions::default()
            },
        )
        .await
        .unwrap();
        let knobs = node.handles.knobs.clone();
        knobs
            .update(&w.initial)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut changes = w.changes.clone();
        changes.sort_by_key(|(step, _)| *step);
        let mut next = 0;
        let result = node
            .wait_done(Duration::from_secs(20), |status| {
                while next < changes.len() && status.trainer.steps >= changes[next].0 {
                    knobs.update(&changes[next].1).unwrap();
                    next += 1;
                }
            })
            .await;
        let status = match result {
            Ok(s) => s,
            Err(e) => {
                let s = node.status().await;
                return Err(TestCaseError::fail(format!("{e}: {s:#?}")));
            }
        };
        common::check_invariants(&status);
        let ids = node.handles.trainer.trained_ids();
        let unique: std::collections::HashSet<_> = ids.iter().collect();
        prop_assert_eq!(unique.len(), ids.len(), "a group was trained twice");
        let last = node.shutdown().await.expect("replay status at shutdown");
        let buckets: u64 = last.store.buckets.values().sum();
        prop_assert_eq!(
            buckets,
            last.store.counters.admitted_total,
            "counts reconcile at the end"
        );
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20, max_shrink_iters: 0, ..ProptestConfig::default() })]
    #[test]
    fn random_workloads_with_live_knob_changes_keep_the_invariants(w in workload()) {
        run(w)?;
    }
}
