//! `sluice serve` as a process: bad flags are refused before loading, and SIGTERM under load
//! aborts the generations in flight (each call answers with its partial, `finish_reason:
//! "abort"`) instead of waiting for them to run to their end.

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

#[path = "real_model/mod.rs"]
mod real_model;

/// The real pretrained model through `sluice serve`: its imported tokenizer and ChatML
/// template render the request, and greedy decoding names the capital of France.
#[test]
fn serve_answers_with_the_real_model() {
    let model = real_model::smollm2_dir();
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
        .unwrap_or_else(|| panic!("no message content: {reply}"));
    assert!(content.contains("Paris"), "{content:?}");
    // The template's default system prompt and the user turn, as SmolLM2's own template renders
    // them: far more than the question's 7 tokens, far fewer than a character tokenizer's.
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!((20..80).contains(&prompt_tokens), "{reply}");
}
