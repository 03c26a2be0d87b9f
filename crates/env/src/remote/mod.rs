//! The remote env protocol: environments served by another process or machine (a code sandbox, a
//! desktop worker) over JSON/HTTP, so env workers need not live in the trainer's process.
//!
//! | call | request body | response |
//! |---|---|---|
//! | `GET /v1/health` | — | `{"status": "ok", "envs": <open>, "envs_created_total": n, "steps_total": n}` |
//! | `GET /v1/tasks` | — | `{"tasks": ["arithmetic", …]}` |
//! | `POST /v1/envs` | `{"task": "<name>", "sample": <DataSample>}` | `201 {"env_id": "e1"}` |
//! | `POST /v1/envs/{id}/init` | `{}` | [`EnvInit`](crate::EnvInit) |
//! | `POST /v1/envs/{id}/step` | `{"message": <assistant Message>}` | [`EnvStep`](crate::EnvStep) |
//! | `DELETE /v1/envs/{id}` | — | `204` |
//!
//! Errors answer with a status code and `{"error": {"kind": "<stable kind>", "message": "…"}}`
//! (the server writes the HTTP kit's shape, [`sluice_http::api::ApiError`], so the object also
//! carries `type`, the same kind, `param` and `code`; a client reads only `kind`, `message` and
//! `deadline_ms`):
//! 400 `env_bad_input` / `bad_request` (a body that is not the call's JSON; 413 and 415 for
//! too large and not JSON), 401 `unauthorized` (a token is configured, see
//! [`ServerConfig::token`]), 404 `unknown_task` / `unknown_env` / `unknown_route`, 409
//! `env_protocol` (a step before init, a second init, a step after done), 500 `env_panic` /
//! `env_failed`, 503 `server_full`, 504 `env_timeout` (with `deadline_ms`, the deadline that
//! passed, so the client's [`crate::EnvError::Timeout`] names it).
//!
//! The client ([`RemoteEnv`]) puts a deadline on every call; an unreachable or dead server fails
//! the rollout with `Error("env_remote")`, and the caller goes on. [`RoutedEnv`] spreads envs
//! over a changing set of servers (a head's joined env nodes) and moves an episode whose server
//! is gone to another one.

mod client;
mod http;
mod routed;
mod server;

use serde::{Deserialize, Serialize};
use sluice_core::{DataSample, Message};

pub use client::{MAX_ENV_REWARD, RemoteEnv, RemoteEnvFactory};
pub use routed::{EnvServer, EnvServers, OpenEnvs, RoutedEnv, RoutedEnvFactory, ServerId};
pub use server::{ServerConfig, ServerStats, router, router_with_stats, serve, serve_with_stats};

/// `POST /v1/envs` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRequest {
    /// Registered task whose env to create.
    pub task: String,
    /// The sample the episode is about.
    pub sample: DataSample,
}

/// `POST /v1/envs` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateResponse {
    /// Id to use in the env's other calls.
    pub env_id: String,
}

/// `POST /v1/envs/{id}/step` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    /// The parsed assistant message.
    pub message: Message,
}

/// `GET /v1/tasks` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TasksResponse {
    /// Registered task names.
    pub tasks: Vec<String>,
}

/// `GET /v1/health` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthResponse {
    /// Always `ok` when the server answers.
    pub status: String,
    /// Envs currently open.
    pub envs: usize,
    /// Envs created since the server started.
    #[serde(default)]
    pub envs_created_total: u64,
    /// Env steps answered since the server started.
    #[serde(default)]
    pub steps_total: u64,
}

/// Error body of every failed call, as a client reads it (the server's answer has more members;
/// see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What failed.
    pub error: ErrorDetail,
}

/// The `error` object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Stable kind ([`crate::EnvError::kind`] or `unknown_env`, `unknown_route`, `server_full`,
    /// `bad_request`, `unauthorized`).
    pub kind: String,
    /// Human-readable cause.
    pub message: String,
    /// With `env_timeout`: the server's deadline that passed, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
}
