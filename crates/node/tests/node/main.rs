//! The node's integration tests, in one test binary: every binary is another link of the whole
//! node on CI's two cores, so the areas are modules here (run one with
//! `cargo test -p sluice-node --test node <module>::`). `/metrics` keeps its own binary
//! (`metrics_scrape.rs`): the Prometheus recorder is global to the process.

mod common;

mod admin_api;
mod admin_http;
mod admin_prop;
mod configured_envs;
mod configured_rubric_pipeline;
mod demand_admission;
mod domain_evaluations;
mod engine_remote;
mod engine_routing;
mod env_pool;
mod eval_preemption;
mod faults;
mod invariants;
mod liveness;
mod modes;
mod multi_domain;
mod native_pipeline;
mod recovery;
mod restart;
mod reward_models;
mod run_monitor;
mod smoke;
mod supervision;
mod vacant_wake;
