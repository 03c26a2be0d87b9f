//! Datasets and the domain-weighted sampler of Sluice (`DESIGN.md` §1, seed 000).
//!
//! | module | what it holds |
//! |---|---|
//! | [`dataset`] | [`Dataset`]: JSONL and Parquet files named `domain::name[@split]` → [`sluice_core::DataSample`]s, bad lines reported and counted |
//! | [`sampler`] | [`MixSampler`]: adaptive domain-weighted sampling toward the live `domain_mix` over any [`DomainRows`], per-domain system prompts and task dispatch, checkpointable; [`DomainSampler`] is it over datasets |
//! | [`rows`] | row sources: [`DatasetRows`] (shuffled per epoch) and [`GeneratorRows`] (made on demand, e.g. synthetic) |
//! | [`source`] | [`SampleSource`]: the seam the pipeline draws samples through; [`SimSource`], synthetic samples of simulated runs |
//! | [`rng`] | [`rng::Rng`]: a small seeded generator whose whole state serializes, so a restored sampler continues exactly |
//! | [`error`] | [`DataError`] and its stable `kind()` names |
//! | [`config`] | the `[data]` config section: raw → [`validate_data`](config::validate_data) → [`DataConfig`](config::DataConfig) |
//!
//! Pure logic: no actors, no threads, no clocks. The pipeline's `DatasetSampler` actor wraps
//! a [`MixSampler`] and feeds it completions.

pub mod config;
pub mod dataset;
pub mod error;
mod parquet_rows;
pub mod rng;
pub mod rows;
pub mod sampler;
pub mod source;

pub use dataset::{BadLine, Dataset, ReadLimits, dataset_file, dataset_path};
pub use error::DataError;
pub use rows::{DatasetRows, DomainCursor, GeneratorRows, RowGenerator};
pub use sampler::{
    DomainCounts, DomainMixEntry, DomainOptions, DomainRows, DomainSampler, MixSampler,
    SamplerConfig, SamplerState,
};
pub use source::{SampleSource, SimSource};
