//! The client side: [`RemoteEnv`] is a [`MessageEnv`] whose calls go to an env server, and
//! [`RemoteEnvFactory`] makes one per rollout, so a local [`Task`](crate::Task) (rubric, system
//! prompt, data) can run its envs elsewhere with [`Task::with_env`](crate::Task::with_env).
//!
//! The remote env is created lazily in `init` (env factories are synchronous), and deleted in
//! `close`.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sluice_core::config::Secret;
use sluice_core::{DataSample, Message};
use sluice_http::{Method, StatusCode};

use super::http::{CallError, HttpClient};
use super::{CreateRequest, CreateResponse, ErrorBody, StepRequest};
use crate::error::EnvError;
use crate::protocol::{BoxFuture, EnvInit, EnvStep, MessageEnv};
use crate::task::EnvFactory;

/// An env living on an env server.
#[derive(Debug)]
pub struct RemoteEnv {
    http: HttpClient,
    task: String,
    sample: DataSample,
    env_id: Option<String>,
}

impl RemoteEnv {
    /// An env of `task` for `sample` on the server at `base_url` (`http://host:port`); every call
    /// has `timeout`.
    pub fn new(
        base_url: &str,
        task: impl Into<String>,
        sample: DataSample,
        timeout: Duration,
    ) -> Result<Self, EnvError> {
        Ok(Self {
            http: HttpClient::new(base_url, timeout)?,
            task: task.into(),
            sample,
            env_id: None,
        })
    }

    /// The same env, its calls carrying `Authorization: Bearer <token>` (a server started with
    /// a token refuses calls without it).
    pub fn with_token(mut self, token: Option<Secret>) -> Self {
        self.http = self.http.with_token(token);
        self
    }

    /// The server-side id, once created.
    pub fn env_id(&self) -> Option<&str> {
        self.env_id.as_deref()
    }

    async fn json<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<(StatusCode, Option<T>), CallError> {
        let body = body
            .map(serde_json::to_vec)
            .transpose()
            .map_err(|e| CallError::env(EnvError::Failed(format!("cannot encode request: {e}"))))?;
        let (status, bytes) = self.http.call(method, path, body).await?;
        if status.is_success() {
            if bytes.is_empty() {
                return Ok((status, None));
            }
            let value = serde_json::from_slice(&bytes).map_err(|e| {
                CallError::env(EnvError::Remote {
                    url: path.to_owned(),
                    message: format!("bad response body: {e}"),
                })
            })?;
            return Ok((status, Some(value)));
        }
        Err(server_error(path, status, &bytes, self.http.timeout()))
    }

    /// Creates the env on the server and initialises it.
    pub(crate) async fn open(&mut self) -> Result<EnvInit, CallError> {
        if self.env_id.is_some() {
            return Err(CallError::env(EnvError::Protocol(
                "remote env initialised twice".into(),
            )));
        }
        let req = CreateRequest {
            task: self.task.clone(),
            sample: self.sample.clone(),
        };
        let (_, created) = self
            .json::<_, CreateResponse>(Method::POST, "/v1/envs", Some(&req))
            .await?;
        let created = created.ok_or_else(|| {
            CallError::env(EnvError::Remote {
                url: "/v1/envs".into(),
                message: "empty create response".into(),
            })
        })?;
        self.env_id = Some(created.env_id);
        let path = format!("/v1/envs/{}/init", self.id()?);
        let (_, init) = self
            .json::<_, EnvInit>(Method::POST, &path, Some(&serde_json::json!({})))
            .await?;
        init.ok_or_else(|| {
            CallError::env(EnvError::Remote {
                url: path,
                message: "empty init response".into(),
            })
        })
    }

    /// Steps the env with `assistant`.
    pub(crate) async fn step_call(&mut self, assistant: Message) -> Result<EnvStep, CallError> {
        let path = format!("/v1/envs/{}/step", self.id()?);
        let req = StepRequest { message: assistant };
        let (_, step) = self
            .json::<_, EnvStep>(Method::POST, &path, Some(&req))
            .await?;
        let step = step.ok_or_else(|| {
            CallError::env(EnvError::Remote {
                url: path.clone(),
                message: "empty step response".into(),
            })
        })?;
        refuse_wild_rewards(&step).map_err(|why| {
            CallError::env(EnvError::Remote {
                url: self.http.url().to_owned(),
                message: format!("POST {path}: {why}"),
            })
        })?;
        Ok(step)
    }

    /// Deletes the env on the server (nothing to do before it was created).
    pub(crate) async fn close_call(&mut self) -> Result<(), CallError> {
        let Some(id) = self.env_id.take() else {
            return Ok(());
        };
        let path = format!("/v1/envs/{id}");
        self.json::<(), serde_json::Value>(Method::DELETE, &path, None)
            .await
            .map(|_| ())
    }

    fn id(&self) -> Result<&str, CallError> {
        self.env_id
            .as_deref()
            .ok_or_else(|| CallError::env(EnvError::Protocol("remote env used before init".into())))
    }
}

/// The largest reward magnitude an env server may send, for the turn's reward and for each
/// named component. Rewards are compared within a group: its advantages square them and sum the
/// squares (in f64, then trained in f32), so a finite but huge reward (`1e308` is valid JSON)
/// overflows to NaN and stops the whole run with a loss error that blames the checkpoint, and
/// one of `1e39` is trained as an infinity in f32. No real reward comes near a million: a
/// reward beyond it is a server's bug or a lie, and it fails that rollout only.
pub const MAX_ENV_REWARD: f64 = 1e6;

/// Why `step` cannot be trained: a reward or component that is not finite or whose magnitude
/// is beyond [`MAX_ENV_REWARD`].
fn refuse_wild_rewards(step: &EnvStep) -> Result<(), String> {
    let rewards = step.reward.iter().map(|r| ("reward".to_owned(), *r)).chain(
        step.components
            .iter()
            .map(|(name, r)| (format!("components.{name}"), *r)),
    );
    for (what, r) in rewards {
        if !r.is_finite() || r.abs() > MAX_ENV_REWARD {
            return Err(format!(
                "{what} = {r:e} is not a finite number within ±{MAX_ENV_REWARD:e}; refused, not trained"
            ));
        }
    }
    Ok(())
}

/// Maps an error answer back to an [`EnvError`] of the same kind where one exists, so a remote
/// env's panic or timeout reads like a local one. A timeout carries the server's deadline
/// (`deadline_ms`); from a server that does not send it, `client_deadline`, the longest the
/// call can have run. `unknown_env` (the server restarted and lost the env) and `server_full`
/// say the server cannot go on with this env ([`CallError::server_gone`]).
fn server_error(
    path: &str,
    status: StatusCode,
    bytes: &[u8],
    client_deadline: Duration,
) -> CallError {
    let detail = serde_json::from_slice::<ErrorBody>(bytes)
        .ok()
        .map(|b| b.error);
    let message = detail.as_ref().map_or_else(
        || String::from_utf8_lossy(bytes).into_owned(),
        |d| d.message.clone(),
    );
    let server_gone = matches!(
        detail.as_ref().map(|d| d.kind.as_str()),
        Some("unknown_env" | "server_full")
    );
    let error = match detail.as_ref().map(|d| d.kind.as_str()) {
        Some("env_panic") => EnvError::Panic(message),
        Some("env_failed") => EnvError::Failed(message),
        Some("env_bad_input") => EnvError::BadInput(message),
        Some("env_timeout") => EnvError::Timeout {
            call: format!("remote {path}"),
            after: detail
                .as_ref()
                .and_then(|d| d.deadline_ms)
                .map_or(client_deadline, Duration::from_millis),
        },
        _ => EnvError::Remote {
            url: path.to_owned(),
            message: format!("HTTP {status}: {message}"),
        },
    };
    CallError { error, server_gone }
}

impl MessageEnv for RemoteEnv {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        Box::pin(async move { Ok(self.open().await?) })
    }

    fn step(&mut self, assistant: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        Box::pin(async move { Ok(self.step_call(assistant).await?) })
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), EnvError>> {
        Box::pin(async move { Ok(self.close_call().await?) })
    }
}

/// Makes a [`RemoteEnv`] of one task per rollout.
#[derive(Debug, Clone)]
pub struct RemoteEnvFactory {
    base_url: String,
    task: String,
    timeout: Duration,
    token: Option<Secret>,
}

impl RemoteEnvFactory {
    /// Envs of `task` on the server at `base_url`, each call with `timeout`. The URL is checked
    /// here, so a typo fails at setup, not at the first rollout.
    pub fn new(
        base_url: &str,
        task: impl Into<String>,
        timeout: Duration,
    ) -> Result<Self, EnvError> {
        HttpClient::new(base_url, timeout)?;
        Ok(Self {
            base_url: base_url.to_owned(),
            task: task.into(),
            timeout,
            token: None,
        })
    }

    /// Envs whose calls carry `Authorization: Bearer <token>`, for a server started with one.
    pub fn with_token(mut self, token: Secret) -> Self {
        self.token = Some(token);
        self
    }
}

impl EnvFactory for RemoteEnvFactory {
    fn make_env(&self, sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
        Ok(Box::new(
            RemoteEnv::new(
                &self.base_url,
                self.task.clone(),
                sample.clone(),
                self.timeout,
            )?
            .with_token(self.token.clone()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::remote::{ServerConfig, serve};
    use crate::{RewardFn, Rubric, RubricConfig, Task, TaskRegistry};

    /// Answers `init`, then never answers `step`.
    struct Hang;

    impl MessageEnv for Hang {
        fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
            Box::pin(async {
                Ok(EnvInit {
                    messages: vec![Message::user("go")],
                    tools: vec![],
                })
            })
        }
        fn step(&mut self, _m: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
            Box::pin(async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(EnvStep::done())
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_side_timeout_names_the_servers_deadline() {
        let rubric = Rubric::new(
            vec![RewardFn::new("zero", 1.0, |_| 0.0)],
            RubricConfig::default(),
        )
        .unwrap();
        let mut registry = TaskRegistry::default();
        let hang = |_: &DataSample| -> Result<Box<dyn MessageEnv>, EnvError> { Ok(Box::new(Hang)) };
        registry.register(Task::new("hang", hang, rubric)).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let config = ServerConfig {
            call_timeout: Duration::from_millis(250),
            ..ServerConfig::default()
        };
        let server = tokio::spawn(serve(listener, Arc::new(registry), config, async {
            let _ = stopped.await;
        }));
        let sample = DataSample {
            id: "s0".into(),
            domain: "test".into(),
            dataset: "t".into(),
            input: serde_json::json!({}),
            system_prompt: None,
        };
        // The client waits longer than the server: the server's deadline is what passes.
        let mut env = RemoteEnv::new(&url, "hang", sample, Duration::from_secs(30)).unwrap();
        env.init().await.unwrap();
        let err = env.step(Message::user("x")).await.unwrap_err();
        match &err {
            EnvError::Timeout { after, .. } => assert_eq!(*after, Duration::from_millis(250)),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(err.to_string().contains("after 250ms"), "{err}");
        let _ = stop.send(());
        server.await.unwrap().unwrap();
    }
}
