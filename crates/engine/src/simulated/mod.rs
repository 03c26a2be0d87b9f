//! Simulated backends: real components that model time instead of computing.
//!
//! - [`SimEngine`]: continuous batching on a dedicated thread; a step costs
//!   `prefill · new_prompt_tokens + a + b · running_sequences` simulated seconds, run in scaled real
//!   time; completion lengths come from a per-domain distribution; tokens carry the version that
//!   produced them; aborts return honest partials.
//! - [`SimTrainer`]: a step costs `c + d · tokens` and publishes `version + 1`.
//! - [`SimTask`]: a token-level task with a configured number of turns and seeded rewards.
//!
//! Everything is seeded; a run is reproducible up to thread timing.

mod engine;
mod rng;
mod task;
mod trainer;

pub use engine::{SimEngine, SimEngineParams};
pub use rng::{SplitMix64, mix};
pub use task::{SimTask, TaskStep};
pub use trainer::SimTrainer;
