//! `sluice status`, `sluice pause`/`resume` and `sluice knobs` against a running node: the summary
//! and the JSON, the token taken from `--token`, `$SLUICE_ADMIN_TOKEN` or the node's config file,
//! and the URL from `--url` or the config's `admin.listen`.

use std::path::Path;
use std::process::Command;

use sluice_node::{Node, NodeOptions};

const TOKEN: &str = "cli-status-token";

fn sluice(args: &[&str], env_token: Option<&str>, dir: &Path) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.args(args)
        .current_dir(dir)
        .env_remove("SLUICE_ADMIN_TOKEN");
    if let Some(t) = env_token {
        cmd.env("SLUICE_ADMIN_TOKEN", t);
    }
    let out = cmd.output().expect("run sluice");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn status_pause_resume_and_knobs_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let text = r#"
[run]
name = "cli-status"
max_steps = 1000000
[engine]
backend = "simulated"
replicas = 1
[engine.simulated]
decode_step_base_seconds = 0.001
[metrics]
enabled = false
[rollout]
group_size = 2
groups_per_step = 2
max_new_tokens = 32
balance_threshold = 0.25
"#;
    let config = sluice_config::parse(
        &format!("{text}[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\"\n"),
        "cli_status.toml",
        &[],
        &|_| None,
    )
    .unwrap();
    let options = NodeOptions {
        serve_admin: true,
        ..NodeOptions::default()
    };
    let node = runtime.block_on(Node::start(&config, options)).unwrap();
    let addr = node.admin_addr().unwrap();
    let url = format!("http://{addr}");
    // The node's config as an operator would pass it: the bound address and the token.
    let config_file = dir.path().join("node.toml");
    std::fs::write(
        &config_file,
        format!("{text}[admin]\nlisten = \"{addr}\"\ntoken = \"{TOKEN}\"\n"),
    )
    .unwrap();
    let config_arg = config_file.to_str().unwrap();
    let d = dir.path();

    let (code, out, err) = sluice(&["status", "--url", &url], None, d);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "node      sluice",
        "admitting",
        "training  step",
        "buckets",
        "actors",
        "controller running",
        "balance threshold 0.25",
    ] {
        assert!(out.contains(needle), "{needle:?} missing in:\n{out}");
    }
    let (code, out, err) = sluice(&["status", "--json", "--config", config_arg], None, d);
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["paused"], false);
    assert_eq!(status["controller"]["balance"]["threshold"], 0.25);

    // Pause with the token from the environment, resume with the one in the config file.
    let (code, _, err) = sluice(&["pause", "--url", &url], None, d);
    assert_eq!(code, 1, "no token: refused");
    assert!(err.contains("401"), "{err}");
    let (code, out, err) = sluice(&["pause", "--url", &url], Some(TOKEN), d);
    assert_eq!((code, out.trim()), (0, "paused"), "{err}");
    assert!(node.handles.knobs.current().paused);
    let (code, out, _) = sluice(&["status", "--admin", &url], None, d);
    assert_eq!(code, 0);
    assert!(out.contains("PAUSED"), "{out}");
    let (code, out, err) = sluice(&["resume", "--config", config_arg], None, d);
    assert_eq!((code, out.trim()), (0, "admitting"), "{err}");
    assert!(!node.handles.knobs.current().paused);

    // knobs: --admin still works, --token is taken, set is all or nothing.
    let (code, out, err) = sluice(
        &[
            "knobs",
            "--admin",
            &url,
            "--token",
            TOKEN,
            "set",
            "max_version_lag=2",
            "weight_update_mode=drain",
        ],
        None,
        d,
    );
    assert_eq!(code, 0, "{err}");
    let answer: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(answer["knobs"]["max_version_lag"], 2);
    let (code, out, _) = sluice(&["knobs", "get", "--url", &url], None, d);
    assert_eq!(code, 0);
    let knobs: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(knobs["weight_update_mode"], "drain");
    let (code, _, err) = sluice(
        &[
            "knobs",
            "--config",
            config_arg,
            "set",
            "max_version_lag=3",
            "max_concurrent_rollouts=2000000",
        ],
        None,
        d,
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("max_concurrent_rollouts: expected an integer ≤ 1048576, got 2000000"),
        "{err}"
    );
    assert_eq!(
        node.handles.knobs.current().max_version_lag,
        2,
        "all or nothing"
    );

    runtime.block_on(node.shutdown());
}

/// A server that splits a UTF-8 character across chunks (or, as the sweep's repro, sends both
/// bytes of `é` in a 1-byte chunk) makes `sluice status` fail with a message, never panic.
#[test]
fn a_chunk_boundary_inside_a_character_is_an_error_not_a_panic() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4096];
        let _ = socket.read(&mut buf);
        let _ = socket.write_all(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n\xc3\xa9\r\n0\r\n\r\n",
        );
    });
    let (code, _, err) = sluice(
        &["status", "--url", &url, "--token", TOKEN],
        None,
        dir.path(),
    );
    server.join().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(code, 101, "{err}");
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("a chunk of 1 bytes is not followed by CRLF"),
        "{err}"
    );
}
