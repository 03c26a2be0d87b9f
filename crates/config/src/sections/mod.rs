//! The node-level sections: `[run]`, `[rollout]`, `[metrics]`, `[admin]`, `[warmup]`, `[eval]`,
//! `[supervision]`, `[faults]` and `[node]`. They describe the node's composition (its actors,
//! endpoints, restarts and role across machines) rather than one library crate's work, so they
//! live with the composition; each is raw (serde, defaults) → `validate_*` → typed, built from
//! `sluice_core::config::check` like the sections the library crates own.

pub(crate) mod bounds;
pub mod raw;
mod typed;
pub mod validate;

pub use typed::*;
