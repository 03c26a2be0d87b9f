//! The membership protocol's messages (the admin API's `/v1/nodes` routes): a join and its
//! reply, a heartbeat, a member as listed, and why a join is refused.

use serde::{Deserialize, Serialize};
use sluice_config::NodeRole;

/// Most tasks an env node may advertise.
pub const MAX_ADVERTISED_TASKS: usize = 64;

/// Why a join was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinError {
    /// The head has `node.max_nodes` live members already.
    #[error("the head has {max} live members already (node.max_nodes)")]
    Full {
        /// The limit.
        max: usize,
    },
    /// A live member holds the name at another URL (two nodes configured with one name, or a
    /// frozen node back after its replacement joined): taking it would make the two replace
    /// each other at every heartbeat.
    #[error(
        "a live node named `{name}` is a member at {url}; a node may take the name once that one leaves, is lost (node.lost_after_s) or is found unreachable"
    )]
    NameTaken {
        /// The name.
        name: String,
        /// The URL of the member holding it.
        url: String,
    },
    /// A head does not join a head.
    #[error("a `head` cannot join a head; only engine and env nodes join")]
    HeadRole,
    /// The URL is not exactly `http://host:port`.
    #[error("the node's url `{0}` is not exactly http://host:port (no path, query or credentials)")]
    BadUrl(String),
    /// The name is not 1 to 63 characters of `[A-Za-z0-9._-]`.
    #[error("the node name `{0}` is not 1 to 63 characters of [A-Za-z0-9._-]")]
    BadName(String),
    /// The advertised tasks are too many, or one is not a task name.
    #[error(
        "the node's tasks: expected at most {MAX_ADVERTISED_TASKS} names of 1 to 63 characters of [A-Za-z0-9._-], got {0}"
    )]
    BadTasks(String),
}

/// Whether `name` is 1 to 63 characters of `[A-Za-z0-9._-]`.
pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A join request (`POST /v1/nodes`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinRequest {
    /// The node's name (unique in the run).
    pub name: String,
    /// `engine` or `env`.
    pub role: NodeRole,
    /// Where the head reaches it.
    pub url: String,
    /// The tasks an env node serves (`GET /v1/tasks` of its env server); the head sends it
    /// episodes of these only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<String>,
}

/// What the head answers a join with.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinReply {
    /// The name joined.
    pub name: String,
    /// This membership's incarnation (heartbeats and the leave carry it).
    pub incarnation: u64,
    /// How often to heartbeat, seconds.
    pub heartbeat_s: f64,
}

/// A heartbeat (`POST /v1/nodes/<name>/heartbeat`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// The incarnation the node joined as.
    pub incarnation: u64,
    /// The policy version an engine node has loaded.
    #[serde(default)]
    pub weight_version: Option<u64>,
    /// Requests (engine) or envs (env) in progress.
    #[serde(default)]
    pub load: Option<u64>,
}

/// Health of a member as the head sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberHealth {
    /// Heartbeating.
    Live,
    /// Silent for longer than `node.lost_after_s`.
    Lost,
    /// Heartbeating, but the head's calls to it get no answer (an engine node: its process
    /// died, or the head cannot reach the URL it advertised): no replica runs on it until a
    /// probe of its URL answers or it joins again.
    Unreachable,
}

/// One member as `/v1/nodes` and `/v1/status` list it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    /// Its name.
    pub name: String,
    /// `engine` or `env`.
    pub role: NodeRole,
    /// Where the head reaches it.
    pub url: String,
    /// Live, lost or unreachable.
    pub health: MemberHealth,
    /// Its incarnation (joins under this name so far).
    pub incarnation: u64,
    /// Seconds since its last heartbeat.
    pub last_seen_seconds: f64,
    /// The policy version it reported loaded (engine nodes).
    pub weight_version: Option<u64>,
    /// Requests or envs in progress it reported.
    pub load: Option<u64>,
    /// The engine replica running on it, when one does.
    pub replica: Option<u32>,
    /// The tasks it serves (env nodes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<String>,
    /// The head's episodes open on it now (env nodes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envs_open: Option<u64>,
    /// While it is unreachable: why, and how often under this incarnation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreachable: Option<UnreachableView>,
}

/// Why a member is unreachable, as listed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnreachableView {
    /// The failed call that marked it.
    pub reason: String,
    /// Times it was marked unreachable under this incarnation.
    pub times: u32,
    /// Seconds until the head probes its URL again.
    pub next_probe_seconds: f64,
}
