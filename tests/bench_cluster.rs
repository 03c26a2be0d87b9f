//! `sluice bench cluster` end to end, short: both runs finish, the table has both rows and the
//! `RESULT` line carries the steps/s of each, their ratio and the weight delivery ratio as
//! positive numbers. What the numbers are is not checked (a shared machine's speed is not a
//! behaviour).

use std::collections::BTreeMap;
use std::process::Command;

#[test]
fn bench_cluster_runs_both_setups_and_reports_the_ratios() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "bench",
            "cluster",
            "--steps",
            "4",
            "--skip-steps",
            "1",
            "--weights-preset",
            "tiny",
            "--repeats",
            "1",
        ])
        .env("SLUICE_ADMIN_TOKEN", "bench-cluster-test")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("one process (2 replicas)"), "{stdout}");
    assert!(stdout.contains("head + 2 engine nodes"), "{stdout}");
    let result = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT cluster "))
        .unwrap_or_else(|| panic!("no RESULT line:\n{stdout}"));
    let fields: BTreeMap<&str, f64> = result
        .split_whitespace()
        .map(|f| {
            let (k, v) = f.split_once('=').unwrap();
            (k, v.parse().unwrap())
        })
        .collect();
    for key in [
        "one_process_steps_per_s",
        "split_steps_per_s",
        "split_ratio",
        "weights_tiny_ratio",
        "weights_tiny_delivery_s",
    ] {
        assert!(
            fields.get(key).is_some_and(|v| *v > 0.0 && v.is_finite()),
            "{key} in {result}"
        );
    }
    let ratio = fields["split_steps_per_s"] / fields["one_process_steps_per_s"];
    assert!(
        (ratio - fields["split_ratio"]).abs() < 0.01,
        "the ratio is split ÷ one process: {result}"
    );
}

#[test]
fn bench_cluster_refuses_a_measure_of_nothing() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "cluster", "--steps", "3", "--skip-steps", "3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--skip-steps (3) must be below --steps (3)"),
        "{stderr}"
    );
}
