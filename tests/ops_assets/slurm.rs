//! The shipped `ops/slurm/sluice.sbatch` run by a real Slurm (Debian's `slurmctld`, `slurmd`,
//! `slurm-client`, `munge`; `scripts/test-tools` installs them): one controller and three `slurmd` (n1–n3)
//! on this host, submitted exactly as the README says (`sbatch --nodes=3 ops/slurm/sluice.sbatch`
//! from a submit directory, the configs beside the script): head on n1, an engine node on n2,
//! an env node on n3. It checks that the job starts, the members join and serve, training
//! progresses, `scancel` stops every member cleanly (they leave the head, which checkpoints),
//! a resubmit with the same run directory resumes without a second warm-up, a normal end stops
//! every member cleanly as well, and so does the ordered stop (`scancel --batch --signal=TERM`),
//! after the head's own checkpoint.
//!
//! What the one-host emulation changes, and nothing else: a `hostname` on `PATH` that answers
//! for the Slurm node it runs on (`$SLURMD_NODENAME`: name `n<i>`, address 127.0.0.1<i>), so
//! each node's Sluice processes get their own loopback address as they would get their own
//! machine; the cluster's daemons bind loopback (`one_host_slurm.sh`); `SLUICE_HEAD_SET` shortens
//! the run (fewer steps); and `sluice` is put on `PATH` from this build.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const TOKEN: &str = "slurm-test-token-0123456789";

/// The emulation's `hostname`: each Slurm node answers as its own host.
const HOSTNAME_SHIM: &str = r#"#!/bin/sh
# One-host emulation (tests/ops_assets/slurm.rs): Slurm node n<i> is host n<i> at 127.0.0.1<i>.
n=${SLURMD_NODENAME:-}
[ -n "$n" ] || exec /bin/hostname "$@"
case "$1" in
    -i|-I|--ip-address|--all-ip-addresses) echo "127.0.0.1${n#n}" ;;
    *) echo "$n" ;;
esac
"#;

/// The Slurm cluster of this test; stopped (daemons and any job left) when dropped.
struct Cluster {
    dir: PathBuf,
    script: PathBuf,
}

impl Cluster {
    fn start(dir: &Path) -> Self {
        for tool in [
            "slurmctld",
            "slurmd",
            "sbatch",
            "scontrol",
            "scancel",
            "munged",
        ] {
            let found = Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .is_ok_and(|o| o.status.success());
            assert!(
                found,
                "`{tool}` is missing: this test runs a real Slurm; install Debian's packages \
                 (`apt-get install -y slurmctld slurmd slurm-client munge`, as scripts/test-tools does)"
            );
        }
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ops_assets/one_host_slurm.sh");
        let base = free_port_block(4).to_string();
        let out = Command::new(&script)
            .args(["start", dir.to_str().unwrap(), "3", &base])
            .output()
            .unwrap();
        let cluster = Self {
            dir: dir.to_owned(),
            script,
        };
        assert!(out.status.success(), "starting Slurm: {}", text(&out));
        cluster
    }

    fn conf(&self) -> PathBuf {
        self.dir.join("slurm.conf")
    }

    /// `cmd` with this cluster's `SLURM_CONF`.
    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", self.conf());
        c
    }

    /// `scontrol show job -o ID` as `Key=Value` fields.
    fn job_field(&self, id: &str, field: &str) -> String {
        let out = self
            .cmd("scontrol")
            .args(["show", "job", "-o", id])
            .output()
            .unwrap();
        let line = String::from_utf8_lossy(&out.stdout).into_owned();
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{field}=")))
            .unwrap_or("")
            .to_owned()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.cmd("scancel").args(["--partition=test"]).output();
        let _ = Command::new(&self.script)
            .args(["stop", self.dir.to_str().unwrap()])
            .output();
    }
}

/// The first of `n` consecutive free loopback ports (Slurm's controller and daemons).
fn free_port_block(n: u16) -> u16 {
    for base in (20_000..40_000).step_by(97) {
        if (base..base + n).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return base;
        }
    }
    panic!("no {n} free consecutive loopback ports");
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Waits until `done` holds, or fails with `what` and the logs.
fn wait_for(what: &str, limit: Duration, logs: &Path, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > limit {
            panic!("{what}: not within {limit:?}\n{}", all_logs(logs));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every log of the run (the batch log and each node's), for a failure's message.
fn all_logs(submit: &Path) -> String {
    let mut out = String::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(submit)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    for job in std::fs::read_dir(submit.join("runs/test/logs"))
        .into_iter()
        .flatten()
        .flatten()
    {
        files.extend(
            std::fs::read_dir(job.path())
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path()),
        );
    }
    files.sort();
    for f in files {
        let t = read(&f);
        let tail: String = t
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        out.push_str(&format!("==== {} ====\n{tail}\n", f.display()));
    }
    out
}

/// The steps recorded in the head's `metrics.jsonl`.
fn steps(run: &Path) -> u64 {
    read(&run.join("head/metrics.jsonl"))
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|r| r["step"].as_u64())
        .max()
        .unwrap_or(0)
}

/// The node logs of job `id`: (head, engine, env).
fn node_logs(run: &Path, id: &str) -> (String, String, String) {
    let dir = run.join(format!("logs/job-{id}"));
    (
        read(&dir.join("head-n1.log")),
        read(&dir.join("engine-n2.log")),
        read(&dir.join("env-n3.log")),
    )
}

fn submit(cluster: &Cluster, submit_dir: &Path, path: &str, head_set: &str) -> String {
    let out = cluster
        .cmd("sbatch")
        .current_dir(submit_dir)
        .env("PATH", path)
        .env("SLUICE_ADMIN_TOKEN", TOKEN)
        .env_remove("SLUICE_ENV_TOKEN")
        .env("SLUICE_RUN_DIR", submit_dir.join("runs/test"))
        .env("SLUICE_HEAD_SET", head_set)
        .args(["--parsable", "--nodes=3"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/slurm/sluice.sbatch"))
        .output()
        .unwrap();
    assert!(out.status.success(), "sbatch: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Every member of job `id` stopped by itself on SIGTERM and exited 0: each logged its own stop,
/// none was killed, and nothing of the job still serves. At a normal end (`scancelled` false) no
/// `srun` forced its step either (a `kill` on an srun SIGKILLs its task: the old script's way).
fn assert_members_stopped_cleanly(submit_dir: &Path, run: &Path, id: &str, scancelled: bool) {
    let batch = read(&submit_dir.join(format!("sluice-{id}.log")));
    let (_, engine, env) = node_logs(run, id);
    let logs = || all_logs(submit_dir);
    for (name, log) in [("batch", &batch), ("engine", &engine), ("env", &env)] {
        let lower = log.to_lowercase();
        // A member's step that exits non-zero: `srun: error: n2: task 0: Exited with exit code 1`.
        for bad in [
            "killed",
            "n2: task 0: exited",
            "n3: task 0: exited",
            "panicked",
        ] {
            assert!(
                !lower.contains(bad),
                "{name} log of job {id} says `{bad}`\n{}",
                logs()
            );
        }
    }
    if !scancelled {
        assert!(
            !batch.contains("forcing job termination"),
            "job {id}\n{}",
            logs()
        );
        assert!(
            batch.contains("all members stopped"),
            "job {id}\n{}",
            logs()
        );
    }
    assert!(
        engine.contains("engine node stopped"),
        "job {id}\n{}",
        logs()
    );
    assert!(env.contains("env node stopped"), "job {id}\n{}", logs());
    for addr in ["127.0.0.11:9401", "127.0.0.12:8000", "127.0.0.13:8071"] {
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "{addr} still answers after job {id}\n{}",
            logs()
        );
    }
}

#[test]
fn the_sbatch_script_runs_under_a_real_slurm_stops_cleanly_and_resumes() {
    let t0 = Instant::now();
    let root = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(&root.path().join("slurm"));
    let submit_dir = root.path().join("submit");
    let shim = root.path().join("bin");
    std::fs::create_dir_all(&submit_dir).unwrap();
    std::fs::create_dir_all(&shim).unwrap();
    let hostname = shim.join("hostname");
    std::fs::write(&hostname, HOSTNAME_SHIM).unwrap();
    std::fs::set_permissions(
        &hostname,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let sluice_dir = Path::new(env!("CARGO_BIN_EXE_sluice")).parent().unwrap();
    let path = format!(
        "{}:{}:{}",
        shim.display(),
        sluice_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = submit_dir.join("runs/test");
    let mut timeline = Vec::new();
    let mut mark = |what: &str| timeline.push(format!("{what} {:.1}s", t0.elapsed().as_secs_f64()));
    mark("slurm up");

    // Job 1: started as the README says; scancel once it has trained a few steps.
    let job1 = submit(
        &cluster,
        &submit_dir,
        &path,
        "run.max_steps=1000 supervision.checkpoint_every_steps=5",
    );
    wait_for(
        "job 1 running",
        Duration::from_secs(60),
        &submit_dir,
        || cluster.job_field(&job1, "JobState") == "RUNNING",
    );
    mark("job 1 running");
    wait_for(
        "engine and env nodes joined",
        Duration::from_secs(120),
        &submit_dir,
        || {
            let (head, _, _) = node_logs(&run, &job1);
            head.contains("name=engine-n2")
                && head.contains("name=env-n3")
                && head.matches("node joined").count() >= 2
        },
    );
    mark("nodes joined");
    wait_for(
        "the first step",
        Duration::from_secs(240),
        &submit_dir,
        || steps(&run) >= 1,
    );
    mark("first step");
    // Past the first checkpoint (step 5), so that there is one to resume from.
    wait_for(
        "a checkpoint",
        Duration::from_secs(120),
        &submit_dir,
        || steps(&run) >= 6 && run.join("head/checkpoint/manifest.json").exists(),
    );
    let (_, engine, env) = node_logs(&run, &job1);
    assert!(
        engine.contains("joined the head"),
        "{}",
        all_logs(&submit_dir)
    );
    assert!(env.contains("joined the head"), "{}", all_logs(&submit_dir));
    let out = cluster.cmd("scancel").arg(&job1).output().unwrap();
    assert!(out.status.success(), "scancel: {}", text(&out));
    mark("scancel");
    wait_for("job 1 ended", Duration::from_secs(60), &submit_dir, || {
        !matches!(
            cluster.job_field(&job1, "JobState").as_str(),
            "RUNNING" | "COMPLETING" | "PENDING"
        )
    });
    mark("job 1 ended");
    let (head, engine, env) = node_logs(&run, &job1);
    // Each member left the head while it was still up. (The head, signalled at the same moment,
    // ends its stop at supervision.shutdown_timeout_s: its in-flight rollouts wait for the nodes
    // that just left. The resubmit resumes from its last periodic checkpoint.)
    assert!(
        engine.contains("left the head"),
        "{}",
        all_logs(&submit_dir)
    );
    assert!(env.contains("left the head"), "{}", all_logs(&submit_dir));
    assert!(head.contains("node left"), "{}", all_logs(&submit_dir));
    assert_members_stopped_cleanly(&submit_dir, &run, &job1, true);
    let stopped_at = steps(&run);

    // Job 2: the same run directory resumes from the checkpoint, then ends normally.
    let target = stopped_at + 3;
    let job2 = submit(
        &cluster,
        &submit_dir,
        &path,
        &format!("run.max_steps={target}"),
    );
    wait_for("job 2 ended", Duration::from_secs(300), &submit_dir, || {
        matches!(
            cluster.job_field(&job2, "JobState").as_str(),
            "COMPLETED" | "FAILED" | "CANCELLED" | "TIMEOUT"
        )
    });
    mark("job 2 ended");
    assert_eq!(
        cluster.job_field(&job2, "JobState"),
        "COMPLETED",
        "{}",
        all_logs(&submit_dir)
    );
    assert_eq!(
        cluster.job_field(&job2, "ExitCode"),
        "0:0",
        "{}",
        all_logs(&submit_dir)
    );
    let (head, _, _) = node_logs(&run, &job2);
    assert!(
        head.contains("resumed at step"),
        "{}",
        all_logs(&submit_dir)
    );
    assert!(
        !head.contains("warm-up"),
        "no second warm-up\n{}",
        all_logs(&submit_dir)
    );
    assert_eq!(steps(&run), target, "{}", all_logs(&submit_dir));
    assert_members_stopped_cleanly(&submit_dir, &run, &job2, false);

    // Job 3: the ordered stop (`scancel --batch --signal=TERM`, as the time limit's
    // --signal=B:TERM does): the head stops first while its members serve and checkpoints, then
    // the members stop; every step exits 0.
    let job3 = submit(&cluster, &submit_dir, &path, "run.max_steps=1000");
    wait_for(
        "job 3 trains",
        Duration::from_secs(120),
        &submit_dir,
        || steps(&run) > target + 1,
    );
    mark("job 3 training");
    let out = cluster
        .cmd("scancel")
        .args(["--batch", "--signal=TERM", &job3])
        .output()
        .unwrap();
    assert!(out.status.success(), "scancel --batch: {}", text(&out));
    wait_for("job 3 ended", Duration::from_secs(60), &submit_dir, || {
        !matches!(
            cluster.job_field(&job3, "JobState").as_str(),
            "RUNNING" | "COMPLETING" | "PENDING"
        )
    });
    mark("job 3 ended");
    let (head, _, _) = node_logs(&run, &job3);
    assert!(
        head.contains("reason=\"stop\"") && head.contains("restart with the same config to resume"),
        "the head checkpointed on its stop\n{}",
        all_logs(&submit_dir)
    );
    assert_eq!(
        cluster.job_field(&job3, "ExitCode"),
        "0:0",
        "{}",
        all_logs(&submit_dir)
    );
    assert_members_stopped_cleanly(&submit_dir, &run, &job3, false);
    eprintln!("timeline: {}", timeline.join(", "));
}
