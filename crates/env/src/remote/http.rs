//! A minimal HTTP/1.1 JSON client over hyper: one connection per call (env calls are few and
//! long compared with a TCP handshake on a LAN), the connection driven inside the call's own
//! future (no background task to leak), and one deadline over connect + request + body.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use sluice_core::config::Secret;
use tokio::net::TcpStream;

use crate::error::EnvError;

/// Where a server lives: `http://host:port[/prefix]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HttpClient {
    url: String,
    authority: String,
    prefix: String,
    timeout: Duration,
    /// Sent as `Authorization: Bearer <token>` with every call.
    token: Option<Secret>,
}

impl HttpClient {
    /// Parses `base_url` (only `http://` is supported: env servers live on a trusted network).
    pub(crate) fn new(base_url: &str, timeout: Duration) -> Result<Self, EnvError> {
        let rest = base_url.strip_prefix("http://").ok_or_else(|| {
            EnvError::Config(format!(
                "env server url `{base_url}` must start with http://"
            ))
        })?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() || !authority.contains(':') {
            return Err(EnvError::Config(format!(
                "env server url `{base_url}` must name host:port"
            )));
        }
        Ok(Self {
            url: base_url.trim_end_matches('/').to_owned(),
            authority: authority.to_owned(),
            prefix: prefix.to_owned(),
            timeout,
            token: None,
        })
    }

    /// The same server, every call carrying `token`.
    pub(crate) fn with_token(mut self, token: Option<Secret>) -> Self {
        self.token = token;
        self
    }

    /// The deadline of every call.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    fn remote_error(&self, message: String) -> EnvError {
        EnvError::Remote {
            url: self.url.clone(),
            message,
        }
    }

    /// Sends one request; returns the status and the body. Transport failures are
    /// [`EnvError::Remote`], a passed deadline [`EnvError::Timeout`].
    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), EnvError> {
        let call = format!("{method} {path}");
        tokio::time::timeout(self.timeout, self.call_inner(method, path, body))
            .await
            .map_err(|_| EnvError::Timeout {
                call,
                after: self.timeout,
            })?
    }

    async fn call_inner(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), EnvError> {
        let stream = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| self.remote_error(format!("connect: {e}")))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| self.remote_error(format!("handshake: {e}")))?;
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
        let request = request
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| self.remote_error(format!("request: {e}")))?;
        let exchange = async {
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| self.remote_error(format!("request: {e}")))?;
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| self.remote_error(format!("response body: {e}")))?
                .to_bytes();
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
                Err(e) => Err(self.remote_error(format!("connection: {e}"))),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let c = HttpClient::new("http://127.0.0.1:9000/envs/", Duration::from_secs(1)).unwrap();
        assert_eq!(
            (c.authority.as_str(), c.prefix.as_str()),
            ("127.0.0.1:9000", "/envs")
        );
        assert!(HttpClient::new("https://x:1", Duration::from_secs(1)).is_err());
        assert!(HttpClient::new("http://nohost", Duration::from_secs(1)).is_err());
    }
}
