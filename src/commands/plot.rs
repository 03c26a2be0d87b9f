//! `sluice plot RUN_DIR_OR_METRICS_JSONL [-o out.png]`: draws a run's progress plot (reward
//! and eval accuracy against step and wall time) from its `metrics.jsonl`.

use std::path::PathBuf;
use std::process::ExitCode;

use sluice_report::{METRICS_FILE, PLOT_FILE};

use crate::cli::PlotArgs;

/// Reads the log, writes the PNG (by default `progress.png` beside the log) and prints its path.
pub fn run(args: &PlotArgs) -> anyhow::Result<ExitCode> {
    let log: PathBuf = if args.input.is_dir() {
        args.input.join(METRICS_FILE)
    } else {
        args.input.clone()
    };
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| log.with_file_name(PLOT_FILE));
    let records = sluice_report::read_log(&log)?;
    sluice_report::plot_run(&records, &out)?;
    println!("{}", out.display());
    Ok(ExitCode::SUCCESS)
}
