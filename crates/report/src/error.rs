//! Errors of the run report: a file that cannot be read or written, or a log line that does
//! not parse.
//!
//! Each message already ends with its cause, so causes are fields rather than `source()`s: an
//! error chain printed with `{:#}` would say them twice.

use std::path::PathBuf;

/// What went wrong while writing or reading a run report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Reading or writing a file failed.
    #[error("{}: {cause}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        cause: std::io::Error,
    },
    /// A line of a metrics log is not a step record.
    #[error("{}:{line}: not a step record: {cause}", path.display())]
    BadLine {
        /// The log file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What the JSON parser said.
        cause: serde_json::Error,
    },
    /// A record's `extra` map uses the name of one of its own fields, which would write the
    /// key twice on one line.
    #[error("step {step}: extra metric `{key}` collides with a step record field")]
    ReservedKey {
        /// The record's step.
        step: u64,
        /// The colliding key.
        key: String,
    },
    /// A record could not be serialized.
    #[error("step {step}: cannot serialize the record: {cause}")]
    Serialize {
        /// The record's step.
        step: u64,
        /// What serde_json said.
        cause: serde_json::Error,
    },
}

impl ReportError {
    /// A short stable name, usable as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "report_io",
            Self::BadLine { .. } => "report_bad_line",
            Self::ReservedKey { .. } => "report_reserved_key",
            Self::Serialize { .. } => "report_serialize",
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            cause,
        }
    }
}
