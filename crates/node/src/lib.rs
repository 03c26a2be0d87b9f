//! A Sluice node (`DESIGN.md` §3): builds the actors of [`sluice_actors`], starts and supervises
//! them, runs a training run from start to finish, and serves what operators and other nodes talk
//! to.
//!
//! | module | role |
//! |---|---|
//! | [`node`] | [`Node`]: builds and starts the pipeline in [`Stage`]s that unwind on failure, the restart policy table |
//! | [`checkpoints`] | restore at start, checkpoints (on request, periodic, final) |
//! | [`graceful_stop`] | the graceful stop: drain, checkpoint, report |
//! | [`run`] | a run's lifecycle: monitoring, evaluations, how it ends |
//! | [`native`] | setup for native runs: the model, tokenizer, renderer, warm-up and evaluation |
//! | [`admin`] | admin HTTP API: `GET/PATCH /v1/knobs`, `GET /v1/status`, `GET /metrics` |
//! | [`handles`] | the typed handles the node keeps to its actors, and its status |
//! | [`client`] | a small blocking HTTP client for the admin API (`sluice knobs`) |
//! | [`cluster`] | head / engine / env nodes: membership registry, weights over HTTP, joining a head |
//! | [`telemetry`] | metrics: exporter install, periodic gauges and upkeep |
//!
//! The layering is one way: this crate uses the actors; the actors know nothing of the node.

pub mod admin;
pub mod checkpoints;
pub mod client;
pub mod cluster;
pub mod graceful_stop;
pub mod handles;
pub mod native;
pub mod node;
pub mod reward_models;
pub mod run;
pub mod telemetry;

pub use node::{Node, NodeOptions, NodeStatus, Stage};
