//! The benchmarks behind `sluice bench`. Each module takes its command-line settings (defined
//! here, with their flags, and parsed by the binary) and prints a table and a `RESULT` line of
//! numbers measured in one run: ratios between rows of one run are what to compare, since the
//! machine the numbers come from is shared and noisy.
//!
//! This crate is a command implementation, not an API: its errors are `anyhow` reports for the
//! terminal, as the binary's are.

pub mod cluster;
pub mod engine;
pub mod kernels;
pub mod model;
pub mod pipeline;
pub mod reward;
pub mod rss;
mod sampling;
pub mod subject;
mod swaps;
pub mod trainer;
pub mod weights;

pub use cluster::BenchClusterArgs;
pub use engine::BenchEngineArgs;
pub use kernels::BenchKernelsArgs;
pub use model::BenchModelArgs;
pub use pipeline::BenchPipelineArgs;
pub use reward::BenchRewardModelArgs;
pub use subject::Subject;
pub use trainer::BenchTrainerArgs;
pub use weights::BenchWeightsArgs;

/// The median of `xs` (the upper one of an even count): what the benchmarks report of repeated
/// timings, so one slow or lucky run does not move it.
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// `--device`: `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<sluice_config::Device, String> {
    s.parse()
        .map_err(|()| format!("expected cpu, cuda or cuda:N, got `{s}`"))
}

/// `--dtype`: a `model.dtype` name (`f32`, `bf16` or `f16`), read from the enum's serde names.
pub fn parse_dtype(s: &str) -> Result<sluice_config::DType, String> {
    sluice_core::choice::Choice::parse(s)
}
