//! `sluice serve` as a process: bad flags are refused before loading, a bind beyond loopback
//! needs a token, SIGTERM under load aborts the generations in flight (each call answers with
//! its partial, `finish_reason: "abort"`) instead of waiting for them to run to their end, and
//! ends the process within its grace period even while a chat-template render is stuck; a
//! half-sent request is cut off after the header-read deadline.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

fn http(addr: &str, method: &str, path: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn body_json(reply: &str) -> serde_json::Value {
    let body = reply.split_once("\r\n\r\n").unwrap().1;
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {reply}"))
}

#[test]
fn serve_refuses_bad_flags_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    for (flag, value, message) in [
        (
            "--served-model-name",
            " ",
            "--served-model-name: expected a non-empty name",
        ),
        (
            "--max-queued-sequences",
            "0",
            "--max-queued-sequences: expected an integer ≥ 1, got 0",
        ),
        (
            "--max-running-sequences",
            "100000",
            "--max-running-sequences: expected at most 16384, got 100000",
        ),
        (
            "--kv-cache-mb",
            "2000000",
            "--kv-cache-mb: expected at most 1048576 (MiB of KV cache; 1 TiB at most), got 2000000",
        ),
        (
            "--kv-block-tokens",
            "0",
            "--kv-block-tokens: expected 1 to 1024 (tokens per KV cache block), got 0",
        ),
        (
            "--compute-dtype",
            "f16",
            "--compute-dtype: `f16` is not supported: use `bf16` or `f32`",
        ),
        (
            "--write-stall-timeout-s",
            "0",
            "--write-stall-timeout-s: expected a number of seconds > 0, got 0",
        ),
        (
            "--compute-dtype",
            "int8",
            "--compute-dtype: expected `f32` or `bf16`, got `int8`",
        ),
    ] {
        let out = sluice()
            .args([
                "serve",
                "--model",
                model.to_str().unwrap(),
                "--port",
                "0",
                flag,
                value,
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(message), "{err}");
    }
}

#[test]
fn sigterm_under_load_aborts_generation_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    let init = sluice()
        .args([
            "model",
            "init",
            "--preset",
            "tiny",
            "--out",
            model.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(init.status.success());
    let mut child = sluice()
        .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
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
        .map(|a| a.trim().to_owned())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let long = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            http(
                &addr,
                "POST",
                "/v1/completions",
                r#"{"prompt": "go", "max_tokens": 4000, "ignore_eos": true}"#,
            )
        })
    };
    // Wait until it is generating.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = body_json(&http(&addr, "GET", "/get_weight_version", ""));
        if v["generated_tokens"].as_u64().unwrap() >= 3 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let reply = long.join().unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let choice = &body_json(&reply)["choices"][0];
    assert_eq!(choice["finish_reason"], "abort", "{choice}");
    assert!(child.wait().unwrap().success());
}

/// `--chat-template` renders chat requests with the given template instead of the model's: the
/// same conversation costs the prompt tokens the file's template makes (the tiny model's
/// tokenizer is one token per character), and a missing file is refused naming the flag.
#[test]
fn chat_template_replaces_the_models_template() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    let init = sluice()
        .args(["model", "init", "--preset", "tiny", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(init.status.success());
    let template = dir.path().join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}={% endif %}",
    )
    .unwrap();
    let prompt_tokens = |extra: &[&std::ffi::OsStr]| {
        let mut child = sluice()
            .args(["serve", "--port", "0", "--model"])
            .arg(&model)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.split("http://").nth(1).unwrap().trim().to_owned();
        let reply = http(
            &addr,
            "POST",
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "7+5"}], "max_tokens": 1}"#,
        );
        child.kill().unwrap();
        child.wait().unwrap();
        body_json(&reply)["usage"]["prompt_tokens"]
            .as_u64()
            .unwrap()
    };
    // The file's template: `7+5` then `=`.
    assert_eq!(
        prompt_tokens(&["--chat-template".as_ref(), template.as_os_str()]),
        4
    );
    // The model's ChatML wraps the turn in role markers.
    assert!(prompt_tokens(&[]) > 10);
    let missing = sluice()
        .args([
            "serve",
            "--port",
            "0",
            "--chat-template",
            "/nowhere.jinja",
            "--model",
        ])
        .arg(&model)
        .output()
        .unwrap();
    assert!(!missing.status.success());
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("--chat-template /nowhere.jinja"), "{err}");
}

/// Under KV-cache pressure every reply is whole: eight greedy requests of 400 tokens need about
/// 3,300 tokens of cache where 1 MiB holds 2,048 of the tiny model's, so the engine preempts,
/// and computes the preempted requests again instead of answering them with their partial and
/// `finish_reason: "abort"` (a client has no way to resume one).
#[test]
fn a_full_kv_cache_delays_replies_but_never_cuts_them() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (mut child, addr) = spawn_serve(&model, &["--kv-cache-mb", "1"]);
    let replies: Vec<_> = (0..8)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"prompt": "go {i}", "max_tokens": 400, "ignore_eos": true, "temperature": 0}}"#
                );
                http(&addr, "POST", "/v1/completions", &body)
            })
        })
        .collect();
    for reply in replies {
        let reply = reply.join().unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        let v = body_json(&reply);
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 400, "{v}");
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Writes the tiny preset into `dir/m`.
fn tiny_model(dir: &std::path::Path) -> std::path::PathBuf {
    let model = dir.join("m");
    let init = sluice()
        .args(["model", "init", "--preset", "tiny", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(init.status.success());
    model
}

/// Starts `sluice serve` on port 0 with `extra` flags; the child and its address.
fn spawn_serve(model: &std::path::Path, extra: &[&str]) -> (std::process::Child, String) {
    let mut child = sluice()
        .args(["serve", "--port", "0", "--model"])
        .arg(model)
        .args(extra)
        .env_remove("SLUICE_SERVE_TOKEN")
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
        .map(|a| a.trim().to_owned())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    (child, addr)
}

/// Waits for `child` to exit within `limit`, killing it (and failing) otherwise.
fn exit_within(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sluice serve did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Beyond loopback the weight, pause, abort and continue routes would be anyone's: `serve`
/// refuses to start without `$SLUICE_SERVE_TOKEN` (before loading anything), as `env-server`
/// does without its token; an empty or whitespace-only token is refused naming the variable.
#[test]
fn serve_beyond_loopback_needs_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let missing_model = dir.path().join("not-loaded");
    let run = |token: Option<&str>| {
        let mut cmd = sluice();
        cmd.args(["serve", "--host", "0.0.0.0", "--port", "0", "--model"])
            .arg(&missing_model)
            .env_remove("SLUICE_SERVE_TOKEN");
        if let Some(t) = token {
            cmd.env("SLUICE_SERVE_TOKEN", t);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(None);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("--host 0.0.0.0: not a loopback address; set $SLUICE_SERVE_TOKEN to serve beyond this machine"),
        "{err}"
    );
    let (code, err) = run(Some(" \n"));
    assert_eq!(code, Some(1));
    assert!(
        err.contains("$SLUICE_SERVE_TOKEN: expected a non-empty token"),
        "{err}"
    );
    // With a token it gets past the check (and fails on the missing model, named).
    let (code, err) = run(Some("s3cret\n"));
    assert_eq!(code, Some(1));
    assert!(err.contains("--model"), "{err}");
}

/// A client that sends half a request head is cut off after `--header-read-timeout-s` instead
/// of holding the connection open for as long as it likes.
#[test]
fn a_half_sent_request_is_closed_after_the_header_read_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (mut child, addr) = spawn_serve(&model, &["--header-read-timeout-s", "0.5"]);
    let mut s = TcpStream::connect(&addr).unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        .unwrap();
    // Far longer than the deadline: a read that times out means the server kept it open.
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut rest = Vec::new();
    let read = s.read_to_end(&mut rest);
    assert!(
        read.is_ok(),
        "the server should have closed the connection: {read:?}"
    );
    assert!(!String::from_utf8_lossy(&rest).contains("200 OK"));
    // A whole request still gets its answer.
    let reply = http(&addr, "GET", "/health", "");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A chat request whose template render never ends (three nested loops of 10 000) used to keep
/// `serve` alive after SIGTERM (the render blocked a runtime thread and the graceful stop waited
/// for it). Rendering runs on the blocking pool now, and the stop waits for calls at most
/// `--shutdown-grace-s`: the process exits 0.
#[test]
fn sigterm_ends_serve_within_its_grace_even_while_a_render_runs() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let template = dir.path().join("stuck.jinja");
    std::fs::write(
        &template,
        "{% for a in range(10000) %}{% for b in range(10000) %}{% for c in range(10000) %}{% endfor %}{% endfor %}{% endfor %}",
    )
    .unwrap();
    let (mut child, addr) = spawn_serve(
        &model,
        &[
            "--chat-template",
            template.to_str().unwrap(),
            "--shutdown-grace-s",
            "1",
        ],
    );
    let stuck = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(&addr).unwrap();
            let body = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}"#;
            let _ = write!(
                s,
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
        })
    };
    // The render is under way (or already refused, where templates carry a budget).
    std::thread::sleep(Duration::from_millis(500));
    let health = http(&addr, "GET", "/health", "");
    assert!(
        health.starts_with("HTTP/1.1 200"),
        "the runtime still answers: {health}"
    );
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = exit_within(&mut child, Duration::from_secs(30));
    assert!(exited.success(), "{exited:?}");
    stuck.join().unwrap();
}

#[path = "real_model/mod.rs"]
mod real_model;

/// The real pretrained model through `sluice serve`: its imported tokenizer and ChatML
/// template render the request, and greedy decoding names the capital of France, with f32
/// products and with bf16 ones on AMX tiles (`--compute-dtype bf16`, refused by name on a CPU
/// without them).
#[test]
fn serve_answers_with_the_real_model() {
    let model = real_model::smollm2_dir();
    for extra in [&[][..], &["--compute-dtype", "bf16"]] {
        if !extra.is_empty() && !sluice_model::amx::available() {
            let out = sluice()
                .args(["serve", "--port", "0", "--model"])
                .arg(&model)
                .args(extra)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && err.contains("Intel AMX"), "{err}");
            continue;
        }
        let (mut child, addr) = spawn_serve(&model, extra);
        let reply = http(
            &addr,
            "POST",
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24, "temperature": 0}"#,
        );
        child.kill().unwrap();
        child.wait().unwrap();
        let body = body_json(&reply);
        let content = body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_else(|| panic!("{extra:?}: no message content: {reply}"));
        assert!(content.contains("Paris"), "{extra:?}: {content:?}");
        // The template's default system prompt and the user turn, as SmolLM2's own template
        // renders them: far more than the question's 7 tokens, far fewer than a character
        // tokenizer's.
        let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!((20..80).contains(&prompt_tokens), "{reply}");
    }
}
