//! The metrics log: round trips, appends across runs, resumption and bad lines.

use std::collections::BTreeMap;

use sluice_core::PolicyVersion;
use sluice_report::{METRICS_FILE, MetricsLog, ReportError, StepRecord, read_log};

fn record(step: u64) -> StepRecord {
    StepRecord {
        step,
        wall_s: 1.5 * step as f64,
        reward_mean: 0.25 + 0.01 * step as f64,
        eval_accuracy: step.is_multiple_of(2).then_some(0.5),
        version_lag_mean: 0.75,
        ..StepRecord::default()
    }
}

#[test]
fn records_round_trip_with_optional_fields_and_extras() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run").join(METRICS_FILE);
    let full = StepRecord {
        tokens_per_s: Some(1234.5),
        loss: Some(-0.125),
        phase: Some("rl".into()),
        policy_version: Some(PolicyVersion(7)),
        extra: BTreeMap::from([
            ("kl".to_string(), 0.01),
            ("sluice_discarded_tokens_total".to_string(), 42.0),
        ]),
        ..record(3)
    };
    let records = vec![record(1), record(2), full];
    let mut log = MetricsLog::create(&path).unwrap();
    for r in &records {
        log.append(r).unwrap();
    }
    assert_eq!(log.last(), records.last());
    assert_eq!(read_log(&path).unwrap(), records);

    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3);
    // An unevaluated step has no eval_accuracy key at all, not a null.
    assert!(!lines[0].contains("eval_accuracy"), "{}", lines[0]);
    assert!(lines[1].contains(r#""eval_accuracy":0.5"#), "{}", lines[1]);
    // Extras are top-level keys, so `jq .kl` works on the log.
    let value: serde_json::Value = serde_json::from_str(lines[2]).unwrap();
    assert_eq!(value["kl"], 0.01);
    assert_eq!(value["policy_version"], 7);
    assert_eq!(value["phase"], "rl");
}

#[test]
fn each_line_is_on_disk_as_soon_as_it_is_appended() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    let mut log = MetricsLog::create(&path).unwrap();
    log.append(&record(1)).unwrap();
    // The log is still open: a reader (or a kill) sees the whole line already.
    assert_eq!(read_log(&path).unwrap(), vec![record(1)]);
}

#[test]
fn non_finite_numbers_survive_as_null() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    let diverged = StepRecord {
        reward_mean: f64::NAN,
        loss: Some(f64::INFINITY),
        extra: BTreeMap::from([("grad_norm".to_string(), f64::NAN)]),
        ..record(4)
    };
    MetricsLog::create(&path)
        .unwrap()
        .append(&diverged)
        .unwrap();
    let back = read_log(&path).unwrap();
    assert!(back[0].reward_mean.is_nan());
    assert_eq!(back[0].loss, None);
    assert!(back[0].extra["grad_norm"].is_nan());
    assert_eq!(back[0].step, 4);
}

#[test]
fn opening_an_existing_log_appends() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    let mut first = MetricsLog::open(&path).unwrap();
    assert_eq!(first.last(), None);
    first.append(&record(1)).unwrap();
    first.append(&record(2)).unwrap();
    drop(first);
    let mut second = MetricsLog::open(&path).unwrap();
    assert_eq!(second.last(), Some(&record(2)));
    second.append(&record(3)).unwrap();
    let steps: Vec<u64> = read_log(&path).unwrap().iter().map(|r| r.step).collect();
    assert_eq!(steps, [1, 2, 3]);
}

#[test]
fn resuming_drops_the_steps_after_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    let mut log = MetricsLog::create(&path).unwrap();
    for step in 1..=6 {
        log.append(&record(step)).unwrap();
    }
    drop(log);
    let mut resumed = MetricsLog::resume(&path, 4).unwrap();
    assert_eq!(resumed.last(), Some(&record(4)));
    assert_eq!(resumed.dropped(), 2, "steps 5 and 6 are said to go");
    resumed.append(&record(5)).unwrap();
    let steps: Vec<u64> = read_log(&path).unwrap().iter().map(|r| r.step).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5]);
}

#[test]
fn a_bad_line_is_reported_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    let good = serde_json::to_string(&record(1)).unwrap();
    let missing = r#"{"step": 2, "wall_s": 3.0, "version_lag_mean": 0.0}"#;
    std::fs::write(&path, format!("{good}\n\n{missing}\n{good}\n")).unwrap();
    for error in [
        read_log(&path).unwrap_err(),
        MetricsLog::open(&path).unwrap_err(),
    ] {
        assert!(
            matches!(error, ReportError::BadLine { line: 3, .. }),
            "{error:?}"
        );
        assert_eq!(error.kind(), "report_bad_line");
        let message = error.to_string();
        assert!(
            message.contains(&format!("{}:3:", path.display())),
            "{message}"
        );
        assert!(message.contains("reward_mean"), "{message}");
    }
}

#[test]
fn a_torn_final_line_from_a_killed_run_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    let good = serde_json::to_string(&record(1)).unwrap();
    std::fs::write(&path, format!("{good}\n{{\"step\": 2, \"wall")).unwrap();
    assert_eq!(read_log(&path).unwrap(), vec![record(1)]);
    let mut log = MetricsLog::open(&path).unwrap();
    log.append(&record(2)).unwrap();
    assert_eq!(read_log(&path).unwrap(), vec![record(1), record(2)]);

    // A complete last line that only lacks its newline is kept, and the next one starts fresh.
    std::fs::write(&path, &good).unwrap();
    MetricsLog::open(&path).unwrap().append(&record(2)).unwrap();
    assert_eq!(read_log(&path).unwrap(), vec![record(1), record(2)]);
}

#[test]
fn extras_may_not_shadow_fields() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = MetricsLog::create(dir.path().join(METRICS_FILE)).unwrap();
    let clash = StepRecord {
        extra: BTreeMap::from([("reward_mean".to_string(), 1.0)]),
        ..record(9)
    };
    let error = log.append(&clash).unwrap_err();
    assert_eq!(error.kind(), "report_reserved_key");
    assert!(error.to_string().contains("reward_mean"), "{error}");
    assert_eq!(log.last(), None);
}

#[test]
fn reading_a_missing_log_names_the_file() {
    let error = read_log("/nonexistent/sluice/metrics.jsonl").unwrap_err();
    assert_eq!(error.kind(), "report_io");
    assert!(
        error
            .to_string()
            .contains("/nonexistent/sluice/metrics.jsonl"),
        "{error}"
    );
}

#[path = "log/tensorboard.rs"]
mod tensorboard;
