//! An LLM judge as a run's reward (part of the `cli_run` test binary): the tiny model trains
//! on verl's GSM8K rows while a stub OpenAI-compatible server grades every reply, and the
//! judge's score is the reward the run logs.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use serde_json::Value;

use super::runs;

/// A chat-completions server on a thread of its own answering every request with `answer`;
/// the request bodies it got. The thread ends with the test process.
fn stub_judge(answer: &'static str) -> (String, Arc<Mutex<Vec<Value>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let bodies = Arc::clone(&seen);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let bodies = Arc::clone(&bodies);
            std::thread::spawn(move || serve(stream, answer, &bodies));
        }
    });
    (url, seen)
}

/// Answers the requests of one keep-alive connection.
fn serve(stream: std::net::TcpStream, answer: &str, bodies: &Mutex<Vec<Value>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        let mut request_line = true;
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
            if std::mem::take(&mut request_line) {
                assert!(line.starts_with("POST /v1/chat/completions "), "{line}");
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        bodies
            .lock()
            .unwrap()
            .push(serde_json::from_slice(&body).unwrap());
        let reply = serde_json::json!({
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": answer}}],
        })
        .to_string();
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            reply.len()
        );
        if out.write_all(head.as_bytes()).is_err() || out.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

#[test]
fn a_judge_model_scores_every_reply_of_a_run() {
    let (url, seen) = stub_judge("The reply does not add up.\nScore: 7");
    let dir = tempfile::tempdir().unwrap();
    let (config, _) = runs::verl_tiny_config();
    let mut sets = runs::verl_qa_sets();
    sets.extend([
        "data.domains.gsm8k.rubric.weights={ judge = 1.0 }".to_owned(),
        format!("data.domains.gsm8k.rubric.judge={{ url = \"{url}\", model = \"grader\" }}"),
    ]);
    let steps = runs::run_records(config, dir.path(), &sets);
    assert_eq!(steps.last().unwrap()["policy_version"], 2, "{steps:?}");
    let judged: Vec<f64> = steps
        .iter()
        .filter_map(|s| s["reward.judge"].as_f64())
        .collect();
    assert!(!judged.is_empty(), "{steps:?}");
    for j in judged {
        assert!((j - 0.7).abs() < 1e-9, "{steps:?}");
    }
    // Each rollout of the two steps' groups was graded once at least; each request carried a
    // question of the Parquet rows with its reference answer.
    let seen = seen.lock().unwrap();
    assert!(seen.len() >= 2 * 2 * 4, "{} requests", seen.len());
    let prompts: Vec<&str> = seen
        .iter()
        .map(|b| {
            assert_eq!(b["model"], "grader");
            b["messages"][0]["content"].as_str().unwrap()
        })
        .collect();
    assert!(
        prompts
            .iter()
            .any(|p| p.contains("Tom has 3 apples") && p.contains(":\n7\n")),
        "{prompts:?}"
    );
}
