//! The benchmarks behind `sluice bench`. Each module takes its command-line settings (defined
//! here, with their flags, and parsed by the binary) and prints a table and a `RESULT` line of
//! numbers measured in one run: ratios between rows of one run are what to compare, since the
//! machine the numbers come from is shared and noisy.
//!
//! This crate is a command implementation, not an API: its errors are `anyhow` reports for the
//! terminal, as the binary's are.

pub mod cluster;
pub mod engine;
pub mod model;
pub mod pipeline;
pub mod rss;
pub mod trainer;
pub mod weights;

pub use cluster::BenchClusterArgs;
pub use engine::BenchEngineArgs;
pub use model::BenchModelArgs;
pub use pipeline::BenchPipelineArgs;
pub use trainer::BenchTrainerArgs;
pub use weights::BenchWeightsArgs;
