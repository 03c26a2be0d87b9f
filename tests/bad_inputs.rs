//! One table of bad inputs across the surfaces an operator touches (`DESIGN.md` §9): config files
//! (`sluice check`), dataset lines (JSONL, `on_bad_line = "fail"`), the CLI's admin commands, and
//! the admin API of a running node. Each row states the expected outcome (exit code or HTTP
//! status, and the error type for the API) and a substring of the message the user sees; every
//! refused admin call must also leave the knobs as they were. All rows run; failures are listed
//! together.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use sluice_config::{BadLinePolicy, DatasetSpec};
use sluice_node::client::{Call, send};
use sluice_node::{Node, NodeOptions};

#[path = "bad_inputs/rows.rs"]
mod rows;

use rows::rows;

const TOKEN: &str = "bad-inputs-token";

/// Where a row's input goes.
enum Input {
    /// `sluice check FILE` on a file with this text.
    Config(&'static str),
    /// `sluice ARGS...` (admin commands; `{url}` is replaced by the test node's admin URL).
    Cli(&'static [&'static str]),
    /// A JSONL dataset file `math/toy.jsonl` with this text, loaded with `on_bad_line = "fail"`.
    Dataset(&'static str),
    /// A dataset file `math/toy.jsonl` text cannot express, loaded with `on_bad_line = "fail"`.
    DatasetFile(SpecialFile),
    /// An admin API call.
    Admin(Admin),
}

/// What `math/toy.jsonl` is.
enum SpecialFile {
    /// These bytes.
    Bytes(&'static [u8]),
    /// A good line, then one row this many bytes long, then a good line.
    LongLine(usize),
    /// A symlink to `/dev/zero`.
    DevZero,
    /// A FIFO no one writes to.
    Fifo,
}

/// Makes `path` what `special` says (replacing whatever is there).
fn make_dataset_file(path: &Path, special: &SpecialFile) {
    let _ = std::fs::remove_file(path);
    match special {
        SpecialFile::Bytes(bytes) => std::fs::write(path, bytes).unwrap(),
        SpecialFile::LongLine(n) => {
            let mut text = b"{\"q\": 1}\n{\"q\": \"".to_vec();
            text.resize(text.len() + n - 9, b'x');
            text.extend_from_slice(b"\"}\n{\"q\": 2}\n");
            std::fs::write(path, text).unwrap();
        }
        SpecialFile::DevZero => std::os::unix::fs::symlink("/dev/zero", path).unwrap(),
        SpecialFile::Fifo => {
            let status = Command::new("mkfifo").arg(path).status().unwrap();
            assert!(status.success(), "mkfifo {}", path.display());
        }
    }
}

/// Loads `math::toy` from `dir/data` with `on_bad_line = "fail"`, giving up after 10 s (a FIFO
/// once blocked the load forever).
fn load_toy(dir: &Path) -> (i32, String) {
    let data = dir.join("data");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let spec: DatasetSpec = "math::toy".parse().unwrap();
        let _ = tx.send(
            match sluice_data::Dataset::load(&data, &spec, BadLinePolicy::Fail) {
                Ok(d) => (0, format!("loaded {} rows", d.len())),
                Err(e) => (1, e.to_string()),
            },
        );
    });
    rx.recv_timeout(std::time::Duration::from_secs(10))
        .unwrap_or((-1, "the load did not return within 10 s".into()))
}

struct Admin {
    method: &'static str,
    path: &'static str,
    body: Body,
    token: Option<&'static str>,
    content_type: Option<&'static str>,
}

enum Body {
    Text(&'static str),
    /// This many bytes of JSON-ish filler.
    Huge(usize),
}

/// PATCH /v1/knobs with the token and a JSON body.
const fn patch(body: &'static str) -> Input {
    Input::Admin(Admin {
        method: "PATCH",
        path: "/v1/knobs",
        body: Body::Text(body),
        token: Some(TOKEN),
        content_type: Some("application/json"),
    })
}

/// What must come back: an exit code (CLI, config, dataset: 1 = refused) or an HTTP status and
/// error type.
enum Expect {
    Exit(i32),
    Http(u16, &'static str),
}

struct Row {
    input: Input,
    expect: Expect,
    message: &'static str,
}

fn sluice(args: &[String], dir: &Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .current_dir(dir)
        .env_remove("SLUICE_ADMIN_TOKEN")
        .output()
        .expect("run sluice");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// Runs one row; returns what came back (code, message) or why the row is wrong.
fn run_row(row: &Row, url: &str, dir: &Path, knobs_now: &dyn Fn() -> Value) -> Result<(), String> {
    let (code, text, kind) = match &row.input {
        Input::Config(text) => {
            let path = dir.join("bad.toml");
            std::fs::write(&path, text).unwrap();
            let (code, out) = sluice(&["check".into(), path.display().to_string()], dir);
            if !out.contains("bad.toml") {
                return Err(format!("the message does not name the file: {out}"));
            }
            (code, out, None)
        }
        Input::Cli(args) => {
            let host = url.trim_start_matches("http://");
            let args: Vec<String> = args
                .iter()
                .map(|a| {
                    a.replace("https://{url}", &format!("https://{host}"))
                        .replace("{url}", url)
                })
                .collect();
            let (code, out) = sluice(&args, dir);
            (code, out, None)
        }
        Input::Dataset(text) => {
            std::fs::create_dir_all(dir.join("data/math")).unwrap();
            make_dataset_file(
                &dir.join("data/math/toy.jsonl"),
                &SpecialFile::Bytes(text.as_bytes()),
            );
            let (code, text) = load_toy(dir);
            (code, text, None)
        }
        Input::DatasetFile(special) => {
            std::fs::create_dir_all(dir.join("data/math")).unwrap();
            make_dataset_file(&dir.join("data/math/toy.jsonl"), special);
            let (code, text) = load_toy(dir);
            (code, text, None)
        }
        Input::Admin(a) => {
            let before = knobs_now();
            let huge;
            let body: &[u8] = match a.body {
                Body::Text(t) => t.as_bytes(),
                Body::Huge(n) => {
                    huge = format!("{{\"paused\": false, \"pad\": \"{}\"}}", "x".repeat(n));
                    huge.as_bytes()
                }
            };
            let call = Call {
                method: a.method,
                path: a.path,
                body,
                token: a.token,
                content_type: a.content_type,
            };
            let (code, answer) = send(url, &call).map_err(|e| e.to_string())?;
            if knobs_now() != before {
                return Err(format!("the knobs changed: {before} → {}", knobs_now()));
            }
            let json: Value = serde_json::from_str(&answer)
                .map_err(|e| format!("answer is not JSON ({e}): {answer}"))?;
            let message = json["error"]["message"].as_str().unwrap_or("").to_owned();
            let kind = json["error"]["type"].as_str().unwrap_or("").to_owned();
            (i32::from(code), message, Some(kind))
        }
    };
    let ok = match row.expect {
        Expect::Exit(want) => code == want,
        Expect::Http(status, want_kind) => {
            code == i32::from(status) && kind.as_deref() == Some(want_kind)
        }
    };
    if !ok || !text.contains(row.message) {
        return Err(format!(
            "got code {code} type {kind:?} message {:?}; want {:?} and {:?}",
            text.trim(),
            match row.expect {
                Expect::Exit(c) => format!("exit {c}"),
                Expect::Http(s, k) => format!("{s} {k}"),
            },
            row.message
        ));
    }
    Ok(())
}

#[test]
fn every_bad_input_is_refused_with_its_message_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let config = sluice_config::parse(
        r#"
[run]
name = "bad-inputs"
max_steps = 1000000
[engine]
backend = "simulated"
replicas = 1
[engine.simulated]
decode_step_base_seconds = 0.001
[admin]
listen = "127.0.0.1:0"
[metrics]
enabled = false
[rollout]
paused = true
group_size = 2
groups_per_step = 2
max_new_tokens = 32
"#,
        "bad_inputs.toml",
        &[],
        &|k| (k == "SLUICE_ADMIN_TOKEN").then(|| TOKEN.to_owned()),
    )
    .expect("the test config is valid");
    let options = NodeOptions {
        serve_admin: true,
        ..NodeOptions::default()
    };
    let node = runtime.block_on(Node::start(&config, options)).unwrap();
    let url = format!("http://{}", node.admin_addr().unwrap());
    let knobs_now = || -> Value {
        let (code, body) = sluice_node::client::request(&url, "GET", "/v1/knobs", None, None)
            .expect("GET /v1/knobs");
        assert_eq!(code, 200);
        serde_json::from_str(&body).unwrap()
    };

    let rows = rows();
    assert!(rows.len() >= 20);
    let failures: Vec<String> = rows
        .iter()
        .enumerate()
        .filter_map(|(i, row)| {
            run_row(row, &url, dir.path(), &knobs_now)
                .err()
                .map(|e| format!("row {i} ({:?}): {e}", row.message))
        })
        .collect();
    let still_serving = sluice_node::client::request(&url, "GET", "/v1/status", None, None);
    runtime.block_on(node.shutdown());
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
    assert_eq!(still_serving.expect("status after the table").0, 200);
}
