//! The HTTP/1.1 plumbing every Sluice server and client shares:
//!
//! | module | what |
//! |---|---|
//! | this file | [`HttpClient`], the one JSON client of the remote protocols (remote engines, remote envs, a node's calls to its head) |
//! | [`api`] | the server kit of every JSON API: [`ApiError`] and its one answer shape, the bearer check as a 401, the body rules (limit, `Content-Type`, JSON) |
//! | [`auth`] | the bearer-token check every server runs on its guarded routes, and token loading (trimmed) |
//! | [`serve`](mod@serve) | the server loop: deadlines on a request's head and body, a cap on open connections, a bounded graceful stop |
//! | [`origin`] | `http(s)://host:port` base URLs, checked strictly (member URLs, configured servers) |
//!
//! The client opens one connection per call (remote calls are few and long next to a TCP
//! handshake on a LAN), the connection driven inside the call's own future (no background task
//! to leak), one deadline over connect + request + body, and a cap on a buffered answer's
//! body ([`DEFAULT_MAX_BODY_BYTES`]; a [`HttpClient::download`] streamed to a file is not
//! capped). Only `http://` is spoken: these servers live on a trusted network, guarded by a
//! bearer token.

pub mod api;
pub mod auth;
pub mod origin;
pub mod serve;

use std::time::Duration;

use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::Request;
pub use hyper::body::Bytes;
pub use hyper::{Method, StatusCode};

pub use api::ApiError;
pub use auth::{BearerRefusal, check_bearer};
use hyper_util::rt::TokioIo;
pub use serve::{ServeOptions, serve};
use sluice_core::config::Secret;
use tokio::net::TcpStream;

/// Why a call got no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// The base URL is not `http://host:port[/prefix]`.
    #[error("{what} url `{url}` {reason}")]
    BadUrl {
        /// What the server is (`"remote engine"`, `"env server"`), for the message.
        what: String,
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Connecting, sending or reading failed.
    #[error("{url}{path}: {message}")]
    Transport {
        /// The server.
        url: String,
        /// The route.
        path: String,
        /// What failed.
        message: String,
    },
    /// No whole answer within the deadline.
    #[error("{url}{path}: no answer within {after:?}")]
    Timeout {
        /// The server.
        url: String,
        /// The route.
        path: String,
        /// The deadline.
        after: Duration,
    },
}

/// What [`HttpClient::download`] got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Download {
    /// A 2xx answer, written whole to the file.
    Saved {
        /// Bytes written.
        bytes: u64,
        /// CRC-32 of the bytes written.
        crc32: u32,
    },
    /// Another status, with its body (nothing written).
    Refused(StatusCode, Bytes),
}

/// The default cap on a buffered answer's body (see [`HttpClient::with_max_body_bytes`]):
/// far above any legitimate answer of the remote protocols (a completion of tens of thousands of
/// tokens with their logprobs is a few MB, an env observation a few MB), low enough that a
/// server sending an endless body cannot drive the run out of memory.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 64 * 1024 * 1024;

/// One server, `http://host:port[/prefix]`, and the token every call carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpClient {
    url: String,
    authority: String,
    prefix: String,
    /// Sent as `Authorization: Bearer <token>` with every call.
    token: Option<Secret>,
    /// The most bytes a buffered answer's body may hold ([`Self::call`], and a refused
    /// [`Self::download`]); a longer one is a [`HttpError::Transport`].
    max_body_bytes: u64,
}

impl HttpClient {
    /// Parses `base_url`; `what` names the server in errors (`"remote engine"`).
    pub fn new(base_url: &str, what: &str) -> Result<Self, HttpError> {
        let bad = |reason| HttpError::BadUrl {
            what: what.to_owned(),
            url: base_url.to_owned(),
            reason,
        };
        let rest = base_url
            .strip_prefix("http://")
            .ok_or_else(|| bad("must start with http://"))?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        origin::check_authority(authority).map_err(bad)?;
        Ok(Self {
            url: base_url.trim_end_matches('/').to_owned(),
            authority: authority.to_owned(),
            prefix: prefix.to_owned(),
            token: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        })
    }

    /// The same server, every call carrying `token`.
    pub fn with_token(mut self, token: Option<Secret>) -> Self {
        self.token = token;
        self
    }

    /// The same server, refusing a buffered answer whose body is over `max_body_bytes`
    /// (default [`DEFAULT_MAX_BODY_BYTES`]). A successful [`Self::download`] streams to its
    /// file and is not capped.
    pub fn with_max_body_bytes(mut self, max_body_bytes: u64) -> Self {
        self.max_body_bytes = max_body_bytes;
        self
    }

    /// The base URL, without a trailing slash.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sends `body` (JSON) to `path` under the prefix and returns the status and the body, or
    /// why no whole answer came within `timeout` (a body over the client's byte cap is a
    /// [`HttpError::Transport`] naming the cap).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), HttpError> {
        match tokio::time::timeout(timeout, self.exchange(method, path, body)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(message)) => Err(HttpError::Transport {
                url: self.url.clone(),
                path: path.to_owned(),
                message,
            }),
            Err(_) => Err(HttpError::Timeout {
                url: self.url.clone(),
                path: path.to_owned(),
                after: timeout,
            }),
        }
    }

    /// `GET path` streamed into the file `dest` (created or truncated), one frame at a time, so
    /// a large body never sits in memory. Returns the status, the byte count and the CRC-32 of
    /// what was written; a non-2xx answer writes nothing and returns its body (as the error
    /// text) instead. One deadline over the whole transfer, as [`Self::call`].
    pub async fn download(
        &self,
        path: &str,
        dest: &std::path::Path,
        timeout: Duration,
    ) -> Result<Download, HttpError> {
        let transfer = async {
            let stream = TcpStream::connect(&self.authority)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| format!("handshake: {e}"))?;
            let request = self.request(Method::GET, path, None)?;
            let exchange = async {
                let response = sender
                    .send_request(request)
                    .await
                    .map_err(|e| format!("request: {e}"))?;
                let status = response.status();
                if !status.is_success() {
                    let bytes = self.collect_body(response).await?;
                    return Ok(Download::Refused(status, bytes));
                }
                let mut body = response.into_body();
                let mut file = tokio::fs::File::create(dest)
                    .await
                    .map_err(|e| format!("creating {}: {e}", dest.display()))?;
                let mut crc = crc32fast::Hasher::new();
                let mut bytes = 0u64;
                while let Some(frame) = body.frame().await {
                    let frame = frame.map_err(|e| format!("response body: {e}"))?;
                    if let Ok(data) = frame.into_data() {
                        crc.update(&data);
                        bytes += data.len() as u64;
                        tokio::io::AsyncWriteExt::write_all(&mut file, &data)
                            .await
                            .map_err(|e| format!("writing {}: {e}", dest.display()))?;
                    }
                }
                tokio::io::AsyncWriteExt::flush(&mut file)
                    .await
                    .map_err(|e| format!("writing {}: {e}", dest.display()))?;
                Ok(Download::Saved {
                    bytes,
                    crc32: crc.finalize(),
                })
            };
            let mut exchange = std::pin::pin!(exchange);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                biased;
                out = &mut exchange => out,
                ended = &mut conn => match ended {
                    Ok(()) => exchange.await,
                    Err(e) => Err(format!("connection: {e}")),
                },
            }
        };
        match tokio::time::timeout(timeout, transfer).await {
            Ok(Ok(d)) => Ok(d),
            Ok(Err(message)) => Err(HttpError::Transport {
                url: self.url.clone(),
                path: path.to_owned(),
                message,
            }),
            Err(_) => Err(HttpError::Timeout {
                url: self.url.clone(),
                path: path.to_owned(),
                after: timeout,
            }),
        }
    }

    /// A request to `path` under the prefix, with the host, JSON content type and token.
    fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Request<Full<Bytes>>, String> {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.prefix))
            .header(hyper::header::HOST, &self.authority)
            .header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some(token) = &self.token {
            request = request.header(
                hyper::header::AUTHORIZATION,
                format!("Bearer {}", token.expose()),
            );
        }
        request
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| format!("request: {e}"))
    }

    /// The whole body of `response`, refused once over `max_body_bytes`: up front from its
    /// `Content-Length`, else while collecting (a chunked or close-delimited body).
    async fn collect_body(
        &self,
        response: hyper::Response<hyper::body::Incoming>,
    ) -> Result<Bytes, String> {
        let limit = self.max_body_bytes;
        let too_large =
            || format!("the answer's body is over this client's limit of {limit} bytes; refused");
        let declared = response
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit) {
            return Err(too_large());
        }
        let cap = usize::try_from(limit).unwrap_or(usize::MAX);
        match Limited::new(response.into_body(), cap).collect().await {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
            Err(e) => Err(format!("response body: {e}")),
        }
    }

    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), String> {
        let stream = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let request = self.request(method, path, body)?;
        let exchange = async {
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| format!("request: {e}"))?;
            let status = response.status();
            let bytes = self.collect_body(response).await?;
            Ok((status, bytes))
        };
        let mut exchange = std::pin::pin!(exchange);
        let mut conn = std::pin::pin!(conn);
        // The connection future does the I/O; poll it alongside the exchange. If it ends first
        // (the server closed after answering) the exchange still completes from what was read.
        tokio::select! {
            biased;
            out = &mut exchange => out,
            ended = &mut conn => match ended {
                Ok(()) => exchange.await,
                Err(e) => Err(format!("connection: {e}")),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn urls_name_host_port_and_an_optional_prefix() {
        let c = HttpClient::new("http://127.0.0.1:9000/envs/", "env server").unwrap();
        assert_eq!(
            (c.authority.as_str(), c.prefix.as_str(), c.url()),
            ("127.0.0.1:9000", "/envs", "http://127.0.0.1:9000/envs")
        );
        let e = HttpClient::new("https://x:1", "remote engine").unwrap_err();
        assert_eq!(
            e.to_string(),
            "remote engine url `https://x:1` must start with http://"
        );
        assert!(HttpClient::new("http://nohost", "env server").is_err());
    }

    /// A one-shot server that records the request head and answers `reply`.
    async fn serve_once(reply: &'static str) -> (String, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = socket.read(&mut buf).await.unwrap();
            socket.write_all(reply.as_bytes()).await.unwrap();
            String::from_utf8_lossy(&buf[..n]).into_owned()
        });
        (format!("http://{addr}/api"), task)
    }

    #[tokio::test]
    async fn a_call_carries_the_prefix_and_token_and_returns_status_and_body() {
        let (url, server) = serve_once("HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}").await;
        let client = HttpClient::new(&url, "test")
            .unwrap()
            .with_token(Some(Secret::new("s3cret")));
        let (status, body) = client
            .call(
                Method::POST,
                "/v1/x",
                Some(b"{}".to_vec()),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"{}"[..]));
        let head = server.await.unwrap();
        assert!(head.starts_with("POST /api/v1/x HTTP/1.1"), "{head}");
        assert!(head.contains("authorization: Bearer s3cret"), "{head}");
    }

    #[tokio::test]
    async fn a_silent_server_is_a_timeout_and_a_closed_port_a_transport_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let client = HttpClient::new(&url, "test").unwrap();
        let e = client
            .call(Method::GET, "/slow", None, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(e, HttpError::Timeout { .. }), "{e}");
        drop(listener);
        let e = client
            .call(Method::GET, "/gone", None, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(e, HttpError::Transport { .. }), "{e}");
    }

    /// A server on `127.0.0.1:0` that reads the request head, writes `head`, then writes
    /// `block` `repeat` times (or until the client goes away) and closes. The tests' "endless"
    /// bodies stop at 16 MiB so that a client without a cap fails them without eating memory.
    async fn serve_body(head: &'static str, block: Vec<u8>, repeat: Option<usize>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = socket.read(&mut buf).await;
            if socket.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let mut sent = 0;
            while repeat.is_none_or(|r| sent < r) && socket.write_all(&block).await.is_ok() {
                sent += 1;
            }
        });
        format!("http://{addr}")
    }

    /// One chunk of 64 KiB, framed.
    fn chunk() -> Vec<u8> {
        [&b"10000\r\n"[..], &[b'x'; 0x10000], b"\r\n"].concat()
    }

    #[tokio::test]
    async fn a_long_chunked_body_is_refused_at_the_byte_limit() {
        let url = serve_body(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            chunk(),
            Some(256),
        )
        .await;
        let client = HttpClient::new(&url, "test")
            .unwrap()
            .with_max_body_bytes(1024 * 1024);
        // A generous deadline: the cap, not the deadline, must end the call.
        let e = client
            .call(
                Method::POST,
                "/v1/completions",
                None,
                Duration::from_secs(120),
            )
            .await
            .unwrap_err();
        assert!(matches!(e, HttpError::Transport { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("{url}/v1/completions: ")),
            "{text}"
        );
        assert!(text.contains("limit of 1048576 bytes"), "{text}");
    }

    #[tokio::test]
    async fn an_oversized_content_length_is_refused_before_reading_the_body() {
        // The server declares 1 GiB and sends nothing more: only the header can end the call.
        let url = serve_body(
            "HTTP/1.1 200 OK\r\ncontent-length: 1073741824\r\n\r\n",
            Vec::new(),
            Some(0),
        )
        .await;
        let client = HttpClient::new(&url, "test")
            .unwrap()
            .with_max_body_bytes(1024);
        let e = client
            .call(Method::GET, "/v1/envs", None, Duration::from_secs(120))
            .await
            .unwrap_err();
        assert!(matches!(e, HttpError::Transport { .. }), "{e}");
        assert!(e.to_string().contains("limit of 1024 bytes"), "{e}");
        // Just under the default, a body passes.
        let url = serve_body(
            "HTTP/1.1 200 OK\r\ncontent-length: 1024\r\n\r\n",
            vec![b'y'; 1024],
            Some(1),
        )
        .await;
        let (_, body) = HttpClient::new(&url, "test")
            .unwrap()
            .with_max_body_bytes(1024)
            .call(Method::GET, "/v1/envs", None, Duration::from_secs(120))
            .await
            .unwrap();
        assert_eq!(body.len(), 1024);
    }

    #[tokio::test]
    async fn a_download_streams_past_the_limit_but_a_refusal_body_is_capped() {
        let dir = std::env::temp_dir().join(format!("sluice-http-dl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("weights.bin");
        // 2 MiB of weights through a client capped at 1 MiB: saved whole.
        let url = serve_body(
            "HTTP/1.1 200 OK\r\ncontent-length: 2097152\r\n\r\n",
            vec![b'w'; 64 * 1024],
            Some(32),
        )
        .await;
        let client = HttpClient::new(&url, "test")
            .unwrap()
            .with_max_body_bytes(1024 * 1024);
        let saved = client
            .download("/w", &file, Duration::from_secs(120))
            .await
            .unwrap();
        assert!(
            matches!(
                saved,
                Download::Saved {
                    bytes: 2_097_152,
                    ..
                }
            ),
            "{saved:?}"
        );
        // An endless error body is refused at the cap.
        let url = serve_body(
            "HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n",
            chunk(),
            Some(256),
        )
        .await;
        let e = HttpClient::new(&url, "test")
            .unwrap()
            .with_max_body_bytes(1024 * 1024)
            .download("/w", &file, Duration::from_secs(120))
            .await
            .unwrap_err();
        assert!(matches!(e, HttpError::Transport { .. }), "{e}");
        assert!(e.to_string().contains("limit of 1048576 bytes"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
