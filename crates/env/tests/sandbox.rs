//! The sandbox and the `python_code` task: hostile programs (a fork bomb, an infinite loop, a
//! huge allocation, a network call, a sleeper) end inside their limits, and through an env
//! server each one fails only its own rollout — with the rubric's error reward — while the
//! server keeps answering and the next correct program passes.

#![cfg(target_os = "linux")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{play, sample};
use sluice_core::RolloutStatus;
use sluice_data::config::DomainRubric;
use sluice_env::configured::rubric_for;
use sluice_env::remote::{RemoteEnvFactory, ServerConfig, serve};
use sluice_env::sandbox::{self, Ending, SandboxLimits};
use sluice_env::{Task, TaskRegistry};

const FORK_BOMB: &str = "import os\nwhile True:\n    os.fork()\n";
const BUSY_LOOP: &str = "while True:\n    pass\n";
const HUGE_ALLOCATION: &str = "x = bytearray(8 * 1024 ** 3)\nprint(len(x))\n";
const SLEEPER: &str = "import time\ntime.sleep(3600)\n";
const NETWORK: &str =
    "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')\n";

fn limits() -> SandboxLimits {
    SandboxLimits {
        cpu_seconds: 1,
        wall: Duration::from_secs(3),
        ..SandboxLimits::default()
    }
}

async fn python(program: &str) -> sandbox::SandboxRun {
    sandbox::run("python3", &["-I", "-"], program.as_bytes(), &limits())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_programs_end_inside_their_limits() {
    let ok = python("print(6 * 7)").await;
    assert!(ok.succeeded(), "{ok:?}");
    assert_eq!(ok.stdout, "42\n");

    let t0 = Instant::now();
    let busy = python(BUSY_LOOP).await;
    assert!(
        matches!(busy.ending, Ending::Signaled(_) | Ending::WallTimeout),
        "{busy:?}"
    );
    let sleeper = python(SLEEPER).await;
    assert_eq!(sleeper.ending, Ending::WallTimeout);
    // Each ended at its limit (1 s of CPU, 3 s of wall clock), not after an hour.
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());

    let huge = python(HUGE_ALLOCATION).await;
    assert!(!huge.succeeded(), "{huge:?}");
    assert!(huge.stderr.contains("MemoryError"), "{huge:?}");

    let bomb = python(FORK_BOMB).await;
    assert!(!bomb.succeeded(), "{bomb:?}");

    let net = python(NETWORK).await;
    assert!(!net.succeeded(), "{net:?}");
    assert!(!net.stdout.contains("connected"), "{net:?}");
    assert!(
        net.stderr.contains("Network is unreachable") || net.stderr.contains("OSError"),
        "{net:?}"
    );

    // The machine still forks: the fork bomb's processes are gone and its budget free.
    let after = python("import os\nprint(os.fork() >= 0)").await;
    assert!(after.succeeded(), "{after:?}");
}

/// What a program writes goes to a private tmpfs of its own: a small file works (in `/tmp`, the
/// working directory and `/dev/shm`) and is gone with the run; a large one fails at the limit
/// and fills nothing of the host's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn written_files_stay_inside_the_run() {
    let tag = format!("sluice-sandbox-{}", std::process::id());
    let small = python(&format!(
        "import os\n\
         for d, n in (('/tmp', 'a'), ('.', 'b'), ('/dev/shm', 'c')):\n\
         \x20   open(os.path.join(d, '{tag}-' + n), 'w').write('x')\n\
         print(os.getcwd(), len(os.listdir('/tmp')))\n"
    ))
    .await;
    assert!(small.succeeded(), "{small:?}");
    // The run's /tmp held its own two files and nothing of the host's.
    assert_eq!(small.stdout, "/tmp 2\n", "{small:?}");
    for host in ["/tmp", "/dev/shm"] {
        let left: Vec<_> = std::fs::read_dir(host)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(
            !left.iter().any(|n| n.to_string_lossy().starts_with(&tag)),
            "a file of the run was left in the host's {host}"
        );
    }
    let big = python(&format!(
        "f = open('/tmp/{tag}-big', 'wb')\n\
         for _ in range(64):\n\
         \x20   f.write(b'0' * (1 << 20))\n\
         f.close()\nprint('wrote')\n"
    ))
    .await;
    assert!(!big.succeeded(), "{big:?}");
    assert!(!big.stdout.contains("wrote"), "{big:?}");
    assert!(!std::path::Path::new(&format!("/tmp/{tag}-big")).exists());
}

/// A local `python_code` task (its rubric from a config with `error_reward = -1`) whose envs run
/// on an in-process env server.
async fn remote_code_task() -> (Task, String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(
        listener,
        Arc::new(TaskRegistry::builtin()),
        ServerConfig {
            call_timeout: Duration::from_secs(20),
            ..ServerConfig::default()
        },
        async {
            let _ = stopped.await;
        },
    ));
    let local = TaskRegistry::builtin().get("python_code").unwrap();
    let spec = DomainRubric {
        weights: [("correct".to_owned(), 1.0), ("env.ran".to_owned(), 0.5)].into(),
        truncation_reward: None,
        error_reward: Some(-1.0),
        timeout: None,
        regex: None,
        judge: None,
        reward_model: None,
    };
    let rubric = rubric_for(&local, &spec).unwrap();
    let factory = RemoteEnvFactory::new(&url, "python_code", Duration::from_secs(30)).unwrap();
    let task = local.as_ref().clone().with_rubric(rubric).with_env(factory);
    (task, url, stop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_answers_fail_their_rollout_not_the_server() {
    let (task, url, stop) = remote_code_task().await;
    let problem = sample(serde_json::json!({
        "problem": "Print 6 times 7.",
        "expected_output": "42",
    }));
    for program in [FORK_BOMB, BUSY_LOOP, HUGE_ALLOCATION] {
        let reply = format!("```python\n{program}```");
        let r = play(&task, &problem, &[&reply]).await;
        assert_eq!(
            r.status,
            RolloutStatus::Error("env_failed".into()),
            "{program}: {r:?}"
        );
        assert_eq!(r.reward, -1.0, "{program}: the configured error_reward");
    }
    // The server is alive and the next answer is run and scored with the env's components.
    let r = play(&task, &problem, &["```python\nprint(6 * 7)\n```"]).await;
    assert_eq!(r.status, RolloutStatus::Completed, "{r:?}");
    assert_eq!(r.reward_components["env.passed"], 1.0);
    assert_eq!(r.reward_components["env.ran"], 1.0);
    assert_eq!(r.reward_components["correct"], 1.0);
    assert!((r.reward - 1.0).abs() < 1e-12, "{}", r.reward);
    let wrong = play(&task, &problem, &["print(41)"]).await;
    assert_eq!(wrong.status, RolloutStatus::Completed);
    assert_eq!(wrong.reward_components["env.passed"], 0.0);
    // correct 0 (weight 2/3) + ran 1 (weight 1/3).
    assert!((wrong.reward - 1.0 / 3.0).abs() < 1e-12, "{}", wrong.reward);
    let health = sluice_http::HttpClient::new(&url, "env server")
        .unwrap()
        .call(
            sluice_http::Method::GET,
            "/v1/health",
            None,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert!(health.0.is_success());
    let _ = stop.send(());
}

/// `[data.domains.<d>.sandbox]`: a domain's own limits reach its programs (a 0.5 s wall stops
/// a 2 s sleeper that the default 5 s lets finish); the table on another task's domain is
/// refused, naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_domains_sandbox_table_sets_its_programs_limits() {
    use sluice_data::config::{BadLinePolicy, DataConfig, DomainConfig, DomainSandbox};
    use sluice_env::configured::configure;
    let data = |domain: &str, dataset: &str| DataConfig {
        datasets: vec![dataset.parse().unwrap()],
        data_dir: "unused".into(),
        on_bad_line: BadLinePolicy::Fail,
        adaptive_mix: true,
        domain_options: [(
            domain.to_owned(),
            DomainConfig {
                sandbox: Some(DomainSandbox {
                    wall_s: Some(0.5),
                    ..DomainSandbox::default()
                }),
                ..DomainConfig::default()
            },
        )]
        .into(),
        read_limits: Default::default(),
    };
    let timeout = Duration::from_secs(20);
    let registry = configure(
        TaskRegistry::builtin(),
        &data("code", "code::python_code@train"),
        timeout,
        None,
        None,
    )
    .unwrap();
    assert_eq!(registry.domain_tasks()["code"], "code/python_code");
    let strict = registry.get("code/python_code").unwrap();
    let default = TaskRegistry::builtin().get("python_code").unwrap();
    let problem = sample(serde_json::json!({
        "problem": "Print 6 times 7.",
        "expected_output": "42",
    }));
    let slow = "```python\nimport time\ntime.sleep(2)\nprint(42)\n```";
    let r = play(&strict, &problem, &[slow]).await;
    assert_eq!(r.status, RolloutStatus::Error("env_failed".into()), "{r:?}");
    let r = play(&default, &problem, &[slow]).await;
    assert_eq!(r.status, RolloutStatus::Completed, "{r:?}");
    assert_eq!(r.reward_components["env.passed"], 1.0);

    let err = configure(
        TaskRegistry::builtin(),
        &data("math", "math::arithmetic@train"),
        timeout,
        None,
        None,
    )
    .err()
    .unwrap();
    let message = err.to_string();
    assert!(message.contains("data.domains.math.sandbox"), "{message}");
    assert!(message.contains("python_code"), "{message}");
}
