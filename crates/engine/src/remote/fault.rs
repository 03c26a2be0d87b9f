//! [`Fault`]: why a call to a remote engine server took it down, and whether the server could
//! be reached at all (membership moves an unreachable node's slot; docs/cluster.md).

/// Why a call took the server down.
#[derive(Debug, Clone)]
pub(super) struct Fault {
    /// What failed, for the log and the replica's last error.
    pub(super) message: String,
    /// No answer came back (connection refused or reset, no answer within the deadline): the
    /// server could not be reached, as opposed to a server that answered with an error.
    pub(super) unreachable: bool,
}

impl Fault {
    /// A call that got no answer.
    pub(super) fn unreachable(e: &sluice_http::HttpError) -> Self {
        Self {
            message: e.to_string(),
            unreachable: true,
        }
    }

    /// A server that answered with an error, or a failure on this side (writing weights).
    pub(super) fn failed(message: String) -> Self {
        Self {
            message,
            unreachable: false,
        }
    }

    /// The same fault, its message prefixed with what was being done.
    pub(super) fn during(self, what: &str) -> Self {
        Self {
            message: format!("{what}: {}", self.message),
            ..self
        }
    }
}
