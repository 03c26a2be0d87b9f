//! `sluice env-server`: starts on a free port, answers the protocol, stops on SIGTERM with exit 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

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
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["env-server", "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
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
    let tasks = get(&addr, "/v1/tasks");
    assert!(tasks.starts_with("HTTP/1.1 200"), "{tasks}");
    assert!(
        tasks.contains(r#""tasks":["arithmetic","calculator_tool","episodic","sum_digits"]"#),
        "{tasks}"
    );
    // SIGTERM by pid (the child we started).
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert!(exit.success(), "{exit:?}");
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
