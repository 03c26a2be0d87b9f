//! `sluice plot RUN_DIR_OR_METRICS_JSONL [-o out.png]`: draws a run's progress plot (reward
//! and eval accuracy against step and wall time) from its `metrics.jsonl`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::bail;
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
    refuse_overwrite(&log, &out, args.force)?;
    let records = sluice_report::read_log(&log)?;
    sluice_report::plot_run(&records, &out)?;
    println!("{}", out.display());
    Ok(ExitCode::SUCCESS)
}

/// The first bytes of every PNG file.
const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];

/// Refuses to write the plot over the log it is drawn from (ever), or over an existing file
/// that is not a PNG (unless `force`): `-o RUN/metrics.jsonl` used to replace the run's only
/// record with a picture of it, silently.
fn refuse_overwrite(log: &Path, out: &Path, force: bool) -> anyhow::Result<()> {
    if !out.exists() {
        return Ok(());
    }
    let same = match (log.canonicalize(), out.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        bail!(
            "--out {}: that is the metrics log being plotted; choose another file (e.g. {})",
            out.display(),
            log.with_file_name(PLOT_FILE).display()
        );
    }
    if force || is_png(out) {
        return Ok(());
    }
    bail!(
        "--out {}: the file exists and is not a PNG; pass --force to replace it",
        out.display()
    )
}

/// Whether `path` is a file that starts with the PNG signature.
fn is_png(path: &Path) -> bool {
    let mut head = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| head == PNG_SIGNATURE)
}
