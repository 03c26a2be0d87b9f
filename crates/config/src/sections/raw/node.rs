//! `[node]` as serde reads it: which part of a run this process is, across machines.

use serde::{Deserialize, Serialize};

/// `[node]`: absent for a single-machine run (the whole pipeline in one process).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawNode {
    /// `head`, `engine` or `env`.
    pub role: String,
    /// The head's admin API (`http://host:port`), which engine and env nodes join.
    pub head: Option<String>,
    /// Name of this node at the head (default `<role>-<host>-<port>` of `advertise`).
    pub name: Option<String>,
    /// Address an engine or env node serves on.
    pub listen: Option<String>,
    /// URL others reach this node at (default `http://` + the bound `listen` address; the
    /// head's: `http://` + `admin.listen`, where engine nodes fetch weights).
    pub advertise: Option<String>,
    /// Seconds between a member's heartbeats (the head's value is the one members use).
    pub heartbeat_s: f64,
    /// Seconds without a heartbeat after which the head counts a member as lost.
    pub lost_after_s: f64,
    /// Most members the head accepts at once (bounds the `node` metric label).
    pub max_nodes: i64,
}

impl Default for RawNode {
    fn default() -> Self {
        Self {
            role: String::new(),
            head: None,
            name: None,
            listen: None,
            advertise: None,
            heartbeat_s: 1.0,
            lost_after_s: 5.0,
            max_nodes: 64,
        }
    }
}
