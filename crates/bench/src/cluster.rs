//! `sluice bench cluster`: the cost of splitting a run over machines (`docs/cluster.md`), in
//! one run on this machine. The same RL job — the `tiny` preset on `math::arithmetic`, two engine
//! replicas, `abort_resume`, a version published every step — runs twice, each as real `sluice
//! run` processes with their own output directories:
//!
//! - **one process**: `engine.backend = "native"`, both replicas in the process;
//! - **split**: a head (`node.role = "head"`, `engine.backend = "remote"`) and two engine nodes
//!   on loopback that join it and fetch every version from it over HTTP.
//!
//! Steps/s is read from each run's `metrics.jsonl` between step `--skip-steps` and the last one
//! (the model's creation, the first evaluation and the nodes' joining are left out); the ratio
//! split ÷ one process is the overhead of the split. Then one version of `--weights-preset` is
//! delivered over HTTP as `sluice bench weights` does ([`crate::weights::measure`]) and compared
//! with a raw loopback copy. The processes share this machine's cores, so the split pays for
//! three processes where separate machines would not; the ratio is an upper bound on the cost.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sluice_config::ModelPreset;
use sluice_report::{METRICS_FILE, read_log};

/// `sluice bench cluster`
#[derive(Debug, Clone, clap::Args)]
pub struct BenchClusterArgs {
    /// RL steps of each run.
    #[arg(long, default_value_t = 40)]
    pub steps: u64,
    /// Steps left out at the start of each run before steps/s is measured.
    #[arg(long, default_value_t = 5)]
    pub skip_steps: u64,
    /// Preset whose weight delivery is measured.
    #[arg(long, value_parser = ModelPreset::parse_name, default_value = "small")]
    pub weights_preset: ModelPreset,
    /// Timed weight transfers of each kind (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
}

/// The node token the head and its engine nodes share.
const TOKEN: &str = "bench-cluster-token";
/// Longest a run may take.
const RUN_LIMIT: Duration = Duration::from_secs(1800);

/// The job both runs train: everything but where the engines are.
fn job(out: &Path, steps: u64) -> String {
    format!(
        r#"
[run]
name = "bench-cluster"
max_steps = {steps}
output_dir = "{out}"

[model]
init_preset = "tiny"

[engine]
replicas = 2
max_running_sequences = 64

[trainer]
micro_batch_size = 16
max_seq_len = 128

[rollout]
group_size = 4
groups_per_step = 4
max_new_tokens = 6
max_version_lag = 1
weight_update_mode = "abort_resume"
enable_partial_rollout = true

[data]
datasets = ["math::arithmetic@train"]

[replay]
filter_zero_advantage = false

[warmup]
enabled = false

[eval]
every_steps = 0
samples = 8

[metrics]
enabled = false
"#,
        out = out.display()
    )
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A `sluice run` process, killed when dropped (a failed benchmark leaves nothing running).
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn start(config: &Path, log: PathBuf) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("finding the sluice binary")?;
        let file = std::fs::File::create(&log)?;
        let child = Command::new(exe)
            .arg("run")
            .arg(config)
            .env("SLUICE_ADMIN_TOKEN", TOKEN)
            .stdout(Stdio::from(file.try_clone()?))
            .stderr(Stdio::from(file))
            .spawn()
            .with_context(|| format!("starting sluice run {}", config.display()))?;
        Ok(Self { child, log })
    }

    /// Waits for a clean exit.
    fn wait(&mut self, what: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + RUN_LIMIT;
        loop {
            if let Some(code) = self.child.try_wait()? {
                if code.success() {
                    return Ok(());
                }
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                bail!(
                    "{what} exited with {code}; the end of its log:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            if Instant::now() > deadline {
                bail!("{what} did not finish within {RUN_LIMIT:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Steps/s of the run logged under `out`, between step `skip` and its last step.
fn steps_per_second(out: &Path, skip: u64) -> anyhow::Result<(u64, f64, f64)> {
    let log = out.join(METRICS_FILE);
    let records = read_log(&log).with_context(|| format!("reading {}", log.display()))?;
    let first = records
        .iter()
        .find(|r| r.step >= skip)
        .with_context(|| format!("{}: no step at or after {skip}", log.display()))?;
    let last = records.last().expect("a record was found above");
    let steps = last.step - first.step;
    let seconds = last.wall_s - first.wall_s;
    if steps == 0 || seconds <= 0.0 {
        bail!(
            "{}: steps {}..{} leave nothing to measure; raise --steps",
            log.display(),
            first.step,
            last.step
        );
    }
    Ok((steps, seconds, steps as f64 / seconds))
}

/// The job in one process; its output directory.
fn one_process(dir: &Path, steps: u64) -> anyhow::Result<PathBuf> {
    let out = dir.join("one");
    let config = dir.join("one.toml");
    // Its admin API on a free port, as the head's: the default one may be taken on this host.
    let admin = format!("\n[admin]\nlisten = \"127.0.0.1:{}\"\n", free_port()?);
    std::fs::write(
        &config,
        job(&out, steps).replace(
            "[engine]\nreplicas = 2",
            "[engine]\nbackend = \"native\"\nreplicas = 2",
        ) + &admin,
    )?;
    Proc::start(&config, dir.join("one.log"))?.wait("the one-process run")?;
    Ok(out)
}

/// The job on a head with two engine nodes; the head's output directory.
fn split(dir: &Path, steps: u64) -> anyhow::Result<PathBuf> {
    let out = dir.join("head");
    let admin = format!("127.0.0.1:{}", free_port()?);
    let head = dir.join("head.toml");
    let text = job(&out, steps).replace(
        "[engine]\nreplicas = 2",
        "[engine]\nbackend = \"remote\"\nreplicas = 2",
    ) + &format!(
        "\n[admin]\nlisten = \"{admin}\"\n\n[node]\nrole = \"head\"\nheartbeat_s = 0.2\nlost_after_s = 2.0\n"
    );
    std::fs::write(&head, text)?;
    let mut nodes = Vec::new();
    for name in ["e1", "e2"] {
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[run]\nname = \"bench-cluster\"\noutput_dir = \"{}\"\n\n[model]\ninit_preset = \"tiny\"\n\n[engine]\nmax_running_sequences = 64\n\n[node]\nrole = \"engine\"\nname = \"{name}\"\nhead = \"http://{admin}\"\nlisten = \"127.0.0.1:{}\"\n",
                dir.join(name).display(),
                free_port()?
            ),
        )?;
        nodes.push(Proc::start(&config, dir.join(format!("{name}.log")))?);
    }
    Proc::start(&head, dir.join("head.log"))?.wait("the head")?;
    drop(nodes);
    Ok(out)
}

/// Runs the benchmark and prints a table and the `RESULT cluster` line.
pub fn run(args: &BenchClusterArgs) -> anyhow::Result<ExitCode> {
    if args.skip_steps >= args.steps {
        bail!(
            "--skip-steps ({}) must be below --steps ({})",
            args.skip_steps,
            args.steps
        );
    }
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    println!(
        "the same RL job (tiny, 2 replicas, {} steps), steps/s from step {}:",
        args.steps, args.skip_steps
    );
    let one = steps_per_second(&one_process(d, args.steps)?, args.skip_steps)?;
    let head = steps_per_second(&split(d, args.steps)?, args.skip_steps)?;
    println!(
        "{:<28} {:>7} {:>10} {:>10}",
        "setup", "steps", "seconds", "steps/s"
    );
    for (name, (steps, seconds, rate)) in [
        ("one process (2 replicas)", one),
        ("head + 2 engine nodes", head),
    ] {
        println!("{name:<28} {steps:>7} {seconds:>10.2} {rate:>10.3}");
    }
    let ratio = head.2 / one.2;
    println!("split ÷ one process: {ratio:.2}");
    println!();
    println!("weight delivery over HTTP vs a raw loopback copy:");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let delivery = crate::weights::measure(&runtime, args.weights_preset, args.repeats)?;
    crate::weights::print_header();
    let weights: Vec<String> = crate::weights::print_row(args.weights_preset, &delivery)
        .split(' ')
        .map(|field| format!("weights_{field}"))
        .collect();
    println!(
        "RESULT cluster one_process_steps_per_s={:.3} split_steps_per_s={:.3} split_ratio={ratio:.2} {}",
        one.2,
        head.2,
        weights.join(" ")
    );
    Ok(ExitCode::SUCCESS)
}
