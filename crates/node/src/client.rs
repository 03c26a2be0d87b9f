//! A minimal blocking HTTP/1.1 client for the admin API (what `sluice status`, `sluice knobs`
//! and the tests use): one request per connection, JSON bodies, optional bearer token, bounded
//! connect time, a whole-exchange deadline and a cap on the answer's size.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the whole exchange (sending the request, reading the whole answer) may take once
/// connected.
const EXCHANGE_DEADLINE: Duration = Duration::from_secs(30);
/// The most bytes an answer (head and body) may hold: admin answers are a few KiB, so this only
/// stops a broken or hostile server from growing the CLI's memory without bound.
const MAX_RESPONSE_BYTES: u64 = 64 * 1024 * 1024;

/// An admin call failed before an HTTP status came back.
#[derive(Debug, thiserror::Error)]
#[error("admin API {url}: {message}")]
pub struct ClientError {
    /// The URL called.
    pub url: String,
    /// What went wrong.
    pub message: String,
}

/// One request, spelled out (see [`request`] for the common case).
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// `GET`, `PATCH`, `POST`, …
    pub method: &'a str,
    /// Path and query, starting with `/`.
    pub path: &'a str,
    /// Request body (sent with a `Content-Length`).
    pub body: &'a [u8],
    /// Bearer token.
    pub token: Option<&'a str>,
    /// `Content-Type` header, if any.
    pub content_type: Option<&'a str>,
}

/// The bounds on one exchange (the constants above; tests use small ones).
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// Deadline over sending the request and reading the whole answer.
    deadline: Duration,
    /// The most bytes the answer may hold.
    max_response_bytes: u64,
}

impl Limits {
    const DEFAULT: Self = Self {
        deadline: EXCHANGE_DEADLINE,
        max_response_bytes: MAX_RESPONSE_BYTES,
    };
}

/// Sends `method path` to `base` (`http://host:port`) with an optional JSON body; returns the
/// status code and the body.
pub fn request(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> Result<(u16, String), ClientError> {
    send(
        base,
        &Call {
            method,
            path,
            body: body.unwrap_or("").as_bytes(),
            token,
            content_type: Some("application/json"),
        },
    )
}

/// Sends `call` to `base` (`http://host:port`); returns the status code and the body.
pub fn send(base: &str, call: &Call<'_>) -> Result<(u16, String), ClientError> {
    send_limited(base, call, Limits::DEFAULT)
}

fn send_limited(base: &str, call: &Call<'_>, limits: Limits) -> Result<(u16, String), ClientError> {
    let url = format!("{}{}", base.trim_end_matches('/'), call.path);
    let err = |message: String| ClientError {
        url: url.clone(),
        message,
    };
    let host = base
        .strip_prefix("http://")
        .ok_or_else(|| err("only http:// URLs are supported".into()))?
        .trim_end_matches('/');
    let mut stream = connect(host).map_err(&err)?;
    let started = Instant::now();
    stream
        .set_write_timeout(Some(limits.deadline))
        .map_err(|e| err(e.to_string()))?;
    let auth = call
        .token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let content_type = call
        .content_type
        .map(|c| format!("Content-Type: {c}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "{} {} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{content_type}Content-Length: {}\r\n{auth}\r\n",
        call.method,
        call.path,
        call.body.len()
    );
    // A server may answer (413) and close before reading a large body: a failed write is only
    // an error if no answer can be read afterwards.
    let sent = stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(call.body));
    let raw = match read_answer(&mut stream, limits, started) {
        Ok(raw) => raw,
        Err(ReadFailure::Bounded(message)) => return Err(err(message)),
        Err(ReadFailure::Io { error, raw }) => {
            if raw.is_empty() {
                return Err(err(match sent {
                    Err(e) => format!("send: {e}"),
                    Ok(()) => format!("read: {error}"),
                }));
            }
            // The server answered and then reset the connection: parse what came (a short
            // body is caught against its `Content-Length` or chunk sizes).
            raw
        }
    };
    parse_response(&raw).map_err(err)
}

/// Why [`read_answer`] stopped before the server closed the connection.
enum ReadFailure {
    /// The deadline passed or the size cap was reached: the answer is refused.
    Bounded(String),
    /// The socket failed; what was read before is kept.
    Io { error: std::io::Error, raw: Vec<u8> },
}

/// Reads until the server closes, at most `limits.max_response_bytes`, within what remains of
/// `limits.deadline` since `started` (each read's timeout is lowered to that remainder, so a
/// server trickling a byte at a time cannot stretch the exchange).
fn read_answer(
    stream: &mut TcpStream,
    limits: Limits,
    started: Instant,
) -> Result<Vec<u8>, ReadFailure> {
    let late = || ReadFailure::Bounded(format!("no whole answer within {:?}", limits.deadline));
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    // One byte past the cap tells "exactly at the cap" from "over it".
    let mut limited = stream.take(limits.max_response_bytes + 1);
    loop {
        let left = limits.deadline.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(late());
        }
        if let Err(error) = limited.get_ref().set_read_timeout(Some(left)) {
            return Err(ReadFailure::Io { error, raw });
        }
        match limited.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(late());
            }
            Err(error) => return Err(ReadFailure::Io { error, raw }),
        }
    }
    if raw.len() as u64 > limits.max_response_bytes {
        return Err(ReadFailure::Bounded(format!(
            "the answer is larger than {} bytes; refused",
            limits.max_response_bytes
        )));
    }
    Ok(raw)
}

fn connect(host: &str) -> Result<TcpStream, String> {
    let addrs = host
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve `{host}`: {e}"))?;
    let mut last = format!("`{host}` resolves to no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("cannot connect to {addr}: {e}"),
        }
    }
    Err(last)
}

/// Splits the raw answer into its status and body. The body is framed on bytes (chunk sizes
/// and `Content-Length` count bytes, and a chunk may end inside a UTF-8 character), then
/// decoded, lossily, as text.
fn parse_response(raw: &[u8]) -> Result<(u16, String), String> {
    let head_end = find(raw, b"\r\n\r\n").ok_or_else(|| "malformed response".to_owned())?;
    let head = String::from_utf8_lossy(&raw[..head_end]);
    let rest = &raw[head_end + 4..];
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            format!(
                "malformed status line: {}",
                head.lines().next().unwrap_or("")
            )
        })?;
    let header = |name: &str| {
        head.lines().skip(1).find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    };
    let chunked =
        header("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(length) = header("content-length") {
        let length: usize = length
            .parse()
            .map_err(|_| format!("malformed Content-Length `{length}`"))?;
        if rest.len() < length {
            return Err(format!(
                "the answer ended after {} of its {length} body bytes",
                rest.len()
            ));
        }
        rest[..length].to_vec()
    } else {
        rest.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Decodes a chunked body; the terminal 0-size chunk must be there (trailers after it are
/// ignored), and every chunk whole.
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    const ENDED_EARLY: &str = "chunked body ended without its terminal 0-size chunk";
    let mut out = Vec::new();
    loop {
        let line_end = find(rest, b"\r\n").ok_or_else(|| ENDED_EARLY.to_owned())?;
        let line = String::from_utf8_lossy(&rest[..line_end]);
        // A size may carry `;extension`s.
        let size = line.split(';').next().unwrap_or("").trim();
        let n = usize::from_str_radix(size, 16)
            .ok()
            .filter(|_| !size.starts_with('+'))
            .ok_or_else(|| {
                let shown: String = line.chars().take(32).collect();
                format!("malformed chunk size line `{}`", shown.escape_debug())
            })?;
        rest = &rest[line_end + 2..];
        if n == 0 {
            return Ok(out);
        }
        if rest.len() < n {
            return Err(format!(
                "a chunk of {n} bytes, but only {} bytes remain",
                rest.len()
            ));
        }
        out.extend_from_slice(&rest[..n]);
        rest = match &rest[n..] {
            [] => return Err(ENDED_EARLY.to_owned()),
            after => after
                .strip_prefix(b"\r\n")
                .ok_or_else(|| format!("a chunk of {n} bytes is not followed by CRLF"))?,
        };
    }
}

/// Where `needle` first starts in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::thread;

    use super::*;

    #[test]
    fn responses_parse_plain_and_chunked() {
        let plain = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(plain).unwrap(), (401, "{}".to_owned()));
        let chunked =
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap(), (200, "abcde".to_owned()));
        assert!(parse_response(b"garbage").is_err());
    }

    /// One row per broken framing: the error names what was wrong instead of returning a
    /// truncated body.
    #[test]
    fn broken_framing_is_an_error_naming_the_fault() {
        let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
        for (body, expected) in [
            (&b"3\r\nabc\r\n"[..], "terminal 0-size chunk"),
            (b"3\r\nabc", "terminal 0-size chunk"),
            (
                b"f\r\nabc\r\n0\r\n\r\n",
                "a chunk of 15 bytes, but only 10 bytes remain",
            ),
            (b"zz\r\nabc\r\n0\r\n\r\n", "malformed chunk size line `zz`"),
            // The sweep's repro: a 1-byte chunk followed by both bytes of `é`.
            (
                b"1\r\n\xc3\xa9\r\n0\r\n\r\n",
                "a chunk of 1 bytes is not followed by CRLF",
            ),
        ] {
            let raw = [head.as_bytes(), body].concat();
            let e = parse_response(&raw).unwrap_err();
            assert!(e.contains(expected), "{body:?}: {e}");
        }
        let short = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc";
        let e = parse_response(short).unwrap_err();
        assert!(e.contains("ended after 3 of its 10 body bytes"), "{e}");
    }

    /// A server on `127.0.0.1:0` that reads the request head, then runs `answer` on the socket
    /// (write errors, once the client has gone, end it).
    fn serve_once(answer: impl FnOnce(&mut TcpStream) + Send + 'static) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = socket.read(&mut buf);
            answer(&mut socket);
        });
        base
    }

    #[test]
    fn a_chunk_boundary_inside_a_utf8_character_decodes_whole() {
        let base = serve_once(|s| {
            let _ = s.write_all(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                  3\r\n\"r\xc3\r\n3\r\n\xa9\"x\r\n0\r\n\r\n",
            );
        });
        let (status, body) = request(&base, "GET", "/v1/status", None, None).unwrap();
        assert_eq!((status, body.as_str()), (200, "\"ré\"x"));
    }

    /// `GET /v1/status`, as `sluice status` calls it.
    const STATUS: Call<'static> = Call {
        method: "GET",
        path: "/v1/status",
        body: b"",
        token: None,
        content_type: None,
    };

    #[test]
    fn an_endless_answer_is_refused_at_the_size_cap() {
        let base = serve_once(|s| {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
            let block = [b'x'; 64 * 1024];
            while s.write_all(&block).is_ok() {}
        });
        let limits = Limits {
            deadline: Duration::from_secs(60),
            max_response_bytes: 1024 * 1024,
        };
        let e = send_limited(&base, &STATUS, limits).unwrap_err();
        assert!(
            e.message.contains("larger than 1048576 bytes"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_trickling_answer_is_cut_at_the_whole_exchange_deadline() {
        let base = serve_once(|s| {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
            // A byte every 100 ms: each read is quick, the whole never ends.
            while s.write_all(b"x").is_ok() {
                thread::sleep(Duration::from_millis(100));
            }
        });
        let limits = Limits {
            deadline: Duration::from_millis(500),
            max_response_bytes: MAX_RESPONSE_BYTES,
        };
        let started = Instant::now();
        let e = send_limited(&base, &STATUS, limits).unwrap_err();
        assert!(
            e.message.contains("no whole answer within"),
            "{}",
            e.message
        );
        // Generous: the point is that it ends, not how fast.
        assert!(started.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn only_http_urls_are_accepted() {
        let e = request("https://127.0.0.1:1", "GET", "/v1/status", None, None).unwrap_err();
        assert!(e.to_string().contains("only http://"), "{e}");
    }
}
