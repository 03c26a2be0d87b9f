//! Simulated backends: real components that model time instead of computing.
//!
//! - [`SimEngine`]: continuous batching on a dedicated thread; a step costs
//!   `prefill · new_prompt_tokens + a + b · running_sequences` simulated seconds, run in scaled real
//!   time; completion lengths come from a per-domain distribution; tokens carry the version that
//!   produced them; aborts return honest partials.
//!
//! The simulated task (the environment side) lives in `sluice_env::simulated`, the simulated
//! trainer in `sluice_trainer::simulated`.
//!
//! Everything is seeded; a run is reproducible up to thread timing.

mod engine;

pub use engine::{SimEngine, SimEngineParams};
pub use sluice_core::rng::{SplitMix64, mix};

pub(crate) use sluice_core::sim::real_duration;
