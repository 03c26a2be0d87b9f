//! `sluice bench engine` end to end, short: the table has the one-by-one baseline and every
//! concurrency row, prefix sharing meets its own bound, and the `RESULT` line carries the
//! batching speed-up, this machine's batching ceiling, the swap pause, the prefix ratio and the
//! peak memory as numbers. How fast anything is, is not checked (a shared machine's speed is not
//! a behaviour); the ceiling's own bounds are (at least 1, at most the 64 requests it is about).

use std::collections::BTreeMap;
use std::process::Command;

#[test]
fn bench_engine_reports_rows_ratios_and_the_batching_ceiling() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "bench",
            "engine",
            "--preset",
            "tiny",
            "--concurrency",
            "1",
            "--concurrency",
            "64",
            "--max-tokens",
            "4",
            "--group-size",
            "4",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in [
        "one-by-one",
        "swap pause in_flight",
        "batching speed-up ceiling at 64",
    ] {
        assert!(stdout.contains(row), "no `{row}` in:\n{stdout}");
    }
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|c| c == "1" || c == "64")
        })
        .collect();
    assert_eq!(rows.len(), 2, "one row per concurrency:\n{stdout}");
    let result = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT engine "))
        .unwrap_or_else(|| panic!("no RESULT line:\n{stdout}"));
    let fields: BTreeMap<&str, f64> = result
        .split_whitespace()
        .map(|f| {
            let (k, v) = f.split_once('=').unwrap();
            (k, v.parse().unwrap_or_else(|_| panic!("{f} in {result}")))
        })
        .collect();
    for key in [
        "batching_speedup_64",
        "swap_pause_ms_in_flight",
        "prefix_prefill_ratio_g4",
        "peak_rss_mb",
    ] {
        assert!(
            fields.get(key).is_some_and(|v| *v > 0.0 && v.is_finite()),
            "{key} in {result}"
        );
    }
    let ceiling = fields["batching_ceiling_64"];
    assert!((1.0..=64.0).contains(&ceiling), "{result}");
    // Groups of 4 with 100-token prompts: each later rollout takes the first one's full blocks.
    assert!(
        fields["prefix_prefill_ratio_g4"] <= 1.0 / 4.0 + 0.05,
        "{result}"
    );
}
