//! `sluice plot`: never writes its PNG over the metrics log it reads, nor over an existing file
//! that is not a PNG unless `--force`; re-plotting over an earlier PNG is the normal case.

use std::path::Path;
use std::process::{Command, Output};

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("run sluice")
}

const LOG: &str = "{\"step\":1,\"wall_s\":1.0,\"reward_mean\":0.5,\"version_lag_mean\":0.0}\n\
                   {\"step\":2,\"wall_s\":2.0,\"reward_mean\":0.7,\"version_lag_mean\":0.5}\n";

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn plot_refuses_to_overwrite_its_log_or_a_file_that_is_not_a_png() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("metrics.jsonl");
    std::fs::write(&log, LOG).unwrap();

    // The log itself (the reported case: exit 0 and the log replaced by a PNG).
    let out = sluice(&["plot", s(&log), "-o", s(&log)]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("that is the metrics log being plotted"),
        "{err}"
    );
    let out = sluice(&["plot", s(dir.path()), "-o", s(&log), "--force"]);
    assert_eq!(out.status.code(), Some(1), "never, even with --force");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), LOG);

    // Another existing file that is not a PNG.
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "keep me").unwrap();
    let out = sluice(&["plot", s(&log), "-o", s(&notes)]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the file exists and is not a PNG; pass --force"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "keep me");
    let out = sluice(&["plot", s(&log), "-o", s(&notes), "--force"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::read(&notes).unwrap().starts_with(b"\x89PNG"));

    // A new file, then the same PNG again: both fine.
    let png = dir.path().join("p.png");
    for _ in 0..2 {
        let out = sluice(&["plot", s(&log), "-o", s(&png)]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(std::fs::read_to_string(&log).unwrap(), LOG);
}
