//! A node the head replaced stops: the `sluice` binary as an env node, before a head that
//! answers as a real one does once it has declared the node lost and given its name to another
//! live node (404 to the heartbeat, 409 to the join again). The node used to retry at every
//! heartbeat for ever, serving no one; it now exits non-zero naming the head, the name and why.
//! A plain-TCP stand-in for the head keeps the drill to one process and a second.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::{Proc, configs::env_config, free_port};

/// Answers one HTTP request on `stream` as the head that replaced the node would.
fn answer(stream: std::net::TcpStream, joins: &AtomicU32) {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut length = 0;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = header.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    let _ = reader.read_exact(&mut body);
    let (status, reply) = if line.starts_with("POST /v1/nodes ") {
        if joins.fetch_add(1, Ordering::SeqCst) == 0 {
            (
                "200 OK",
                r#"{"name":"env1","incarnation":1,"heartbeat_s":0.05}"#,
            )
        } else {
            (
                "409 Conflict",
                r#"{"error":{"code":"node_name_taken","message":"a live node named `env1` is a member at http://127.0.0.9:1"}}"#,
            )
        }
    } else if line.contains("/heartbeat") {
        (
            "404 Not Found",
            r#"{"error":{"code":"not_a_member","message":"not a member"}}"#,
        )
    } else {
        ("200 OK", "{}")
    };
    let mut stream = reader.into_inner();
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{reply}",
        reply.len()
    );
}

#[test]
fn a_node_the_head_replaced_stops_with_an_error_naming_the_head_and_the_name() {
    let dir = tempfile::tempdir().unwrap();
    let head = TcpListener::bind("127.0.0.1:0").unwrap();
    let head_url = format!("http://{}", head.local_addr().unwrap());
    let joins = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&joins);
    // Detached on purpose: the accept loop dies with the test process.
    std::thread::spawn(move || {
        for stream in head.incoming().flatten() {
            answer(stream, &counted);
        }
    });
    let listen = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let config = env_config(dir.path(), &head_url, &listen);
    let mut node = Proc::start(dir.path(), &config, "env1", "t");
    let status = node.wait_exit(Duration::from_secs(30));
    let logs = node.logs();
    assert!(!status.success(), "exits non-zero: {status}\n{logs}");
    let error = logs
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("an error line\n{logs}"));
    for expected in [
        head_url.as_str(),
        "`env1`",
        "replaced",
        "409",
        "127.0.0.9:1",
    ] {
        assert!(error.contains(expected), "`{expected}` in {error}");
    }
    // One first join and one join again: it gave up at once.
    assert_eq!(joins.load(Ordering::SeqCst), 2, "{logs}");
}
