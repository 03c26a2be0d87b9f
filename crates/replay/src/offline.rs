//! Clearing the replay store of a stopped run, from its directory: the offline face of the admin
//! API's `POST /v1/replay/clear`, for `sluice replay clear --store DIR`.

use std::path::Path;

use crate::bucket::Bucket;
use crate::error::ReplayError;
use crate::persist::{DB_FILE, Persister};
use crate::store::{ClearOutcome, ReplayStore};

/// Opens the store in `dir` (refused when it does not exist, or while a running node holds it),
/// recovers it as a restarted run would — groups pending or in flight when the run stopped are
/// aborted and resumable — and clears `buckets`, durably.
pub fn clear_stopped_store(dir: &Path, buckets: &[Bucket]) -> Result<ClearOutcome, ReplayError> {
    let path = dir.join(DB_FILE);
    if !path.is_file() {
        return Err(ReplayError::Database {
            path: path.display().to_string(),
            message: "no replay store here (a run's store is replay.path, by default <run.output_dir>/replay)".into(),
        });
    }
    let (persister, recovered) = Persister::open(dir).map_err(|e| match e {
        ReplayError::Database { path, message } => ReplayError::Database {
            path,
            message: format!(
                "{message} (if a running node holds this store, clear through its admin API: `sluice replay clear --url …`)"
            ),
        },
        other => other,
    })?;
    // The expiry policy does not matter here: under `drop` no expired group is stored.
    let mut store = ReplayStore::recover(false, false, recovered.counters, recovered.groups);
    let outcome = store.clear(buckets)?;
    persister.apply(&store.drain_outbox())?;
    Ok(outcome)
}
