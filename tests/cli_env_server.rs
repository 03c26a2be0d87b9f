//! `sluice env-server`: starts on a free port, answers the protocol, stops on SIGTERM with exit 0;
//! and the example env server in Python that serves a verl reward function to a run.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

/// Starts `sluice env-server` with `args` (and `env`), and returns it with the address it
/// printed as bound.
fn start(args: &[&str], env: &[(&str, &str)]) -> (Child, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.arg("env-server").args(args).envs(env.iter().copied());
    spawn_server(&mut cmd)
}

/// Spawns the env server `cmd` and reads the address from the `… http://HOST:PORT …` line it
/// prints first.
fn spawn_server(cmd: &mut Command) -> (Child, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    (child, addr)
}

/// SIGTERM by pid (the child we started); it must exit 0.
fn stop(mut child: Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert!(exit.success(), "{exit:?}");
}

fn get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn env_server_serves_builtin_tasks_and_stops_on_sigterm() {
    let (child, addr) = start(&["--port", "0"], &[]);
    let tasks = get(&addr, "/v1/tasks");
    assert!(tasks.starts_with("HTTP/1.1 200"), "{tasks}");
    assert!(
        tasks.contains(
            r#""tasks":["arithmetic","arithmetic_wide","calculator_tool","episodic","python_code","qa","stock_tool","sum_digits","word_problems"]"#
        ),
        "{tasks}"
    );
    stop(child);
}

#[test]
fn env_server_refuses_bad_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["env-server", "--port", "0", "--call-timeout-s", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--call-timeout-s"), "{err}");
}

#[test]
fn env_server_refuses_a_wide_bind_without_a_token() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["env-server", "--host", "0.0.0.0", "--port", "0"])
        .env_remove("SLUICE_ENV_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--host 0.0.0.0: not a loopback address; set $SLUICE_ENV_TOKEN"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["env-server", "--port", "0"])
        .env("SLUICE_ENV_TOKEN", " ")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("$SLUICE_ENV_TOKEN: expected a non-empty token"),
        "{err}"
    );
}

#[test]
fn env_server_with_a_token_binds_wide_and_requires_it() {
    let (child, bound) = start(
        &["--host", "0.0.0.0", "--port", "0"],
        &[("SLUICE_ENV_TOKEN", "t0ken")],
    );
    let port = bound.rsplit(':').next().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "DELETE /v1/envs/e1 HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 401"), "{out}");
    assert!(out.contains(r#""kind":"unauthorized""#), "{out}");
    stop(child);
}

/// One JSON POST; the raw response.
fn post(addr: &str, path: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The `env_id` of a create call's answer (Sluice's server writes no space after the colon,
/// Python's `json.dumps` one).
fn env_id_of(created: &str) -> String {
    created
        .split(r#""env_id":"#)
        .nth(1)
        .and_then(|rest| rest.trim_start().strip_prefix('"'))
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no env_id in {created}"))
        .to_owned()
}

/// Creates and opens a `python_code` env; its id.
fn open_code_env(addr: &str) -> String {
    let sample = r#"{"task":"python_code","sample":{"id":"c","domain":"code","dataset":"python_code","input":{"problem":"Print 6 times 7.","expected_output":"42"}}}"#;
    let created = post(addr, "/v1/envs", sample);
    assert!(created.starts_with("HTTP/1.1 201"), "{created}");
    let id = env_id_of(&created);
    let init = post(addr, &format!("/v1/envs/{id}/init"), "{}");
    assert!(init.starts_with("HTTP/1.1 200"), "{init}");
    id
}

fn answer(addr: &str, id: &str, program: &str) -> String {
    let body = serde_json::json!({"message": {"role": "assistant", "content": program}});
    post(addr, &format!("/v1/envs/{id}/step"), &body.to_string())
}

#[cfg(target_os = "linux")]
#[test]
fn env_server_survives_hostile_programs_of_the_python_code_task() {
    let (child, addr) = start(&["--port", "0"], &[]);
    for program in [
        "import os\nwhile True:\n    os.fork()\n",
        "while True:\n    pass\n",
        "x = bytearray(8 * 1024 ** 3)\n",
    ] {
        let id = open_code_env(&addr);
        let out = answer(&addr, &id, program);
        assert!(out.starts_with("HTTP/1.1 500"), "{program}: {out}");
        assert!(out.contains(r#""kind":"env_failed""#), "{out}");
        assert!(out.contains("sandbox: program"), "{out}");
    }
    let id = open_code_env(&addr);
    let out = answer(&addr, &id, "print(6 * 7)");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains(r#""passed":1.0"#), "{out}");
    assert!(get(&addr, "/v1/health").starts_with("HTTP/1.1 200"));
    stop(child);
}

/// `examples/verl_reward_server.py` serves a verl reward function over the env protocol: its
/// episodes open with the row's `prompt` messages and end with the function's score (a dict's
/// `score` too), out of order calls answer 409; and a native run whose domain points at it
/// trains on the Parquet fixture with that score as the reward of every reply that ends
/// (`reward.env`).
#[test]
fn a_verl_reward_function_serves_a_run_from_the_example_server() {
    let dir = tempfile::tempdir().unwrap();
    let reward = dir.path().join("reward.py");
    std::fs::write(
        &reward,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    \
         return {'score': 1.0 if solution_str.strip().endswith('#### ' + ground_truth) else 0.5}\n",
    )
    .unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let (server, addr) = spawn_server(
        Command::new("python3")
            .arg(format!("{root}/examples/verl_reward_server.py"))
            .args(["--port", "0", "--reward-file"])
            .arg(&reward),
    );
    let server = KillOnDrop(server);

    let row = serde_json::json!({"task": "verl", "sample": {"id": "1", "domain": "gsm8k",
        "dataset": "verl@train", "input": {"data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "3 + 4?"}],
        "reward_model": {"style": "rule", "ground_truth": "7"}}}});
    let created = post(&addr, "/v1/envs", &row.to_string());
    assert!(created.starts_with("HTTP/1.1 201"), "{created}");
    let id = env_id_of(&created);
    let init = post(&addr, &format!("/v1/envs/{id}/init"), "{}");
    assert!(init.contains(r#""content": "3 + 4?""#), "{init}");
    let step = answer(&addr, &id, "3 + 4 = 7\n#### 7");
    assert!(
        step.starts_with("HTTP/1.1 200") && step.contains(r#""reward": 1.0"#),
        "{step}"
    );
    let again = answer(&addr, &id, "#### 7");
    assert!(again.starts_with("HTTP/1.1 409"), "{again}");
    // A row without its answer, or whose prompt is not chat messages, fails its episode by
    // name (a mistyped --answer-key must not train a run on zeros); a body that is not an
    // object is refused.
    let open_with = |input: serde_json::Value| {
        let row = serde_json::json!({"task": "verl", "sample": {"id": "9", "input": input}});
        let id = env_id_of(&post(&addr, "/v1/envs", &row.to_string()));
        post(&addr, &format!("/v1/envs/{id}/init"), "{}")
    };
    let no_answer = open_with(serde_json::json!({"prompt": "3 + 4?"}));
    assert!(
        no_answer.starts_with("HTTP/1.1 400") && no_answer.contains("reward_model.ground_truth"),
        "{no_answer}"
    );
    let odd_prompt =
        open_with(serde_json::json!({"prompt": ["3 + 4?"], "reward_model": {"ground_truth": "7"}}));
    assert!(
        odd_prompt.starts_with("HTTP/1.1 400") && odd_prompt.contains("env_bad_input"),
        "{odd_prompt}"
    );
    let list = post(&addr, "/v1/envs", "[1, 2]");
    assert!(list.starts_with("HTTP/1.1 400"), "{list}");

    let (config, data_dir) = runs::verl_tiny_config();
    let sets = [
        data_dir,
        "data.domains.gsm8k.task=\"verl\"".to_owned(),
        format!("data.domains.gsm8k.env_url=\"http://{addr}\""),
    ];
    let steps = runs::run_records(config, &dir.path().join("run"), &sets);
    drop(server);
    assert_eq!(steps.last().unwrap()["policy_version"], 2, "{steps:?}");
    // A reply that ended got the function's 0.5 (or 1.0) as its reward; one cut at the token
    // limit never reached the server and scored 0.
    let rewards: Vec<f64> = steps
        .iter()
        .map(|s| s["reward.env"].as_f64().expect("reward.env"))
        .collect();
    assert!(rewards.iter().all(|r| (0.0..=1.0).contains(r)), "{steps:?}");
    assert!(rewards.iter().sum::<f64>() > 0.0, "{steps:?}");
}

#[path = "runs/mod.rs"]
mod runs;

/// A child process killed (and reaped) when the test lets go of it, failing or not.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
