//! A minimal blocking HTTP/1.1 client for the admin API (what `sluice knobs` and the tests use):
//! one request per connection, JSON bodies, optional bearer token.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// An admin call failed before an HTTP status came back.
#[derive(Debug, thiserror::Error)]
#[error("admin API {url}: {message}")]
pub struct ClientError {
    /// The URL called.
    pub url: String,
    /// What went wrong.
    pub message: String,
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
    let url = format!("{}{path}", base.trim_end_matches('/'));
    let err = |message: String| ClientError {
        url: url.clone(),
        message,
    };
    let host = base
        .strip_prefix("http://")
        .ok_or_else(|| err("only http:// URLs are supported".into()))?
        .trim_end_matches('/');
    let mut stream = TcpStream::connect(host).map_err(|e| err(format!("cannot connect: {e}")))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| err(e.to_string()))?;
    let body = body.unwrap_or("");
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{auth}\r\n",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body.as_bytes()))
        .map_err(|e| err(format!("send: {e}")))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .map_err(|e| err(format!("read: {e}")))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| err("malformed response".into()))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            err(format!(
                "malformed status line: {}",
                head.lines().next().unwrap_or("")
            ))
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
