//! Errors of the data crate; each names the file, line or domain at fault.

use std::path::PathBuf;

/// Anything loading or sampling data can refuse.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A dataset file could not be read.
    #[error("dataset `{dataset}`: cannot read {}: {cause}", path.display())]
    Io {
        /// The dataset spec.
        dataset: String,
        /// The file.
        path: PathBuf,
        /// The I/O error. Part of the message, deliberately not a `source`: a reporter that
        /// prints the chain (`{:#}`) would print the OS error twice.
        cause: std::io::Error,
    },
    /// A dataset file is not a regular file (a device, a FIFO) or is larger than
    /// `data.max_file_bytes`.
    #[error("dataset `{dataset}`: cannot read {cause}")]
    File {
        /// The dataset spec.
        dataset: String,
        /// What was wrong with the file (it names the file).
        cause: sluice_core::files::ReadFileError,
    },
    /// A line did not parse and `data.on_bad_line = "fail"`.
    #[error("dataset `{dataset}`: {}:{line}: {reason}", path.display())]
    BadLine {
        /// The dataset spec.
        dataset: String,
        /// The file.
        path: PathBuf,
        /// 1-based line number (row number in a Parquet file).
        line: usize,
        /// What was wrong with it.
        reason: String,
    },
    /// A Parquet dataset file could not be decoded (its footer, schema or pages).
    #[error("dataset `{dataset}`: {}: {reason}", path.display())]
    Parquet {
        /// The dataset spec.
        dataset: String,
        /// The file.
        path: PathBuf,
        /// What the reader said.
        reason: String,
    },
    /// The sampler was configured inconsistently (unknown domain, no data, …).
    #[error("sampler: {0}")]
    Config(String),
    /// A checkpointed sampler state does not fit the datasets it is restored onto.
    #[error("sampler state does not match the datasets: {0}")]
    StateMismatch(String),
}

impl DataError {
    /// Short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            DataError::Io { .. } => "data_io",
            DataError::File { .. } => "data_file",
            DataError::BadLine { .. } => "data_bad_line",
            DataError::Parquet { .. } => "data_parquet",
            DataError::Config(_) => "sampler_config",
            DataError::StateMismatch(_) => "sampler_state_mismatch",
        }
    }
}
