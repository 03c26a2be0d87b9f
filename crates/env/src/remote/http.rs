//! The env client's view of the shared HTTP client ([`sluice_http::HttpClient`]): one deadline
//! for every call, failures as [`CallError`]s: an [`EnvError`] and whether the server itself is
//! gone (what an env served by joined env nodes fails over on, [`super::routed`]).

use std::time::Duration;

use sluice_core::config::Secret;
use sluice_http::{Bytes, HttpError, Method, StatusCode};

use crate::error::EnvError;

/// A failed call to an env server.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CallError {
    /// What failed, as the rollout sees it.
    pub(crate) error: EnvError,
    /// The server cannot go on with the env: unreachable (refused, reset: the process is
    /// gone), no longer holding it (`unknown_env`: it restarted), or full (`server_full`). The
    /// episode may go on on another server; any other failure is the env's own.
    pub(crate) server_gone: bool,
}

impl CallError {
    /// A failure of the env (or of the request), not of the server.
    pub(crate) fn env(error: EnvError) -> Self {
        Self {
            error,
            server_gone: false,
        }
    }
}

impl From<CallError> for EnvError {
    fn from(e: CallError) -> Self {
        e.error
    }
}

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

    /// The server's base URL, as given.
    pub(crate) fn url(&self) -> &str {
        self.inner.url()
    }

    /// The deadline of every call.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends one request; returns the status and the body. Transport failures are
    /// [`EnvError::Remote`] with the server gone, a passed deadline [`EnvError::Timeout`] (a
    /// slow env is the env's failure: the server may still be running it).
    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), CallError> {
        let call = format!("{method} {path}");
        self.inner
            .call(method, path, body, self.timeout)
            .await
            .map_err(|e| match e {
                HttpError::Timeout { after, .. } => {
                    CallError::env(EnvError::Timeout { call, after })
                }
                HttpError::Transport { message, .. } => CallError {
                    error: EnvError::Remote {
                        url: self.inner.url().to_owned(),
                        message,
                    },
                    server_gone: true,
                },
                HttpError::BadUrl { .. } => CallError::env(EnvError::Config(e.to_string())),
            })
    }
}
