//! A run from start to end, the same for every backend, driven by the lifecycle's four calls
//! ([`prepare`] → [`PreparedRun::start`] → [`Run::watch`] → [`Run::finish`]):
//! [`NativeRun::prepare`] readies a real model (data, evaluated task, warm-start),
//! [`crate::Node::start`] builds the pipeline from the config, and the [`RunMonitor`] follows the
//! trainer's step feed — logging every step to `metrics.jsonl`, evaluating on schedule and
//! applying the stop rule — until the run ends ([`RunEnd`]), which the node marks with a final
//! checkpoint ([`crate::Node::finish`]).

mod end;
mod evaluations;
mod figures;
mod lifecycle;
mod lock;
mod monitor;
mod native;
mod target_model;

pub use end::RunEnd;
pub use evaluations::{DomainAccuracy, Evaluations, Scores};
pub use lifecycle::{Ending, Finished, PreparedRun, Run, RunError, Watched, prepare};
pub use lock::{LOCK_FILE, LockError, RunLock};
pub use monitor::{Progress, RunMonitor, RunSummary, Start};
pub use native::{NativeRun, WARMUP_DIR, WarmupOutcome, load_run_setup, sample_source, warmup_dir};
pub use target_model::TARGET_MODEL_DIR;
