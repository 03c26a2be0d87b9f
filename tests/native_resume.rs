//! The quickstart stopped mid-RL and started again with the same command, as a user does it:
//! `sluice run configs/quickstart.toml` (shortened warm-up), stopped at RL step N ≥ 20 with
//! SIGTERM or `kill -9`, then run again until step N + 15.
//!
//! What the restart must do: resume from the checkpoint (no warm-up again, a first evaluation of
//! the checkpoint's weights, "resumed at step K"), continue `metrics.jsonl` with every step
//! exactly once in order (the steps after a `kill -9`'s last checkpoint are trained and logged
//! again), keep wall time running forward, and never lose a trained step's weights after a
//! graceful stop. Timings (stop, resume to first step) are printed, never asserted.
//!
//! Beside it: corrupt or mismatched checkpoints refused, and (`native_resume/trainer_kinds.rs`)
//! runs whose trainer keeps more than the weights (LoRA's adapters, PPO's critic) checkpoint it
//! and resume with it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "native_resume/trainer_kinds.rs"]
mod trainer_kinds;

/// RL steps before the stop.
const STOP_AT: u64 = 20;
/// RL steps the restart must add.
const MORE: u64 = 15;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Run {
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Run {
    fn start(out: &Path, tag: &str) -> Self {
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/quickstart.toml");
        let sets = [
            format!("run.output_dir={}", out.display()),
            format!("model.path={}", out.join("model").display()),
            format!("replay.path={}", out.join("replay").display()),
            "warmup.max_steps=20".to_owned(),
            "eval.every_steps=10".to_owned(),
            "eval.stop_at_accuracy=1.0".to_owned(),
            "supervision.checkpoint_every_steps=10".to_owned(),
            "metrics.enabled=false".to_owned(),
            format!("admin.listen=127.0.0.1:{}", free_port()),
        ];
        Self::spawn(out, tag, &config, &sets)
    }

    /// `sluice run config --set …`, its output kept beside `out` under `tag`.
    fn spawn(out: &Path, tag: &str, config: &Path, sets: &[String]) -> Self {
        let stdout = out.with_extension(format!("{tag}.out"));
        let stderr = out.with_extension(format!("{tag}.err"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        cmd.arg("run").arg(config);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let child = cmd
            .stdout(Stdio::from(File::create(&stdout).unwrap()))
            .stderr(Stdio::from(File::create(&stderr).unwrap()))
            .spawn()
            .unwrap();
        Self {
            child,
            stdout,
            stderr,
        }
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    fn logs(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            self.stdout(),
            std::fs::read_to_string(&self.stderr).unwrap_or_default()
        )
    }

    /// Waits until the log holds step `step`; returns when it appeared.
    fn wait_step(&mut self, log: &Path, step: u64) -> Instant {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            if last_step(log) >= step {
                return Instant::now();
            }
            if let Some(code) = self.child.try_wait().unwrap() {
                panic!("sluice exited ({code}) before step {step}\n{}", self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "no step {step} in time\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([format!("-{name}"), self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{name}");
    }

    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(code) = self.child.try_wait().unwrap() {
                return code;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("sluice did not exit in time\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn records(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn last_step(log: &Path) -> u64 {
    records(log)
        .last()
        .and_then(|r| r["step"].as_u64())
        .unwrap_or(0)
}

fn manifest(out: &Path) -> Value {
    let text = std::fs::read_to_string(out.join("checkpoint/manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Stops a run at step ≥ `STOP_AT` with `signal`, restarts it and runs `MORE` steps past the
/// checkpoint. `prepared` holds a model and warm-start to reuse (the warm-up is the same).
fn stop_and_resume(signal: &str, prepared: Option<&Path>) -> PathBuf {
    let dir = tempfile::tempdir().unwrap().keep();
    let out = dir.join("run");
    if let Some(from) = prepared {
        std::fs::create_dir_all(&out).unwrap();
        for sub in ["model", "warmup"] {
            let ok = Command::new("cp")
                .arg("-r")
                .arg(from.join(sub))
                .arg(out.join(sub))
                .status()
                .unwrap()
                .success();
            assert!(ok);
        }
    }
    let log = out.join("metrics.jsonl");

    let mut first = Run::start(&out, "first");
    first.wait_step(&log, STOP_AT);
    let signalled = Instant::now();
    first.signal(signal);
    let code = first.wait_exit();
    let stop_seconds = signalled.elapsed().as_secs_f64();
    let checkpoint = manifest(&out);
    let k = checkpoint["steps"].as_u64().unwrap();
    if signal == "TERM" {
        assert!(code.success(), "{code}\n{}", first.logs());
        assert!(
            k >= STOP_AT,
            "the stop checkpoint holds every step: {checkpoint}"
        );
        // No step after the checkpoint's mark: what was consumed was trained, and its weights
        // are the checkpoint's.
        assert_eq!(
            checkpoint["trained_groups"], checkpoint["replay"]["consumed_total"],
            "{checkpoint}"
        );
        assert_eq!(
            checkpoint["version"],
            checkpoint["replay"]["policy_version"]
        );
        assert_eq!(last_step(&log), k, "the log holds the checkpoint's steps");
    } else {
        assert!(!code.success());
        assert!(
            k >= 10 && k <= last_step(&log),
            "periodic checkpoint: {checkpoint}"
        );
    }

    let restarted = Instant::now();
    let mut second = Run::start(&out, "second");
    let first_new = second.wait_step(&log, k + 1);
    second.wait_step(&log, k + MORE);
    second.signal("TERM");
    assert!(second.wait_exit().success(), "{}", second.logs());
    eprintln!(
        "{signal}: stopped at step {k} in {stop_seconds:.2} s; restart to step {} took {:.1} s, {} more steps {:.1} s",
        k + 1,
        first_new.duration_since(restarted).as_secs_f64(),
        MORE - 1,
        first_new.elapsed().as_secs_f64()
    );

    let stdout = second.stdout();
    assert!(
        stdout.contains(&format!("resumed at step {k}: held-out accuracy")),
        "{}",
        second.logs()
    );
    assert!(
        !stdout.contains("warm-up step"),
        "no second warm-up\n{stdout}"
    );
    assert!(!stdout.contains("before RL"), "{stdout}");
    if signal == "TERM" {
        let err = std::fs::read_to_string(&second.stderr).unwrap();
        assert!(
            !err.contains("weights newer than the last checkpoint were lost"),
            "a graceful stop loses no weights\n{err}"
        );
    }

    // Every step exactly once, in order, across both processes; wall time runs forward.
    let all = records(&log);
    let steps: Vec<u64> = all.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    let expected: Vec<u64> = (1..=steps.len() as u64).collect();
    assert_eq!(steps, expected, "steps in metrics.jsonl");
    assert!(steps.len() as u64 >= k + MORE);
    let wall: Vec<f64> = all.iter().map(|r| r["wall_s"].as_f64().unwrap()).collect();
    assert!(wall.windows(2).all(|w| w[1] >= w[0]), "wall time: {wall:?}");
    // The first evaluation after the restart is on schedule, counted from the run's start.
    for r in &all {
        let s = r["step"].as_u64().unwrap();
        if s > k && s.is_multiple_of(10) {
            assert!(r.get("eval_accuracy").is_some(), "step {s} evaluated: {r}");
        }
    }
    out
}

#[test]
fn the_quickstart_resumes_after_sigterm_and_after_kill_9() {
    let out = stop_and_resume("TERM", None);
    stop_and_resume("KILL", Some(&out));
}

/// A finished 3-step quickstart run without warm-up (model, data, checkpoint, replay store),
/// made once and copied by each test that corrupts it.
fn finished_short_run() -> &'static Path {
    static RUN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    RUN.get_or_init(|| {
        let out = tempfile::tempdir().unwrap().keep().join("run");
        let mut run = short_run(&out, 3);
        let code = run.wait_exit();
        assert!(code.success(), "{code}\n{}", run.logs());
        assert_eq!(manifest(&out)["steps"], 3, "{}", run.logs());
        out
    })
}

/// `sluice run` on the quickstart without warm-up or evaluations, to `max_steps`.
fn short_run(out: &Path, max_steps: u64) -> Run {
    short_run_with(out, max_steps, &[])
}

/// [`short_run`] with `extra` settings on top.
fn short_run_with(out: &Path, max_steps: u64, extra: &[&str]) -> Run {
    let mut sets = vec![
        format!("run.output_dir={}", out.display()),
        format!("model.path={}", out.join("model").display()),
        format!("replay.path={}", out.join("replay").display()),
        format!("run.max_steps={max_steps}"),
        "warmup.enabled=false".to_owned(),
        "eval.every_steps=0".to_owned(),
        "eval.stop_at_accuracy=1.0".to_owned(),
        "replay.filter_zero_advantage=false".to_owned(),
        "metrics.enabled=false".to_owned(),
        format!("admin.listen=127.0.0.1:{}", free_port()),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/quickstart.toml");
    Run::spawn(out, &format!("steps{max_steps}"), &config, &sets)
}

/// Copies the finished short run, applies `corrupt` to the copy, sums its files afresh into the
/// manifest (as if the checkpoint had been written that way: what is tested is the check of
/// what the files say, not of their sums), resumes it to step 5 and asserts that the resume
/// exits non-zero with every one of `expected` in its output.
fn resume_refused(what: &str, corrupt: impl FnOnce(&Path), expected: &[&str]) {
    resume_refused_as(what, corrupt, true, expected);
}

fn resume_refused_as(what: &str, corrupt: impl FnOnce(&Path), reseal: bool, expected: &[&str]) {
    let out = tempfile::tempdir().unwrap().keep().join("run");
    let ok = Command::new("cp")
        .arg("-r")
        .arg(finished_short_run())
        .arg(&out)
        .status()
        .unwrap()
        .success();
    assert!(ok);
    corrupt(&out);
    let manifest = out.join("checkpoint/manifest.json");
    if reseal && manifest.exists() {
        let sums = sluice_actors::checkpoint::file_sums(&out.join("checkpoint")).unwrap();
        edit_json(&manifest, |m| {
            m["files"] = serde_json::to_value(sums).unwrap()
        });
    }
    let mut run = short_run(&out, 5);
    let code = run.wait_exit();
    let logs = run.logs();
    assert!(!code.success(), "{what}: the resume must fail\n{logs}");
    for e in expected {
        assert!(logs.contains(e), "{what}: `{e}` not in the output\n{logs}");
    }
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, value.to_string()).unwrap();
}

/// Sets the first value of tensor `name` (F32) in the safetensors file `path` to `value`.
fn set_first_f32(path: &Path, name: &str, value: f32) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header[name]["dtype"], "F32", "{name}");
    let at = 8 + n + header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

/// Multiplies every value of the safetensors file `path` (all F32: the trainer's master
/// weights) by `factor`.
fn scale_f32_tensors(path: &Path, factor: f32) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    for (name, t) in header.as_object().unwrap() {
        assert!(name == "__metadata__" || t["dtype"] == "F32", "{name}: {t}");
    }
    for v in bytes[8 + n..].chunks_exact_mut(4) {
        let x = f32::from_le_bytes(v.try_into().unwrap()) * factor;
        v.copy_from_slice(&x.to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_resume_from_corrupt_optimizer_state_or_weights_stops_loudly() {
    let state = |out: &Path| out.join("checkpoint/trainer/trainer_state.json");
    resume_refused(
        "optimizer_step = u64::MAX",
        |out| edit_json(&state(out), |s| s["optimizer_step"] = u64::MAX.into()),
        &[
            "trainer_state.json",
            "`optimizer_step` = 18446744073709551615",
        ],
    );
    resume_refused(
        "a negative second moment",
        |out| {
            let path = out.join("checkpoint/trainer/optimizer.safetensors");
            set_first_f32(&path, "v.2", -1.5);
        },
        &[
            "optimizer.safetensors",
            "`v.2` (second moment) holds -1.5 at element 0",
        ],
    );
    // Any change to a file after the write, such as these, is refused by its sum first.
    resume_refused_as(
        "a byte of the weights flipped after the write",
        |out| {
            let path = out.join("checkpoint/trainer/model/model.safetensors");
            let mut bytes = std::fs::read(&path).unwrap();
            let last = bytes.len() - 3;
            bytes[last] ^= 0x40;
            std::fs::write(&path, bytes).unwrap();
        },
        false,
        &[
            "model.safetensors",
            "changed since the checkpoint was written",
        ],
    );
    // Finite but huge weights pass the load's finite check; the first step must refuse them.
    resume_refused(
        "weights scaled to huge finite values",
        |out| {
            scale_f32_tensors(
                &out.join("checkpoint/trainer/model/model.safetensors"),
                1e30,
            )
        },
        &["the optimizer update is refused"],
    );
}

#[test]
fn a_resume_whose_checkpoint_files_disagree_is_refused() {
    let manifest_path = |out: &Path| out.join("checkpoint/manifest.json");
    for version in [2u64, 500, u64::MAX] {
        resume_refused(
            &format!("manifest at version {version}"),
            |out| {
                edit_json(&manifest_path(out), |m| {
                    m["version"] = version.into();
                    m["steps"] = version.min(3).into();
                })
            },
            &[
                "manifest.json",
                &format!("says version {version}"),
                "trainer_state.json holds version 3",
            ],
        );
    }
    resume_refused(
        "manifest at step 500",
        |out| edit_json(&manifest_path(out), |m| m["steps"] = 500.into()),
        &[
            "manifest.json",
            "`steps` = 500 is more than `trained_groups`",
        ],
    );
    resume_refused(
        "manifest removed",
        |out| std::fs::remove_file(manifest_path(out)).unwrap(),
        &["manifest.json: missing", "checkpoint/trainer"],
    );
    resume_refused(
        "an unknown schedule",
        |out| {
            edit_json(&out.join("checkpoint/trainer/trainer_state.json"), |s| {
                s["schedule"] = "wobble".into()
            })
        },
        &["trainer_state.json", "`schedule` = \"wobble\""],
    );
}

#[test]
fn a_resume_with_its_replay_store_missing_or_emptied_is_refused() {
    let store = |out: &Path| out.join("replay/replay.redb");
    resume_refused(
        "replay.redb emptied",
        |out| std::fs::write(store(out), b"").unwrap(),
        &["replay.redb is new", "`consumed_total` 0", "manifest.json"],
    );
    resume_refused(
        "replay.redb removed",
        |out| std::fs::remove_file(store(out)).unwrap(),
        &["replay.redb is new", "`admitted_total` 0", "manifest.json"],
    );
}

/// A run that meets its held-out target writes the evaluated weights that met it (the
/// trainer's checkpoint is a step or more past them) as a model directory; a
/// finished run started again has nothing to do, while a raised target trains on, and a resume
/// under another seed says which key changed.
#[test]
fn the_weights_that_met_the_target_are_kept_and_a_finished_run_stays_finished() {
    let out = tempfile::tempdir().unwrap().keep().join("run");
    let sets = || {
        [
            format!("run.output_dir={}", out.display()),
            format!("model.path={}", out.join("model").display()),
            format!("replay.path={}", out.join("replay").display()),
            "run.max_steps=1000".to_owned(),
            "warmup.enabled=false".to_owned(),
            "replay.filter_zero_advantage=false".to_owned(),
            "eval.every_steps=2".to_owned(),
            // Any accuracy meets it: the first evaluation ends the run.
            "eval.stop_at_accuracy=0.0".to_owned(),
            "metrics.enabled=false".to_owned(),
            format!("admin.listen=127.0.0.1:{}", free_port()),
        ]
    };
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/quickstart.toml");
    let mut first = Run::spawn(&out, "target1", &config, &sets());
    let code = first.wait_exit();
    assert!(code.success(), "{code}\n{}", first.logs());
    let dir = out.join(sluice_node::run::TARGET_MODEL_DIR);
    assert!(
        first
            .stdout()
            .contains(&format!("model at target       {} (step 2)", dir.display())),
        "{}",
        first.logs()
    );
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(dir.join(file).is_file(), "{file} in {}", dir.display());
    }
    let resumed_at = manifest(&out)["steps"].as_u64().unwrap();
    // Started again, it has nothing to do: its checkpoint says it reached the same target.
    let mut again = Run::spawn(&out, "target2", &config, &sets());
    let code = again.wait_exit();
    assert!(code.success(), "{code}\n{}", again.logs());
    assert!(
        again.stdout().contains(&format!(
            "the run already reached its held-out target (0.0%, eval.stop_at_accuracy; checkpoint {} at step {resumed_at}): nothing to do; the weights that met it are in {}",
            out.join("checkpoint").display(),
            dir.display()
        )),
        "{}",
        again.logs()
    );
    assert_eq!(
        manifest(&out)["steps"].as_u64(),
        Some(resumed_at),
        "trained on"
    );
    // A higher target trains on; another seed is said, the raised target and budget are not.
    let mut raised = sets().to_vec();
    raised.extend([
        "eval.stop_at_accuracy=1.0".to_owned(),
        format!("run.max_steps={}", resumed_at + 2),
        "run.seed=7".to_owned(),
    ]);
    let mut third = Run::spawn(&out, "target3", &config, &raised);
    let code = third.wait_exit();
    assert!(code.success(), "{code}\n{}", third.logs());
    let logs = third.logs();
    assert!(
        logs.contains(&format!("resumed at step {resumed_at}"))
            && logs.contains("resuming with a config that differs from the checkpoint's")
            && logs.contains("run.seed: 0 → 7")
            && !logs.contains("eval.stop_at_accuracy:")
            && !logs.contains("run.max_steps:"),
        "{logs}"
    );
    assert_eq!(manifest(&out)["steps"].as_u64(), Some(resumed_at + 2));
}

/// A stop during the warm-up (before RL, with nothing to checkpoint) ends the run at once with
/// a word and exit 130, where the signal's default action killed it without one.
#[test]
fn a_stop_during_the_warm_up_says_so() {
    let out = tempfile::tempdir().unwrap().keep().join("run");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/quickstart.toml");
    let sets = [
        format!("run.output_dir={}", out.display()),
        "warmup.max_steps=1500".to_owned(),
        "metrics.enabled=false".to_owned(),
        format!("admin.listen=127.0.0.1:{}", free_port()),
    ];
    let mut run = Run::spawn(&out, "warmup-stop", &config, &sets);
    let deadline = Instant::now() + Duration::from_secs(300);
    while !run.stdout().contains("warm-up step 10/") {
        assert!(Instant::now() < deadline, "no warm-up step\n{}", run.logs());
        assert!(run.child.try_wait().unwrap().is_none(), "{}", run.logs());
        std::thread::sleep(Duration::from_millis(20));
    }
    run.signal("TERM");
    let code = run.wait_exit();
    assert_eq!(code.code(), Some(130), "{}", run.logs());
    assert!(
        run.logs().contains("stopped before RL began"),
        "{}",
        run.logs()
    );
}
