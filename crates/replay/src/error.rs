//! Errors of the replay store: an illegal transition, an unknown group, or the database.

use sluice_core::GroupId;

use crate::bucket::Bucket;

/// What the replay store refused or could not do.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The state machine does not allow this move.
    #[error("group {group}: illegal transition {from} → {to}")]
    IllegalTransition {
        /// The group.
        group: GroupId,
        /// Where it is.
        from: Bucket,
        /// Where it was asked to go.
        to: Bucket,
    },
    /// The group is not in the store.
    #[error("group {group}: not in the replay store")]
    UnknownGroup {
        /// The group.
        group: GroupId,
    },
    /// The group is already in the store (admitted twice).
    #[error("group {group}: already admitted")]
    Duplicate {
        /// The group.
        group: GroupId,
    },
    /// An operator asked to clear a bucket that is not at rest.
    #[error(
        "bucket `{bucket}` cannot be cleared: only completed, aborted and expired groups are at rest"
    )]
    NotClearable {
        /// The bucket asked for.
        bucket: Bucket,
    },
    /// The database failed.
    #[error("replay database {path}: {message}")]
    Database {
        /// The database file.
        path: String,
        /// What redb said.
        message: String,
    },
    /// A persisted record did not decode.
    #[error("replay database {path}: corrupt record `{key}`: {message}")]
    Corrupt {
        /// The database file.
        path: String,
        /// The record key.
        key: String,
        /// What went wrong.
        message: String,
    },
}

impl ReplayError {
    /// Short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::IllegalTransition { .. } => "replay_illegal_transition",
            Self::UnknownGroup { .. } => "replay_unknown_group",
            Self::Duplicate { .. } => "replay_duplicate_group",
            Self::NotClearable { .. } => "replay_not_clearable",
            Self::Database { .. } => "replay_database",
            Self::Corrupt { .. } => "replay_corrupt_record",
        }
    }
}
