//! Demand-aware admission (`admission = "demand"`, DESIGN §4.1) on a trainer-bound simulated run:
//! with η = 4 plain AReaL admission keeps η batches waiting, so the trainer learns from data about
//! η versions old; demand admission keeps only what the trainer eats while new groups generate,
//! so the same run trains at a lag near 1, η staying the hard ceiling. The lags and trainer idle
//! ratios are printed (`-- --nocapture`); only lags are asserted. `replay.capacity` bounds the
//! same trainer-bound run by a group count instead.

use crate::common;

use std::time::Duration;

use sluice_core::{AdmissionMode, KnobPatch};
use sluice_node::{Node, NodeOptions, NodeStatus};

async fn run(admission: AdmissionMode) -> NodeStatus {
    let rollout = format!(
        "max_version_lag = 4\nweight_update_mode = \"in_flight\"\nadmission = \"{admission}\""
    );
    // Groups take a few decode steps of 0.5 ms; a training step takes 150 ms: trainer-bound even
    // when the other tests of the binary (or a build) share the two cores with the engine.
    let mut config = common::config(&rollout, "time_scale = 1.0");
    config.run.max_steps = std::num::NonZeroU64::new(40).unwrap();
    config.trainer.simulated.step_base_seconds = 0.15;
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    let s = node
        .wait_done(Duration::from_secs(120), |_| {})
        .await
        .unwrap();
    common::check_invariants(&s);
    node.shutdown().await;
    println!(
        "admission {admission}: mean lag {:.2}, max {}, trainer idle {:.3}, demand {}, holds {}",
        s.trainer.mean_lag(),
        s.trainer.max_lag,
        s.trainer.idle_ratio(),
        s.controller.pace.demand_groups,
        s.controller.demand_holds
    );
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demand_admission_trains_fresher_data_than_eta_on_a_trainer_bound_run() {
    let eta = run(AdmissionMode::Eta).await;
    let demand = run(AdmissionMode::Demand).await;
    assert!(eta.trainer.mean_lag() >= 2.5, "η admission runs η ahead");
    assert_eq!(eta.controller.demand_holds, 0);
    assert!(
        demand.trainer.mean_lag() <= 1.5,
        "demand admission: mean lag {} (η admission: {})",
        demand.trainer.mean_lag(),
        eta.trainer.mean_lag()
    );
    assert!(demand.controller.demand_holds > 0);
    assert!(demand.controller.pace.group_seconds.is_some());
    assert!(demand.controller.pace.train_step_seconds.is_some());
    assert!(demand.trainer.max_lag <= 4, "η stays the ceiling");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admission_knob_switches_live() {
    let mut config = common::config("max_version_lag = 2", "time_scale = 1.0");
    config.run.max_steps = std::num::NonZeroU64::new(1000).unwrap();
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    assert_eq!(
        node.handles.knobs.current().admission,
        AdmissionMode::Demand
    );
    let patch = KnobPatch::from_assignments(&["admission=eta"]).unwrap();
    node.handles.knobs.update(&patch).unwrap();
    assert_eq!(node.handles.knobs.current().admission, AdmissionMode::Eta);
    let bad = KnobPatch::from_assignments(&["admission=sometimes"]).unwrap_err();
    assert_eq!(
        bad.to_string(),
        "admission: expected one of demand, eta, got `sometimes`"
    );
    // The run trains on under the switched rule.
    let steps = node.status().await.unwrap().trainer.steps;
    common::wait_for_status(
        &node,
        "a step after the switch",
        Duration::from_secs(20),
        |s| s.trainer.steps > steps,
    )
    .await;
    node.shutdown().await;
}

/// `replay.capacity` on the trainer-bound run that plain η admission fills η batches deep: the
/// groups admitted and not yet trained never pass the bound, admission is held at it, and the
/// run still trains to the end (no group is evicted to make room).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_capacity_bounds_the_groups_held_and_the_run_goes_on() {
    let rollout = "max_version_lag = 4\nweight_update_mode = \"in_flight\"\nadmission = \"eta\"";
    let mut config = common::config(rollout, "time_scale = 1.0");
    config.run.max_steps = std::num::NonZeroU64::new(20).unwrap();
    config.trainer.simulated.step_base_seconds = 0.03;
    let capacity = 6; // groups_per_step = 4
    config.replay.capacity = std::num::NonZeroU64::new(capacity);
    let node = Node::start(&config, NodeOptions::default()).await.unwrap();
    let mut most = 0;
    let s = node
        .wait_done(Duration::from_secs(120), |s| {
            most = most.max(s.controller.pending_groups)
        })
        .await
        .unwrap();
    common::check_invariants(&s);
    node.shutdown().await;
    println!(
        "capacity {capacity}: most pending {most}, holds {}, mean lag {:.2}",
        s.controller.capacity_holds,
        s.trainer.mean_lag()
    );
    assert_eq!(s.trainer.steps, 20);
    assert!(
        most <= capacity,
        "{most} groups held past the capacity {capacity}"
    );
    assert!(s.controller.capacity_holds > 0, "η alone would admit more");
    assert!(s.trainer.max_lag <= 4);
}
