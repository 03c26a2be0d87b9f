//! Datasets and the domain-weighted sampler of Sluice (`DESIGN.md` §1, seed 000).
//!
//! | module | what it holds |
//! |---|---|
//! | [`dataset`] | [`Dataset`]: JSONL files named `domain::name[@split]` → [`sluice_core::DataSample`]s, bad lines reported and counted |
//! | [`sampler`] | [`DomainSampler`]: adaptive domain-weighted sampling toward the live `domain_mix`, per-domain system prompts and task dispatch, checkpointable |
//! | [`rng`] | [`rng::Rng`]: a small seeded generator whose whole state serializes, so a restored sampler continues exactly |
//! | [`error`] | [`DataError`] and its stable `kind()` names |
//!
//! Pure logic: no actors, no threads, no clocks. The pipeline's `DatasetSampler` actor wraps
//! [`DomainSampler`] and feeds it completions.

pub mod dataset;
pub mod error;
pub mod rng;
pub mod sampler;

pub use dataset::{BadLine, Dataset, dataset_path};
pub use error::DataError;
pub use sampler::{DomainMixEntry, DomainOptions, DomainSampler, SamplerConfig, SamplerState};
