//! Crash-safe persistence of the replay store in redb (`<dir>/replay.redb`).
//!
//! Two tables: `groups` (group id → JSON `{bucket, group}`) holds every group whose tokens must
//! survive a crash (pending, in flight, completed, aborted, expired-awaiting-regeneration), and
//! `meta` holds the [`Counters`]. [`Persister::apply`] writes a batch of ops in one durable
//! transaction: consuming a group and bumping `consumed_total` commit together, so a restarted run
//! never trains a group twice.

use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use sluice_core::{GroupId, RolloutGroup};

use crate::bucket::Bucket;
use crate::error::ReplayError;
use crate::store::Counters;

const GROUPS: TableDefinition<&str, &[u8]> = TableDefinition::new("groups");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const COUNTERS_KEY: &str = "counters";

/// The database file inside a store's directory.
pub const DB_FILE: &str = "replay.redb";

/// One change to the database, produced by the store's outbox.
#[derive(Debug, Clone)]
pub enum PersistOp {
    /// Insert or replace a group record (already serialized).
    Put {
        /// The group.
        id: GroupId,
        /// The JSON record.
        record: Vec<u8>,
    },
    /// Remove a group record (it became final).
    Delete(GroupId),
    /// Replace the counters.
    Counters(Counters),
}

#[derive(Serialize, Deserialize)]
struct Record<G> {
    bucket: Bucket,
    group: G,
}

impl PersistOp {
    /// A put of `group` in `bucket`.
    pub fn put(bucket: Bucket, group: &RolloutGroup) -> Self {
        let record = serde_json::to_vec(&Record { bucket, group })
            .expect("rollout groups serialize: all keys are strings");
        Self::Put {
            id: group.id,
            record,
        }
    }
}

/// What a database held when it was opened.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The counters (default for a new database).
    pub counters: Counters,
    /// Every persisted group with its bucket, oldest first.
    pub groups: Vec<(Bucket, RolloutGroup)>,
}

/// The open database.
pub struct Persister {
    db: Database,
    path: PathBuf,
}

impl Persister {
    /// Opens (or creates) `<dir>/replay.redb` and reads back what it holds.
    pub fn open(dir: &Path) -> Result<(Self, Recovered), ReplayError> {
        let path = dir.join(DB_FILE);
        let shown = path.display().to_string();
        let db_err = |e: &dyn std::fmt::Display| ReplayError::Database {
            path: shown.clone(),
            message: e.to_string(),
        };
        std::fs::create_dir_all(dir).map_err(|e| db_err(&e))?;
        let db = Database::create(&path).map_err(|e| db_err(&e))?;
        // Create the tables so that reads of a fresh database succeed.
        let txn = db.begin_write().map_err(|e| db_err(&e))?;
        txn.open_table(GROUPS).map_err(|e| db_err(&e))?;
        txn.open_table(META).map_err(|e| db_err(&e))?;
        txn.commit().map_err(|e| db_err(&e))?;

        let mut recovered = Recovered::default();
        let read = db.begin_read().map_err(|e| db_err(&e))?;
        let meta = read.open_table(META).map_err(|e| db_err(&e))?;
        if let Some(bytes) = meta.get(COUNTERS_KEY).map_err(|e| db_err(&e))? {
            recovered.counters =
                serde_json::from_slice(bytes.value()).map_err(|e| ReplayError::Corrupt {
                    path: shown.clone(),
                    key: COUNTERS_KEY.into(),
                    message: e.to_string(),
                })?;
        }
        let groups = read.open_table(GROUPS).map_err(|e| db_err(&e))?;
        for item in groups.iter().map_err(|e| db_err(&e))? {
            let (key, value) = item.map_err(|e| db_err(&e))?;
            let record: Record<RolloutGroup> =
                serde_json::from_slice(value.value()).map_err(|e| ReplayError::Corrupt {
                    path: shown.clone(),
                    key: key.value().to_owned(),
                    message: e.to_string(),
                })?;
            recovered.groups.push((record.bucket, record.group));
        }
        recovered.groups.sort_by_key(|(_, g)| g.id);
        drop(groups);
        drop(meta);
        drop(read);
        Ok((Self { db, path }, recovered))
    }

    /// Writes `ops` in one durable transaction.
    pub fn apply(&self, ops: &[PersistOp]) -> Result<(), ReplayError> {
        if ops.is_empty() {
            return Ok(());
        }
        let shown = self.path.display().to_string();
        let db_err = |e: &dyn std::fmt::Display| ReplayError::Database {
            path: shown.clone(),
            message: e.to_string(),
        };
        let txn = self.db.begin_write().map_err(|e| db_err(&e))?;
        {
            let mut groups = txn.open_table(GROUPS).map_err(|e| db_err(&e))?;
            let mut meta = txn.open_table(META).map_err(|e| db_err(&e))?;
            // Only the last counters op of a batch matters.
            let last_counters = ops
                .iter()
                .rposition(|op| matches!(op, PersistOp::Counters(_)));
            for (i, op) in ops.iter().enumerate() {
                match op {
                    PersistOp::Put { id, record } => {
                        groups
                            .insert(id.to_string().as_str(), record.as_slice())
                            .map_err(|e| db_err(&e))?;
                    }
                    PersistOp::Delete(id) => {
                        groups
                            .remove(id.to_string().as_str())
                            .map_err(|e| db_err(&e))?;
                    }
                    PersistOp::Counters(c) if Some(i) == last_counters => {
                        let bytes = serde_json::to_vec(c).expect("counters serialize");
                        meta.insert(COUNTERS_KEY, bytes.as_slice())
                            .map_err(|e| db_err(&e))?;
                    }
                    PersistOp::Counters(_) => {}
                }
            }
        }
        txn.commit().map_err(|e| db_err(&e))
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
