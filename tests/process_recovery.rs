//! Real processes: `sluice run` on a simulated config, stopped with SIGTERM or killed with
//! SIGKILL mid-run, then started again with the same config.
//!
//! - SIGTERM: exit 0 after storing in-flight groups as aborted and writing a checkpoint; the
//!   restart continues the step count and the version, and every consumed group was trained
//!   exactly once across both processes.
//! - `kill -9`: every group the replay store acknowledged is still there; the restart resumes
//!   from the last periodic checkpoint and never trains a consumed group again.
//!
//! Timings (SIGTERM → exit, restart → first step) are printed (`-- --nocapture`), never asserted.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_replay::{Bucket, Persister, ReplayStore};

const B: u64 = 4;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn write_config(dir: &Path, port: u16, extra: &str) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "proc"
max_steps = 1000
output_dir = "{out}"

[engine]
backend = "simulated"
replicas = 2
max_running_sequences = 16

[engine.simulated]
time_scale = 1.0
prompt_tokens = 8
env_reply_tokens = 2
decode_step_base_seconds = 0.001
decode_step_per_sequence_seconds = 0.0
prefill_seconds_per_token = 0.0

[engine.simulated.lengths.default]
distribution = "uniform"
min = 20
max = 120

[trainer.simulated]
enabled = true
step_base_seconds = 0.02
step_seconds_per_token = 0.0

[rollout]
group_size = 3
groups_per_step = {B}
max_new_tokens = 64
weight_update_mode = "abort_resume"
enable_partial_rollout = true
max_version_lag = 2
staleness_threshold = 1.0

[replay]
filter_zero_advantage = false

[metrics]
enabled = false

[admin]
listen = "127.0.0.1:{port}"

{extra}
"#,
        out = dir.join("out").display()
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, text).unwrap();
    path
}

struct Run {
    child: Child,
    base: String,
    stdout: PathBuf,
    stderr: PathBuf,
}

fn start(dir: &Path, config: &Path, port: u16, tag: &str, sets: &[String]) -> Run {
    let stdout = dir.join(format!("{tag}.out"));
    let stderr = dir.join(format!("{tag}.err"));
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
    Run {
        child,
        base: format!("http://127.0.0.1:{port}"),
        stdout,
        stderr,
    }
}

impl Run {
    fn logs(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            std::fs::read_to_string(&self.stdout).unwrap_or_default(),
            std::fs::read_to_string(&self.stderr).unwrap_or_default()
        )
    }

    /// `/v1/status`, or `None` while the node is not serving yet.
    fn status(&self) -> Option<Value> {
        let (code, body) =
            sluice_node::client::request(&self.base, "GET", "/v1/status", None, None).ok()?;
        (code == 200).then(|| serde_json::from_str(&body).unwrap())
    }

    /// Polls the status until `ok` holds; returns it.
    fn wait_status(&mut self, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(s) = self.status()
                && ok(&s)
            {
                return s;
            }
            if let Some(code) = self.child.try_wait().unwrap() {
                panic!("sluice exited ({code}) before {what}\n{}", self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "timed out: {what}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(code) = self.child.try_wait().unwrap() {
                return code;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("sluice did not exit within {limit:?}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn steps(s: &Value) -> u64 {
    s["trainer"]["steps"].as_u64().unwrap()
}

fn manifest(dir: &Path) -> Value {
    let path = dir.join("out").join("checkpoint").join("manifest.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Opens the replay database the way a restart does and checks its accounting.
fn replay_on_disk(dir: &Path) -> (ReplayStore, Vec<Bucket>) {
    let (persister, recovered) = Persister::open(&dir.join("out").join("replay")).unwrap();
    drop(persister);
    let buckets = recovered.groups.iter().map(|(b, _)| *b).collect();
    let store = ReplayStore::recover(false, false, recovered.counters, recovered.groups);
    store.reconcile().unwrap();
    (store, buckets)
}

fn summary_value(stdout: &str, key: &str) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("no `{key}` in\n{stdout}"));
    line[key.len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn sigterm_checkpoints_and_a_restart_continues() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, "");
    let mut run = start(dir.path(), &config, port, "run1", &[]);
    run.wait_status("3 steps", |s| steps(s) >= 3);

    let signalled = Instant::now();
    let ok = Command::new("kill")
        .args(["-TERM", &run.child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let code = run.wait_exit(Duration::from_secs(90));
    let stop_seconds = signalled.elapsed().as_secs_f64();
    assert!(code.success(), "exit {code}\n{}", run.logs());
    let err = std::fs::read_to_string(&run.stderr).unwrap();
    assert!(err.contains("checkpoint v"), "{err}");

    let m = manifest(dir.path());
    assert_eq!(m["reason"], "stop");
    let (m_steps, m_version) = (m["steps"].as_u64().unwrap(), m["version"].as_u64().unwrap());
    assert!(m_steps >= 3);
    assert_eq!(
        m["trained_groups"], m["replay"]["consumed_total"],
        "every consumed group was trained before the checkpoint"
    );
    let (store, buckets) = replay_on_disk(dir.path());
    assert!(
        !buckets.contains(&Bucket::InFlight) && !buckets.contains(&Bucket::Pending),
        "the stop stored every in-flight group (as aborted): {buckets:?}"
    );
    let aborted_at_stop = store.count(Bucket::Aborted);
    let consumed_at_stop = store.counters().consumed_total;
    drop(store);

    let port2 = free_port();
    let more = 3;
    let mut run = start(
        dir.path(),
        &config,
        port2,
        "run2",
        &[
            format!("run.max_steps={}", m_steps + more),
            format!("admin.listen=\"127.0.0.1:{port2}\""),
        ],
    );
    let first = run.wait_status("the resumed node", |_| true);
    assert!(
        steps(&first) >= m_steps,
        "the step count continues: {first}"
    );
    let code = run.wait_exit(Duration::from_secs(120));
    assert!(code.success(), "exit {code}\n{}", run.logs());
    let out = std::fs::read_to_string(&run.stdout).unwrap();
    assert_eq!(summary_value(&out, "steps"), m_steps + more, "{out}");
    assert_eq!(
        summary_value(&out, "policy version"),
        m_version + more,
        "{out}"
    );
    // What this process trained is said to be since the resume, not the run's.
    let since = format!("since the resume at step {m_steps}");
    for key in ["trained samples", "trained tokens", "version lag"] {
        let line = out.lines().find(|l| l.starts_with(key)).unwrap();
        assert!(line.contains(&since), "{line}\n{out}");
    }
    let m2 = manifest(dir.path());
    assert_eq!(m2["reason"], "done");
    assert_eq!(m2["steps"].as_u64().unwrap(), m_steps + more);
    let (store, _) = replay_on_disk(dir.path());
    let c = store.counters();
    assert_eq!(c.consumed_total, consumed_at_stop + more * B);
    assert_eq!(
        m2["trained_groups"].as_u64().unwrap(),
        c.consumed_total,
        "every consumed group was trained exactly once across both processes"
    );
    println!(
        "SIGTERM -> exit {stop_seconds:.2} s; checkpoint v{m_version} step {m_steps}; {aborted_at_stop} groups stored as aborted; \
         after restart: step {}, v{}, consumed {} = trained {}",
        m_steps + more,
        m_version + more,
        c.consumed_total,
        m2["trained_groups"]
    );
}

#[test]
fn kill_9_loses_no_acknowledged_group_and_trains_none_twice() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(
        dir.path(),
        port,
        "[supervision]\ncheckpoint_every_steps = 2",
    );
    let mut run = start(dir.path(), &config, port, "run1", &[]);
    let manifest_path = dir
        .path()
        .join("out")
        .join("checkpoint")
        .join("manifest.json");
    let seen = run.wait_status("5 steps and a checkpoint", |s| {
        steps(s) >= 5 && manifest_path.exists()
    });
    run.child.kill().unwrap();
    run.wait_exit(Duration::from_secs(30));

    // Everything the store acknowledged (the status is served after its commit) is on disk.
    let (store, _) = replay_on_disk(dir.path());
    let c = store.counters().clone();
    let acked = &seen["replay"]["counters"];
    assert!(c.admitted_total >= acked["admitted_total"].as_u64().unwrap());
    assert!(c.consumed_total >= acked["consumed_total"].as_u64().unwrap());
    let live_after_kill: Vec<_> = [Bucket::Completed, Bucket::Aborted, Bucket::Expired]
        .iter()
        .map(|b| store.count(*b))
        .collect();
    drop(store);
    let m = manifest(dir.path());
    let (m_steps, m_trained) = (
        m["steps"].as_u64().unwrap(),
        m["trained_groups"].as_u64().unwrap(),
    );
    assert!(m_steps >= 2 && m_steps % 2 == 0, "{m}");
    // Batches consumed after the checkpoint: trained by weights the crash lost, never again.
    let lost = c.consumed_total - m_trained;

    let port2 = free_port();
    let more = 3;
    let restarted = Instant::now();
    let mut run = start(
        dir.path(),
        &config,
        port2,
        "run2",
        &[
            format!("run.max_steps={}", m_steps + more),
            format!("admin.listen=\"127.0.0.1:{port2}\""),
        ],
    );
    let first = run.wait_status("the recovered node", |_| true);
    let ready_seconds = restarted.elapsed().as_secs_f64();
    assert!(steps(&first) >= m_steps, "resumes at the checkpoint's step");
    // The version the run resumed at (the sim trainer publishes one version per step).
    let start_version = first["trainer"]["version"].as_u64().unwrap() - (steps(&first) - m_steps);
    assert!(
        start_version >= m["version"].as_u64().unwrap(),
        "versions never go backwards"
    );
    run.wait_status("a step after recovery", |s| steps(s) > m_steps);
    let step_seconds = restarted.elapsed().as_secs_f64();
    let code = run.wait_exit(Duration::from_secs(120));
    assert!(code.success(), "exit {code}\n{}", run.logs());
    let out = std::fs::read_to_string(&run.stdout).unwrap();
    assert_eq!(summary_value(&out, "policy version"), start_version + more);

    let (store, _) = replay_on_disk(dir.path());
    let end = store.counters();
    assert_eq!(
        end.consumed_total,
        c.consumed_total + more * B,
        "the restart consumed only new batches: nothing trained twice"
    );
    let m2 = manifest(dir.path());
    assert_eq!(m2["trained_groups"].as_u64().unwrap(), m_trained + more * B);
    assert!(end.admitted_total >= c.admitted_total);
    println!(
        "kill -9 at step {} (checkpoint at {m_steps}); live groups on disk after the kill \
         (completed, aborted, expired) {live_after_kill:?}; {lost} consumed groups' training lost with the process; \
         restart: API up in {ready_seconds:.2} s, first step at {step_seconds:.2} s; v{start_version} -> v{}",
        steps(&seen),
        start_version + more
    );
}
