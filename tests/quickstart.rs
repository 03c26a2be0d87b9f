//! The quickstart, shortened: `sluice run configs/quickstart.toml` as a user runs it (the binary,
//! the shipped config, the embedded tiny model), with fewer RL steps so it fits in CI.
//!
//! What it checks:
//! - the model is created, and the supervised warm-start lifts greedy accuracy on the held-out
//!   problems (`warmup.probe = "heldout"`) from a random model's (a few percent) to its target,
//!   and RL starts from exactly the accuracy the warm-up stopped on (the same weights, the same
//!   106 problems);
//! - RL then runs through the actors (native engine, candle trainer, replay store) for the step
//!   budget, within the version-lag bound; the sampled reward (the RL objective) and greedy
//!   accuracy on training problems rise clearly above the warm-start's; held-out accuracy is
//!   evaluated where configured;
//! - `metrics.jsonl` has one record per step with the documented fields, evaluations at the
//!   configured steps, and `progress.png` is a PNG; the summary says where both are.
//!
//! The full run reaches its 80 % held-out target in 80–190 RL steps from a warm start at 62–63 %
//! held-out (docs/trainer.md). CI runs the first 40 steps at 2e-4. Held-out accuracy is not asked
//! to rise in 40 steps: two runs differ at the same step (the pipeline is asynchronous). (The
//! notes below were measured on the earlier task, operands 0–9 with 23 held-out problems, and a
//! warm-up that stopped at 60 % of training problems.) The mean sampled reward over 256
//! rollouts a step is the steady signal, but how fast it climbs depends on where the warm-start
//! ended (warm-starts that differ only in rounding end in different places) and on the run's
//! timing: at 1e-4 over 30 steps one run rose 0.50 → 0.55 and another only 0.435 → 0.454 (CI
//! failed on it). At 2e-4 over 40 steps that slow warm-start rises 0.441 → 0.482 and another
//! 0.476 → 0.519, twice the asked gain. With the shipped two updates a step
//! (`trainer.minibatches = 2`) the current warm-start rises 0.473 → 0.511 and its training-problem
//! accuracy 60.2 % → 75.8 % (best) in these 40 steps, the same on two runs.
//!
//! Held-out accuracy is not asked to hold over these 40 steps. It dips early in RL (docs/recipes.md) and
//! recovers later: with the preset tokenizer's two added action tags (2026-11-27) the warm-start
//! ends at 43.5 % held-out, these 40 steps' evaluations reach at best 34.8–39.1 %, and the full
//! quickstart goes on to 87 % at step 241. The test used to ask that the best of the four
//! evaluations not fall below the start, which held only while warm-starts ended lower.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const RL_STEPS: u64 = 40;
const EVAL_EVERY: u64 = 10;
/// The shipped warm-up target (held-out problems).
const WARMUP_TARGET: f64 = 0.6;
/// Rise of the mean sampled reward, first ten steps → last ten: "clearly above" (a ten-step
/// mean of 256-rollout means varies by about 0.01).
const REWARD_GAIN: f64 = 0.02;
/// The short run's learning rate (see the module docs).
const LEARNING_RATE: &str = "2e-4";

fn percent_after(text: &str, marker: &str) -> Option<f64> {
    let rest = &text[text.find(marker)? + marker.len()..];
    let end = rest.find('%')?;
    rest[..end].trim().parse::<f64>().ok().map(|p| p / 100.0)
}

#[test]
fn the_quickstart_warm_starts_trains_through_the_actors_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("run");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/quickstart.toml");
    let sets = [
        format!("run.output_dir={}", out_dir.display()),
        format!("run.max_steps={RL_STEPS}"),
        format!("eval.every_steps={EVAL_EVERY}"),
        format!("trainer.learning_rate={LEARNING_RATE}"),
        "eval.stop_at_accuracy=1.0".to_owned(),
        "metrics.enabled=false".to_owned(),
        "admin.listen=127.0.0.1:0".to_owned(),
    ];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.arg("run").arg(&config);
    for s in &sets {
        cmd.arg("--set").arg(s);
    }
    let output = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        output.status
    );
    eprintln!("{stdout}");

    // Warm-start: from barely answering to the target.
    assert!(out_dir.join("model/config.json").exists(), "model created");
    assert!(
        out_dir.join("warmup/model.safetensors").exists(),
        "warm-start saved"
    );
    let first_probe = percent_after(&stdout, "probe accuracy").expect("warm-up progress lines");
    let warm =
        percent_after(&stdout, "supervised steps, held-out accuracy").expect("warm-up summary");
    assert!(
        first_probe < 0.15,
        "10 steps in, the model barely answers: {first_probe}"
    );
    assert!(
        warm >= WARMUP_TARGET,
        "warm-up reached {warm}, target {WARMUP_TARGET}"
    );

    let before = &stdout[stdout.find("before RL:").expect("the start line")..];
    let start_train = percent_after(before, "training problems").expect("start, training");
    // The warm-up probed the set RL is evaluated on: the first evaluation finds what it stopped on.
    let start_heldout = percent_after(before, "held-out accuracy").expect("start, held-out");
    assert_eq!(start_heldout, warm, "{before}");
    let problems: usize = before
        .split_once('(')
        .and_then(|(_, rest)| rest.split_once(" problems"))
        .and_then(|(n, _)| n.parse().ok())
        .expect("the held-out count");
    assert!(problems >= 100, "{problems} held-out problems");

    // RL: one record per step, in order, within the lag bound, evaluated where configured.
    let log = std::fs::read_to_string(out_dir.join("metrics.jsonl")).unwrap();
    let records: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len() as u64, RL_STEPS, "{log}");
    let mut wall = 0.0;
    let mut best_train = 0.0f64;
    for (i, r) in records.iter().enumerate() {
        let step = i as u64 + 1;
        assert_eq!(r["step"], step, "{r}");
        let w = r["wall_s"].as_f64().unwrap();
        assert!(w >= wall, "wall time runs forward: {r}");
        wall = w;
        let reward = r["reward_mean"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&reward), "{r}");
        // The task's named reward components, averaged over the step's batch.
        let correct = r["reward.correct"].as_f64().unwrap_or(-1.0);
        assert!((0.0..=1.0).contains(&correct), "reward.correct: {r}");
        let lag = r["version_lag_mean"].as_f64().unwrap();
        assert!((0.0..=2.0).contains(&lag), "max_version_lag = 2: {r}");
        // The trainer's figures of this step, not only the last step's gauges.
        for key in [
            "train.entropy",
            "train.clip_fraction",
            "train.importance_weight_mean",
            "train.effective_sample_size",
            "train.grad_norm",
            "train.learning_rate",
            "train.packing_efficiency",
        ] {
            let v = r[key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v >= 0.0, "{key}: {r}");
        }
        let ess = r["train.effective_sample_size"].as_f64().unwrap();
        assert!(ess <= 1.0 + 1e-9, "a fraction of the tokens: {r}");
        let evaluated = step.is_multiple_of(EVAL_EVERY) || step == RL_STEPS;
        assert_eq!(r.get("eval_accuracy").is_some(), evaluated, "{r}");
        if evaluated {
            for key in ["eval_accuracy", "train_accuracy"] {
                let a = r[key].as_f64().unwrap();
                assert!((0.0..=1.0).contains(&a), "{key}: {r}");
            }
            best_train = best_train.max(r["train_accuracy"].as_f64().unwrap());
        }
    }
    // RL learns: the sampled reward rises and greedy answers get better on the training problems.
    // Held-out accuracy is evaluated (and range-checked above) but not asked of these 40 steps:
    // see the module docs.
    let rewards: Vec<f64> = records
        .iter()
        .map(|r| r["reward_mean"].as_f64().unwrap())
        .collect();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&rewards[..10]), mean(&rewards[rewards.len() - 10..]));
    assert!(
        last >= first + REWARD_GAIN,
        "mean reward {first:.3} (first ten steps) → {last:.3} (last ten)\n{log}"
    );
    assert!(
        best_train >= start_train + 0.05,
        "training-problem accuracy {start_train} → best {best_train}\n{log}"
    );
    let png = std::fs::read(out_dir.join("progress.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(stdout.contains(&format!("{}", out_dir.join("metrics.jsonl").display())));
    assert!(stdout.contains(&format!("{}", out_dir.join("progress.png").display())));
    assert!(stdout.contains("violations 0"), "{stdout}");
}
