//! The `sluice bench` commands end to end, short: each finishes, prints its table and a `RESULT`
//! line whose fields are numbers. What the numbers are is not checked (a shared machine's speed
//! is not a behaviour); only the relations the bench itself defines (a ratio of two of its
//! figures, a ceiling's bounds, the prefix-sharing bound).

use std::collections::BTreeMap;
use std::process::Command;

/// Runs `sluice bench <args>` (with `envs`), requires success, and returns its stdout and the
/// fields of its `RESULT <name>` line (`n/a` fields left out).
fn bench(args: &[&str], envs: &[(&str, &str)]) -> (String, BTreeMap<String, f64>) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("bench")
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let prefix = format!("RESULT {} ", args[0]);
    let result = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line:\n{stdout}"))
        .to_owned();
    let fields = result
        .split_whitespace()
        .filter_map(|f| {
            let (k, v) = f.split_once('=').unwrap();
            (v != "n/a").then(|| {
                let v = v.parse().unwrap_or_else(|_| panic!("{f} in {result}"));
                (k.to_owned(), v)
            })
        })
        .collect();
    (stdout, fields)
}

/// Every `keys` is in `fields`, positive and finite.
fn positive(fields: &BTreeMap<String, f64>, keys: &[&str]) {
    for key in keys {
        assert!(
            fields.get(*key).is_some_and(|v| *v > 0.0 && v.is_finite()),
            "{key} in {fields:?}"
        );
    }
}

#[test]
fn bench_cluster_runs_both_setups_and_reports_the_ratios() {
    let (stdout, fields) = bench(
        &[
            "cluster",
            "--steps",
            "4",
            "--skip-steps",
            "1",
            "--weights-preset",
            "tiny",
            "--repeats",
            "1",
        ],
        &[("SLUICE_ADMIN_TOKEN", "bench-cluster-test")],
    );
    assert!(stdout.contains("one process (2 replicas)"), "{stdout}");
    assert!(stdout.contains("head + 2 engine nodes"), "{stdout}");
    positive(
        &fields,
        &[
            "one_process_steps_per_s",
            "split_steps_per_s",
            "split_ratio",
            "weights_tiny_ratio",
            "weights_tiny_delivery_s",
        ],
    );
    let ratio = fields["split_steps_per_s"] / fields["one_process_steps_per_s"];
    assert!(
        (ratio - fields["split_ratio"]).abs() < 0.01,
        "the ratio is split ÷ one process: {fields:?}"
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

/// Flags that made a bench sleep for ages or report nothing are refused, naming the flag.
#[test]
fn bench_flags_out_of_range_are_refused() {
    for (args, named) in [
        (&["pipeline", "--time-scale", "1e300"][..], "--time-scale"),
        (&["pipeline", "--time-scale", "NaN"][..], "--time-scale"),
        (
            &["overhead", "--steps", "18446744073709551615"][..],
            "--steps",
        ),
        (&["engine", "--concurrency", "0"][..], "--concurrency"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("bench")
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(named), "{args:?}: {stderr}");
    }
}

/// The table has the one-by-one baseline and every concurrency row, and the `RESULT` line the
/// batching speed-up, this machine's batching ceiling (at least 1, at most the 64 requests it is
/// about), the share of the model's time issuing the forward, the swap pause, the prefix ratio within its bound and the peak memory.
#[test]
fn bench_engine_reports_rows_ratios_and_the_batching_ceiling() {
    let (stdout, fields) = bench(
        &[
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
        ],
        &[],
    );
    for row in [
        "one-by-one",
        "swap pause in_flight",
        "batching speed-up ceiling at 64",
        "graphed%",
    ] {
        assert!(stdout.contains(row), "no `{row}` in:\n{stdout}");
    }
    let rows = stdout
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|c| c == "1" || c == "64")
        })
        .count();
    assert_eq!(rows, 2, "one row per concurrency:\n{stdout}");
    positive(
        &fields,
        &[
            "batching_speedup_64",
            "swap_pause_ms_in_flight",
            "prefix_prefill_ratio_g4",
            "peak_rss_mb",
        ],
    );
    assert!(
        (1.0..=64.0).contains(&fields["batching_ceiling_64"]),
        "{fields:?}"
    );
    // The CPU computes as it issues: the forward's call is most of the model's time (the rest
    // is the logits' copy), and never more than all of it.
    assert!(
        (50.0..=100.0).contains(&fields["tiny_issue_pct_64"]),
        "{fields:?}"
    );
    // Groups of 4 with 100-token prompts: each later rollout takes the first one's full blocks.
    assert!(
        fields["prefix_prefill_ratio_g4"] <= 1.0 / 4.0 + 0.05,
        "{fields:?}"
    );
}

/// `--model DIR` measures a model directory with its own weights, each bench naming its
/// `RESULT` keys after the directory; a directory that cannot load is refused naming the flag.
#[test]
fn benches_measure_a_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("My-Model.v1");
    let init = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["model", "init", "--preset", "tiny", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(init.status.success(), "{init:?}");
    let dir = dir.to_str().unwrap();

    let (_, model) = bench(&["model", "--model", dir, "--batch", "2"], &[]);
    positive(
        &model,
        &["my_model_v1_train_tok_s", "my_model_v1_decode_b2_tok_s"],
    );
    let (_, trainer) = bench(&["trainer", "--model", dir, "--shape", "2x16"], &[]);
    positive(&trainer, &["my_model_v1_b2_l16_tok_s"]);
    let (stdout, engine) = bench(
        &[
            "engine",
            "--model",
            dir,
            "--concurrency",
            "2",
            "--max-tokens",
            "2",
            "--only-concurrency",
        ],
        &[],
    );
    assert!(
        stdout.contains("my_model_v1: 2 tokens per request"),
        "{stdout}"
    );
    assert!(
        !engine.contains_key("tiny_batching_speedup_64"),
        "{engine:?}"
    );

    let missing = tmp.path().join("absent");
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "model", "--model"])
        .arg(&missing)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--model") && stderr.contains("absent"),
        "{stderr}"
    );
}

#[test]
fn bench_kernels_checks_adamw_in_place_against_the_composition() {
    let (stdout, fields) = bench(&["kernels", "--adamw-elements", "4099"], &[]);
    assert!(stdout.contains("adamw, 4099 f32 elements"), "{stdout}");
    assert_eq!(fields["adamw_bit_mismatches"], 0.0, "{stdout}");
    assert_eq!(fields["checks_failed"], 0.0, "{stdout}");
    positive(&fields, &["adamw_ms", "adamw_composed_ms", "adamw_speedup"]);
    // The token choice on a device is a GPU check: not on the CPU.
    assert!(!fields.contains_key("sample_ms"), "{stdout}");
    // The engine's split of stacked products and its fused add + norm, against the composition.
    for op in ["split_rope", "swiglu_rows", "add_rms_norm"] {
        assert!(
            fields[&format!("engine_{op}_f32_err")] <= 1e-5,
            "{op}: {stdout}"
        );
        positive(&fields, &[&format!("engine_{op}_f32_speedup")]);
    }
    // The decode steps over fixed buffers (what a GPU captures as graphs) as the eager ones:
    // twelve of them, none captured on the CPU.
    assert!(fields["decode_graph_err"] <= 1e-5, "{stdout}");
    assert_eq!(fields["decode_graph_steps"], 12.0, "{stdout}");
    assert_eq!(fields["decode_graph_replays"], 0.0, "{stdout}");
    assert_eq!(fields["decode_graph_failed"], 0.0, "{stdout}");
    positive(&fields, &["decode_graph_ms", "decode_eager_ms"]);
    // Alone, as `scripts/gpu-check` runs them apart from the other checks.
    let (stdout, fields) = bench(&["kernels", "--decode-graphs", "only"], &[]);
    assert!(!fields.contains_key("adamw_ms"), "{stdout}");
    assert_eq!(fields["decode_graph_steps"], 12.0, "{stdout}");
    assert_eq!(fields["checks_failed"], 0.0, "{stdout}");
    let (stdout, fields) = bench(
        &[
            "kernels",
            "--adamw-elements",
            "99",
            "--decode-graphs",
            "skip",
        ],
        &[],
    );
    assert!(!fields.contains_key("decode_graph_steps"), "{stdout}");
    assert_eq!(fields["adamw_bit_mismatches"], 0.0, "{stdout}");
}

/// The reward model's two ways agree on every score, and the `RESULT` line's speed-up is the
/// ratio of its two times.
#[test]
fn bench_reward_model_scores_one_by_one_and_packed() {
    let (stdout, fields) = bench(
        &["reward-model", "--conversations", "4", "--rounds", "1"],
        &[],
    );
    positive(
        &fields,
        &[
            "conversations",
            "tokens_mean",
            "one_ms",
            "packed_ms",
            "packed_speedup",
        ],
    );
    assert_eq!(fields["conversations"], 4.0, "{stdout}");
    assert!(fields["max_abs_diff"] < 1e-4, "{stdout}");
    let ratio = fields["one_ms"] / fields["packed_ms"];
    assert!(
        (fields["packed_speedup"] / ratio - 1.0).abs() < 0.01,
        "{stdout}"
    );
    assert!(stdout.contains("one forward each"), "{stdout}");
}
