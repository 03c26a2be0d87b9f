//! `[metrics] tensorboard`: the event files, read back with TensorBoard's own reader.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use sluice_core::PolicyVersion;
use sluice_report::{METRICS_FILE, MetricsLog, StepRecord, TENSORBOARD_DIR};

/// TensorBoard's reader: `$SLUICE_TENSORBOARD_PYTHON`, else the cached venv that
/// `scripts/tensorboard-reader` makes (installing `tensorboard` the first time). There is no
/// skip: without it the test fails with the script's own words.
fn tensorboard_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            if let Some(python) = std::env::var_os("SLUICE_TENSORBOARD_PYTHON") {
                return python.into();
            }
            let script = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../scripts/tensorboard-reader"
            );
            let out = Command::new(script)
                .output()
                .unwrap_or_else(|e| panic!("running {script}: {e}"));
            assert!(
                out.status.success(),
                "{script} failed (the TensorBoard tests read events with TensorBoard's own \
                 reader):\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        })
        .clone()
}

/// Every scalar TensorBoard finds in `dir`, by tag, as (step, value) in step order.
fn read_with_tensorboard(dir: &Path) -> BTreeMap<String, Vec<(u64, f64)>> {
    const READER: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;
    let out = Command::new(tensorboard_python())
        .args(["-c", READER])
        .arg(dir)
        .output()
        .expect("TensorBoard's Python runs");
    assert!(
        out.status.success(),
        "TensorBoard's reader failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the reader prints JSON")
}

fn record(step: u64) -> StepRecord {
    StepRecord {
        step,
        wall_s: 2.0 * step as f64,
        reward_mean: 0.125 * step as f64,
        eval_accuracy: step.is_multiple_of(2).then_some(0.25 + 0.01 * step as f64),
        version_lag_mean: 0.5,
        tokens_per_s: Some(1000.0 + step as f64),
        loss: Some(if step == 3 { f64::NAN } else { -0.5 }),
        policy_version: Some(PolicyVersion(step)),
        extra: BTreeMap::from([("sluice_kl".to_string(), 0.001 * step as f64)]),
        ..StepRecord::default()
    }
}

fn near(a: f64, b: f64) -> bool {
    // Scalars travel as f32, as in every TensorBoard writer.
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

#[test]
fn tensorboard_reads_every_scalar_of_the_log_at_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let tb = dir.path().join(TENSORBOARD_DIR);
    let mut log = MetricsLog::create(dir.path().join(METRICS_FILE))
        .unwrap()
        .with_tensorboard(&tb)
        .unwrap();
    let records: Vec<StepRecord> = (1..=4).map(record).collect();
    for r in &records {
        log.append(r).unwrap();
    }
    let file = log.tensorboard_file().unwrap();
    assert!(file.starts_with(&tb), "{}", file.display());
    assert!(
        file.file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("events.out.tfevents."),
        "{}",
        file.display()
    );

    let scalars = read_with_tensorboard(&tb);
    for r in &records {
        for (tag, value) in sluice_report::tensorboard::scalars(r) {
            let points = &scalars[tag];
            let found = points.iter().find(|(step, _)| *step == r.step);
            assert!(
                found.is_some_and(|(_, v)| near(*v, value)),
                "{tag} at step {}: want {value}, TensorBoard has {points:?}",
                r.step
            );
        }
    }
    // The NaN loss of step 3 is left out (JSONL writes it as null), the odd steps have no eval.
    assert_eq!(
        scalars["loss"].iter().map(|p| p.0).collect::<Vec<_>>(),
        [1, 2, 4]
    );
    assert_eq!(
        scalars["eval_accuracy"]
            .iter()
            .map(|p| p.0)
            .collect::<Vec<_>>(),
        [2, 4]
    );
    assert_eq!(scalars["sluice_kl"].len(), 4);
}

#[test]
fn a_resumed_run_replaces_the_steps_after_its_checkpoint_in_tensorboard_too() {
    let dir = tempfile::tempdir().unwrap();
    let tb = dir.path().join(TENSORBOARD_DIR);
    let path = dir.path().join(METRICS_FILE);
    let mut first = MetricsLog::create(&path)
        .unwrap()
        .with_tensorboard(&tb)
        .unwrap();
    for step in 1..=5 {
        first.append(&record(step)).unwrap();
    }
    drop(first);
    // Killed after step 5, resumed from the checkpoint of step 3: steps 4 and 5 are trained
    // again and come out different.
    let mut resumed = MetricsLog::resume(&path, 3)
        .unwrap()
        .with_tensorboard(&tb)
        .unwrap();
    for step in 4..=6 {
        resumed
            .append(&StepRecord {
                reward_mean: 10.0 + step as f64,
                ..record(step)
            })
            .unwrap();
    }
    assert_eq!(
        std::fs::read_dir(&tb).unwrap().count(),
        2,
        "one file per writer"
    );

    let rewards = &read_with_tensorboard(&tb)["reward_mean"];
    let want: Vec<(u64, f64)> = vec![
        (1, 0.125),
        (2, 0.25),
        (3, 0.375),
        (4, 14.0),
        (5, 15.0),
        (6, 16.0),
    ];
    assert_eq!(rewards.len(), want.len(), "{rewards:?}");
    for ((step, value), (want_step, want_value)) in rewards.iter().zip(&want) {
        assert_eq!(step, want_step, "{rewards:?}");
        assert!(near(*value, *want_value), "{rewards:?}");
    }
}
