//! A minimal HTTP/1.1 JSON client: one connection per call, driven inside the call's own future
//! (nothing detached), one deadline over connect + request + body.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// A transport failure or a passed deadline (the server is not answering).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{url}{path}: {message}")]
pub struct TransportError {
    /// The server.
    pub url: String,
    /// The route.
    pub path: String,
    /// What failed.
    pub message: String,
}

/// One server, `http://host:port[/prefix]`.
#[derive(Debug, Clone)]
pub(crate) struct HttpClient {
    pub url: String,
    authority: String,
    prefix: String,
}

impl HttpClient {
    pub(crate) fn new(base_url: &str) -> Result<Self, String> {
        let rest = base_url
            .strip_prefix("http://")
            .ok_or_else(|| format!("remote engine url `{base_url}` must start with http://"))?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() || !authority.contains(':') {
            return Err(format!(
                "remote engine url `{base_url}` must name host:port"
            ));
        }
        Ok(Self {
            url: base_url.trim_end_matches('/').to_owned(),
            authority: authority.to_owned(),
            prefix: prefix.to_owned(),
        })
    }

    /// Sends `body` (JSON) and returns the status and body.
    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), TransportError> {
        let err = |message: String| TransportError {
            url: self.url.clone(),
            path: path.to_owned(),
            message,
        };
        tokio::time::timeout(timeout, self.exchange(method, path, body))
            .await
            .map_err(|_| err(format!("no answer within {timeout:?}")))?
            .map_err(err)
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
        let request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.prefix))
            .header(hyper::header::HOST, &self.authority)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| format!("request: {e}"))?;
        let exchange = async {
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| format!("request: {e}"))?;
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("response body: {e}"))?
                .to_bytes();
            Ok((status, bytes))
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
    }
}
