//! The env client's view of the shared HTTP client ([`sluice_http::HttpClient`]): one deadline
//! for every call, failures as [`EnvError`]s.

use std::time::Duration;

use sluice_core::config::Secret;
use sluice_http::{Bytes, HttpError, Method, StatusCode};

use crate::error::EnvError;

/// An env server and the deadline of every call to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HttpClient {
    inner: sluice_http::HttpClient,
    timeout: Duration,
}

impl HttpClient {
    /// Parses `base_url` (`http://host:port[/prefix]`).
    pub(crate) fn new(base_url: &str, timeout: Duration) -> Result<Self, EnvError> {
        let inner = sluice_http::HttpClient::new(base_url, "env server")
            .map_err(|e| EnvError::Config(e.to_string()))?;
        Ok(Self { inner, timeout })
    }

    /// The same server, every call carrying `token`.
    pub(crate) fn with_token(mut self, token: Option<Secret>) -> Self {
        self.inner = self.inner.with_token(token);
        self
    }

    /// The deadline of every call.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
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
        self.inner
            .call(method, path, body, self.timeout)
            .await
            .map_err(|e| match e {
                HttpError::Timeout { after, .. } => EnvError::Timeout { call, after },
                HttpError::Transport { message, .. } => EnvError::Remote {
                    url: self.inner.url().to_owned(),
                    message,
                },
                HttpError::BadUrl { .. } => EnvError::Config(e.to_string()),
            })
    }
}
