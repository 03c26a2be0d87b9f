//! `sluice run` ends a run that cannot go on, loudly: a non-zero exit, a message naming what
//! failed, and a checkpoint to resume from, instead of hanging or looping at its step. Each case
//! is one process on the shrunk long-tail config with a fault injected.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Runs `sluice run` on the long-tail config with `sets`, bounded by a generous deadline.
fn run(out: &Path, sets: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.args([
        "run",
        concat!(env!("CARGO_MANIFEST_DIR"), "/configs/sim_longtail.toml"),
    ]);
    let base = [
        "run.max_steps=1000".to_owned(),
        "engine.simulated.time_scale=0.01".to_owned(),
        format!("run.output_dir=\"{}\"", out.display()),
        "metrics.enabled=false".to_owned(),
        "admin.listen=\"127.0.0.1:0\"".to_owned(),
    ];
    for s in base.iter().map(String::as_str).chain(sets.iter().copied()) {
        cmd.args(["--set", s]);
    }
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let output = child.wait_with_output().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "the run ended, but only after {:?}",
        started.elapsed()
    );
    output
}

fn manifest_reason(out: &Path) -> String {
    let text = std::fs::read_to_string(out.join("checkpoint/manifest.json")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["reason"].as_str().unwrap().to_owned()
}

#[test]
fn an_engine_replica_that_keeps_failing_ends_the_run_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        &[
            "faults.engine_crash_every_requests=1",
            "supervision.engine_max_restarts=2",
            "supervision.restart_backoff_initial_s=0.01",
            "supervision.restart_backoff_max_s=0.05",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("inference engine unavailable: engine replica")
            && stderr.contains("failed 3 times in a row"),
        "{stderr}"
    );
    assert!(
        stderr.contains("crashed by [faults]"),
        "the last error: {stderr}"
    );
    assert_eq!(manifest_reason(dir.path()), "engine_failure");
}

#[test]
fn a_panicking_trainer_ends_the_run_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(dir.path(), &["faults.trainer_panic_at_step=2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("training failed: trainer_panic: the training step panicked"),
        "{stderr}"
    );
    assert!(stdout.contains("steps                 1"), "{stdout}");
    // No checkpoint after a panic, on purpose: that is no failure to write one.
    assert!(!stderr.contains("final checkpoint failed"), "{stderr}");
    assert!(
        stderr.contains("the last good checkpoint is kept"),
        "{stderr}"
    );
}

#[test]
fn a_run_whose_every_rollout_fails_ends_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        &[
            "faults.env_panic_every_steps=1",
            "supervision.no_progress_groups=20",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the run makes no progress: no trainable group in the last 20"),
        "{stderr}"
    );
    assert!(stderr.contains("a sample error: env_panic"), "{stderr}");
    assert_eq!(manifest_reason(dir.path()), "no_progress");
}
