//! The quickstart stopped mid-RL and started again with the same command, as a user does it:
//! `sluice run configs/quickstart.toml` (shortened warm-up), stopped at RL step N ≥ 20 with
//! SIGTERM or `kill -9`, then run again until step N + 15.
//!
//! What the restart must do: resume from the checkpoint (no warm-up again, a first evaluation of
//! the checkpoint's weights, "resumed at step K"), continue `metrics.jsonl` with every step
//! exactly once in order (the steps after a `kill -9`'s last checkpoint are trained and logged
//! again), keep wall time running forward, and never lose a trained step's weights after a
//! graceful stop. Timings (stop, resume to first step) are printed, never asserted.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

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
        let stdout = out.with_extension(format!("{tag}.out"));
        let stderr = out.with_extension(format!("{tag}.err"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        cmd.arg("run").arg(&config);
        for s in &sets {
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
