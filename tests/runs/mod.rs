//! `sluice run` on a config, as the tests that train through the binary run it: into a
//! directory of their own (model, run output), no Prometheus endpoint, an admin port of its own;
//! the run must succeed, and its `metrics.jsonl` records are returned. Shared by several test
//! binaries, each using part of it.

#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// The tiny-model run on verl's GSM8K rows (`tests/data/verl_tiny.toml`), with its data
/// directory made absolute.
pub fn verl_tiny_config() -> (&'static str, String) {
    (
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/verl_tiny.toml"),
        format!(
            "data.data_dir=\"{}\"",
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data")
        ),
    )
}

/// [`verl_tiny_config`]'s data directory and the `qa` task reading verl's columns (`prompt`
/// messages, `reward_model.ground_truth`), as `--set`s.
pub fn verl_qa_sets() -> Vec<String> {
    vec![
        verl_tiny_config().1,
        "data.domains.gsm8k.task=\"qa\"".to_owned(),
        "data.domains.gsm8k.question_field=\"prompt\"".to_owned(),
        "data.domains.gsm8k.answer_field=\"reward_model.ground_truth\"".to_owned(),
    ]
}

/// Runs `config` with `sets` on top, writing under `out`; the records of its `metrics.jsonl`.
pub fn run_records(config: &str, out: &Path, sets: &[String]) -> Vec<Value> {
    let own = [
        format!("run.output_dir=\"{}\"", out.display()),
        format!("model.path=\"{}\"", out.join("model").display()),
        "metrics.enabled=false".to_owned(),
        "admin.listen=\"127.0.0.1:0\"".to_owned(),
    ];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.args(["run", config]);
    for s in own.iter().chain(sets) {
        cmd.args(["--set", s]);
    }
    let run = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{sets:?}\n{stdout}\n{stderr}");
    let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    log.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
