//! `sluice run` on the long-tail config (shrunk, with TensorBoard events), and `sluice knobs get|set` against a live node.

use std::process::Command;
use std::time::Duration;

use sluice_node::{Node, NodeOptions};

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

/// `sluice run` of the long-tail config into `dir` (no metrics, an admin port of its own), with
/// `sets` on top.
fn sim_run(dir: &std::path::Path, sets: &[&str]) -> Command {
    let mut c = sluice();
    c.args([
        "run",
        concat!(env!("CARGO_MANIFEST_DIR"), "/configs/sim_longtail.toml"),
        "--set",
        &format!("run.output_dir=\"{}\"", dir.display()),
        "--set",
        "metrics.enabled=false",
        "--set",
        "admin.listen=\"127.0.0.1:0\"",
    ]);
    for set in sets {
        c.args(["--set", set]);
    }
    c
}

#[test]
fn run_finishes_the_long_tail_config_and_prints_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = sluice()
        .args([
            "run",
            concat!(env!("CARGO_MANIFEST_DIR"), "/configs/sim_longtail.toml"),
        ])
        .args([
            "--set",
            "run.max_steps=3",
            "--set",
            "engine.simulated.time_scale=0.01",
        ])
        .args([
            "--set",
            &format!("run.output_dir=\"{}\"", dir.path().display()),
        ])
        .args([
            "--set",
            "metrics.listen=\"127.0.0.1:0\"",
            "--set",
            "admin.listen=\"127.0.0.1:0\"",
            "--set",
            "metrics.tensorboard=true",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("steps                 3"), "{stdout}");
    assert!(stdout.contains("violations 0"), "{stdout}");
    assert!(
        dir.path().join("replay").join("replay.redb").exists(),
        "the replay store lives under the output dir"
    );
    // `metrics.tensorboard`: one event file beside the log, holding the steps' scalars (their
    // values are checked with TensorBoard's own reader in sluice-report's tests).
    let events: Vec<_> = std::fs::read_dir(dir.path().join("tensorboard"))
        .expect("the TensorBoard dir")
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let bytes = std::fs::read(&events[0]).unwrap();
    let name = events[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    for tag in ["reward_mean", "version_lag_mean", "policy_version"] {
        assert!(
            bytes.windows(tag.len()).any(|w| w == tag.as_bytes()),
            "no {tag} scalar in {name}"
        );
    }
}

/// A skipped step (the drill of a batch whose every advantage is zero) publishes nothing: the
/// log's `policy_version` stays where the previous step left it, where it used to claim a
/// version never published. No line holds a placeholder `tokens_per_s` of 0 (written before a
/// second of generation had passed).
#[test]
fn the_log_says_what_each_step_did() {
    let dir = tempfile::tempdir().unwrap();
    let out = sim_run(
        dir.path(),
        &[
            "run.max_steps=4",
            "engine.simulated.time_scale=0.01",
            "faults.trainer_skip_every_steps=2",
        ],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let versions: Vec<u64> = lines
        .iter()
        .map(|r| r["policy_version"].as_u64().unwrap())
        .collect();
    assert_eq!(versions, [1, 1, 2, 2], "{log}");
    for r in &lines {
        assert!(
            r.get("tokens_per_s").is_none() || r["tokens_per_s"].as_f64().unwrap() > 0.0,
            "a rate of 0 is a placeholder: {r}"
        );
    }
}

/// A second `sluice run` on a run directory in use stops at once, naming the first one's pid,
/// and changes nothing there.
#[test]
fn a_second_run_on_a_directory_in_use_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let args = |steps: &str| sim_run(dir.path(), &[&format!("run.max_steps={steps}")]);
    let mut first = args("100000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lock = dir.path().join(sluice_node::run::LOCK_FILE);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&lock).is_ok_and(|s| s.trim() == first.id().to_string()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the first run never locked"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = args("3").output().unwrap();
    let _ = first.kill();
    let _ = first.wait();
    assert_eq!(second.status.code(), Some(1));
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(
        err.contains(&format!(
            "another `sluice run` (pid {}) is using this run directory",
            first.id()
        )),
        "{err}"
    );
}

/// A run whose final checkpoint cannot be written (a file stands where checkpoints stage their
/// files) says so and exits non-zero: what it trained is not saved.
#[test]
fn a_run_whose_final_checkpoint_fails_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("checkpoint.partial"), b"in the way").unwrap();
    let out = sim_run(
        dir.path(),
        &[
            "run.max_steps=2",
            "engine.simulated.time_scale=0.01",
            "supervision.checkpoint_every_steps=0",
        ],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "error: the run ended, but its final checkpoint failed (no checkpoint is on disk"
        ) && err.contains("checkpoint.partial"),
        "{err}"
    );
}

#[test]
fn run_refuses_a_bad_config_naming_the_key() {
    let out = sluice()
        .args([
            "run",
            concat!(env!("CARGO_MANIFEST_DIR"), "/configs/sim_longtail.toml"),
        ])
        .args(["--set", "rollout.staleness_threshold=-1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rollout.staleness_threshold"), "{stderr}");
}

#[test]
fn knobs_get_and_set_talk_to_the_admin_api() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let overrides: Vec<_> = [
        "admin.listen=\"127.0.0.1:0\"",
        "metrics.enabled=false",
        "rollout.paused=true",
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let config = sluice_config::load(
        std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/configs/sim_longtail.toml"
        )),
        &overrides,
    )
    .unwrap();
    let node = rt
        .block_on(Node::start(
            &config,
            NodeOptions {
                serve_admin: true,
                ..NodeOptions::default()
            },
        ))
        .unwrap();
    let admin = format!("http://{}", node.admin_addr().unwrap());
    let get = sluice()
        .args(["knobs", "get", "--admin", &admin])
        .output()
        .unwrap();
    assert!(get.status.success());
    assert!(String::from_utf8_lossy(&get.stdout).contains("\"paused\": true"));
    let set = sluice()
        .args([
            "knobs",
            "set",
            "staleness_threshold=0.5",
            "max_version_lag=3",
            "--admin",
            &admin,
        ])
        .output()
        .unwrap();
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    let knobs = node.handles.knobs.current();
    assert_eq!((knobs.staleness_threshold, knobs.max_version_lag), (0.5, 3));
    let bad = sluice()
        .args([
            "knobs",
            "set",
            "max_concurrent_rollouts=2000000",
            "--admin",
            &admin,
        ])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("max_concurrent_rollouts"));
    assert_eq!(
        node.handles.knobs.current().max_concurrent_rollouts,
        knobs.max_concurrent_rollouts,
        "refused: unchanged"
    );
    rt.block_on(async {
        tokio::time::sleep(Duration::from_millis(10)).await;
        node.shutdown().await;
    });
}

#[test]
fn a_native_run_reports_bad_data_before_any_warm_up() {
    let dir = tempfile::tempdir().unwrap();
    let out = sluice()
        .args([
            "run",
            concat!(env!("CARGO_MANIFEST_DIR"), "/configs/quickstart.toml"),
        ])
        .args(["--set", "data.datasets=[\"math::nosuchtask@train\"]"])
        .args([
            "--set",
            &format!("run.output_dir=\"{}\"", dir.path().display()),
            "--set",
            &format!("model.path=\"{}\"", dir.path().join("model").display()),
            "--set",
            "metrics.enabled=false",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("nosuchtask"), "{stderr}");
    assert!(
        !stderr.contains("eval.task"),
        "a data error, not an eval one: {stderr}"
    );
    assert!(!stdout.contains("warm-up"), "{stdout}");
    assert!(!dir.path().join("warmup").exists());
}

/// verl's and DAPO's options through the binary: the quickstart's warm-started model trained a
/// few steps twice. First with `loss = "gspo"` (its clip range and text mean by default), the
/// dual clip on, Dr. GRPO's aggregation, RLOO's advantages and the overlong buffer over the whole
/// 6-token budget (so every reply pays for its length): every step logs its loss, clip figures
/// and the `overlong` reward component, and the text-level clip binds (two minibatches a step,
/// the second clipped against the behaviour policy the first moved away from). Then PPO with
/// REINFORCE++'s whitened advantages, a k2 KL penalty to the warm-started model and an entropy
/// bonus.
#[test]
fn verl_and_dapo_loss_options_train_through_the_binary() {
    let gspo = [
        "trainer.loss=\"gspo\"",
        "trainer.dual_clip=3.0",
        "trainer.loss_aggregation=\"token_sum_normalized\"",
        "trainer.advantage=\"rloo\"",
        "rollout.overlong_buffer_tokens=6",
        "rollout.overlong_penalty=0.5",
    ];
    let steps = quickstart_steps(&gspo);
    for step in &steps {
        let dual = step["train.dual_clip_fraction"].as_f64();
        assert!(dual.is_some_and(|f| (0.0..=1.0).contains(&f)), "{step}");
        let overlong = step["reward.overlong"].as_f64();
        assert!(overlong.is_some_and(|p| (-0.5..0.0).contains(&p)), "{step}");
    }
    let clipped: f64 = steps
        .iter()
        .map(|s| s["train.clip_fraction"].as_f64().unwrap())
        .sum();
    assert!(clipped > 0.0, "GSPO's clip never bound: {steps:?}");
    let reinforce = [
        "trainer.loss=\"ppo\"",
        "trainer.advantage=\"reinforce_plus_plus_baseline\"",
        "trainer.kl_coef=0.05",
        "trainer.kl_estimator=\"k2\"",
        "trainer.entropy_coeff=0.01",
    ];
    for step in quickstart_steps(&reinforce) {
        assert!(step.get("reward.overlong").is_none(), "{step}");
        let entropy = step["train.entropy"].as_f64();
        assert!(entropy.is_some_and(|h| h > 0.0), "{step}");
        // The reference policy is the warm-started model: the KL to it is reported (as k3).
        let kl = step["train.kl"].as_f64();
        assert!(kl.is_some_and(|kl| kl >= 0.0), "{step}");
    }
}

/// The trained steps' `metrics.jsonl` records of a 4-step quickstart run (20 warm-up steps, no
/// evaluation) with `sets` on top; each logged a finite loss and its clip figures, and the run
/// published version 4.
fn quickstart_steps(sets: &[&str]) -> Vec<serde_json::Value> {
    let dir = tempfile::tempdir().unwrap();
    let sets: Vec<String> = [
        "run.max_steps=4",
        "warmup.max_steps=20",
        "eval.every_steps=0",
        "eval.stop_at_accuracy=1.0",
    ]
    .iter()
    .chain(sets)
    .map(|s| s.to_string())
    .collect();
    let steps = runs::run_records(
        concat!(env!("CARGO_MANIFEST_DIR"), "/configs/quickstart.toml"),
        dir.path(),
        &sets,
    );
    assert_eq!(
        steps.last().unwrap()["policy_version"],
        4,
        "{sets:?}\n{steps:?}"
    );
    let trained: Vec<_> = steps
        .into_iter()
        .filter(|s| s["train.clip_fraction"].is_number())
        .collect();
    assert!(!trained.is_empty(), "{sets:?}");
    for step in &trained {
        assert!(step["loss"].as_f64().is_some_and(f64::is_finite), "{step}");
    }
    trained
}

/// A verl user's data as it is: the GSM8K rows verl's preprocessing writes (Parquet, `prompt`
/// as chat messages, the answer under `reward_model.ground_truth`; `tests/data`) feed a native
/// run of the tiny model through the `qa` task, which scores every reply and trains two steps.
#[test]
fn a_verl_parquet_dataset_trains_through_the_binary() {
    let dir = tempfile::tempdir().unwrap();
    let (config, _) = runs::verl_tiny_config();
    let steps = runs::run_records(config, dir.path(), &runs::verl_qa_sets());
    assert_eq!(steps.last().unwrap()["policy_version"], 2, "{steps:?}");
    // The qa rubric scored the replies that ended against the Parquet rows' answers (a reply cut
    // at the token limit scores 0 without them).
    assert!(
        steps
            .iter()
            .any(|s| s["reward.correct"].is_number() && s["reward.format"].is_number()),
        "{steps:?}"
    );
    // Evaluated on the eight rows at the end.
    assert!(steps[1]["eval_accuracy"].is_number(), "{steps:?}");
}

#[path = "runs/mod.rs"]
mod runs;

#[path = "runs/judge.rs"]
mod judge;

#[path = "runs/reward_model.rs"]
mod reward_model;

#[path = "real_model/mod.rs"]
mod real_model;

/// The real-model recipe runs end to end on the real model: SmolLM2-135M-Instruct (imported
/// from its GGUF), the word problems, the recipe's own config with a smaller batch, shorter
/// replies and a four-problem evaluation; two RL steps train and are logged.
#[test]
fn the_real_model_recipe_trains_two_steps() {
    let model = real_model::smollm2_dir();
    let dir = tempfile::tempdir().unwrap();
    let out = sluice()
        .args([
            "run",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/configs/smollm2_word_problems.toml"
            ),
        ])
        .args([
            "--set",
            &format!("model.path=\"{}\"", model.display()),
            "--set",
            &format!("run.output_dir=\"{}\"", dir.path().display()),
            "--set",
            "run.max_steps=2",
            "--set",
            "rollout.groups_per_step=2",
            "--set",
            "rollout.group_size=4",
            "--set",
            "rollout.max_new_tokens=12",
            "--set",
            "eval.samples=4",
            "--set",
            "eval.samples_per_problem=2",
            "--set",
            "metrics.enabled=false",
            "--set",
            "admin.listen=\"127.0.0.1:0\"",
            "--set",
            "supervision.no_progress_groups=0",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let log = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 2, "{log}");
    for step in &steps {
        assert!(step["loss"].as_f64().is_some_and(f64::is_finite), "{step}");
        assert!(
            step["reward.format"]
                .as_f64()
                .is_some_and(|f| (0.0..=1.0).contains(&f)),
            "the recipe's rubric scored the step: {step}"
        );
    }
    assert_eq!(steps[1]["policy_version"], 2, "{log}");
    // The final evaluation: greedy accuracy, and pass@2 / mean@2 of two sampled replies a problem.
    let last = &steps[1];
    let (pass, mean) = (
        last["eval_pass_at_k"].as_f64().expect("eval_pass_at_k"),
        last["eval_mean_at_k"].as_f64().expect("eval_mean_at_k"),
    );
    assert!(
        (0.0..=1.0).contains(&mean) && mean <= pass && pass <= 1.0,
        "{last}"
    );
    assert!(last["eval_accuracy"].as_f64().is_some(), "{last}");
    // Evaluated before RL and at the end, on the four held-out problems.
    assert!(stdout.contains("held-out accuracy"), "{stdout}");
}
