//! `[node]`, validated: the role of this process in a run spread over machines (`docs/config.md`).

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::as_seconds;

/// What a node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeRole {
    /// Sampler, controller, replay store, trainer and admin API; engine and env nodes join it.
    Head,
    /// An inference server on the native engine that joins the head.
    Engine,
    /// An env server that joins the head.
    Env,
}

impl NodeRole {
    /// The name used in the config, the API and metric labels.
    pub fn as_str(self) -> &'static str {
        sluice_core::choice::Choice::name(self)
    }
}

sluice_core::impl_choice!(NodeRole);

/// `[node]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeConfig {
    /// The role.
    pub role: NodeRole,
    /// The head's admin API (engine and env nodes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<String>,
    /// Name at the head (engine and env nodes; default from `advertise`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Where an engine or env node serves (`None` on the head, which serves on `admin.listen`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// URL the head reaches this node at (default: `http://` + the bound address).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// Heartbeat period (the head's is sent to members when they join).
    #[serde(rename = "heartbeat_s", serialize_with = "as_seconds")]
    pub heartbeat: Duration,
    /// A member silent this long is lost (the head's).
    #[serde(rename = "lost_after_s", serialize_with = "as_seconds")]
    pub lost_after: Duration,
    /// Most members at once (the head's).
    pub max_nodes: NonZeroU32,
}
