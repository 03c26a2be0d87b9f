//! A minimal blocking HTTP/1.1 client for the admin API (what `sluice status`, `sluice knobs`
//! and the tests use): one request per connection, JSON bodies, optional bearer token, bounded
//! connect and read times.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the server may take to answer.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

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
    stream
        .set_read_timeout(Some(READ_TIMEOUT))
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
    let mut raw = Vec::new();
    let read = stream.read_to_end(&mut raw);
    if raw.is_empty() {
        if let Err(e) = sent {
            return Err(err(format!("send: {e}")));
        }
        read.map_err(|e| err(format!("read: {e}")))?;
    }
    parse_response(&raw).map_err(err)
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

fn parse_response(raw: &[u8]) -> Result<(u16, String), String> {
    let text = String::from_utf8_lossy(raw);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| "malformed response".to_owned())?;
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
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    Ok((status, body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn only_http_urls_are_accepted() {
        let e = request("https://127.0.0.1:1", "GET", "/v1/status", None, None).unwrap_err();
        assert!(e.to_string().contains("only http://"), "{e}");
    }
}
