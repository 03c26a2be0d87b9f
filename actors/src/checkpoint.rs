//! Node checkpoints on disk: what a restarted run resumes from, beside the replay store.
//!
//! Layout of `<output_dir>/checkpoint/`:
//! - `manifest.json`: [`Manifest`] (version, step, replay counters at the time, sampler state,
//!   runtime knobs);
//! - `trainer/`: whatever the [`sluice_core::TrainerBackend`] writes (the native trainer: HF
//!   model, optimizer, trainer state; the simulated one: its version).
//!
//! Writes are atomic at the directory level: everything goes into `checkpoint.partial/`, which is
//! renamed into place (the previous checkpoint moved to `checkpoint.old/` first and removed after).
//! A crash at any point leaves either the old or the new checkpoint readable; [`CheckpointDir::load`]
//! falls back to `checkpoint.old/` when the rename was cut in between.
//!
//! The manifest lists every other file of the checkpoint with its size and CRC-32
//! ([`Manifest::files`]), summed as the write is committed and checked by
//! [`CheckpointDir::load`]: a file that changed since (a disk error, a cut copy, an edit) is
//! refused by name rather than resumed from (safetensors carry no checksum of their own, and a
//! flipped bit in a weight or a moment stays a plausible number).
//!
//! The replay store is not copied: it is durable by itself (every acknowledged group is committed),
//! and consumed groups are final there, so "trained once" holds across any restart. The manifest
//! records its counters for the operator and the tests.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod sums;

use sums::check_sums;
pub use sums::{FileSum, file_sums};

/// Version of the manifest layout.
pub const FORMAT: u32 = 1;
/// The manifest file.
pub const MANIFEST: &str = "manifest.json";
/// The trainer backend's subdirectory.
pub const TRAINER_DIR: &str = "trainer";

/// What a checkpoint holds besides the trainer's own files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Layout version ([`FORMAT`]).
    pub format: u32,
    /// Policy version of the trainer's weights.
    pub version: u64,
    /// Training steps taken since the start of the run (across restarts).
    pub steps: u64,
    /// Groups trained since the start of the run.
    pub trained_groups: u64,
    /// Replay counters at checkpoint time.
    pub replay: ReplayMark,
    /// The sampler's resumable state, when the sampler exposes it.
    pub sampler: Option<serde_json::Value>,
    /// The runtime knobs and the config's values they were set against, restored on resume
    /// by the rule of [`sluice_core::knobs::resume_knobs`]. Absent in checkpoints written
    /// before it (a resume then starts from the config's knobs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub knobs: Option<sluice_core::KnobState>,
    /// Why it was written: `stop`, `periodic`, `request`, `done`, `trainer_error`.
    pub reason: String,
    /// Wall-clock time of the write, seconds since the Unix epoch (for operators).
    pub written_unix_seconds: f64,
    /// Every other file of the checkpoint, by its `/`-separated path under the checkpoint
    /// directory, as written: filled in by [`CheckpointDir::commit`], checked by
    /// [`CheckpointDir::load`]. Empty in checkpoints written before the sums (nothing checked).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, FileSum>,
}

/// Replay counters recorded in a manifest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayMark {
    /// Groups ever admitted.
    pub admitted_total: u64,
    /// Groups handed to the trainer.
    pub consumed_total: u64,
    /// Newest version the store had seen published.
    pub policy_version: u64,
}

/// A checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// File system trouble.
    #[error("checkpoint {path}: {message}")]
    Io {
        /// The path involved.
        path: String,
        /// What failed.
        message: String,
    },
    /// The manifest did not decode or has another layout.
    #[error("checkpoint {path}: corrupt manifest: {message}")]
    Corrupt {
        /// The manifest.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A checkpoint file is missing or differs from what was written (its size and CRC-32 in
    /// the manifest).
    #[error("checkpoint {path}: {message}")]
    Changed {
        /// The file.
        path: String,
        /// What it holds now, what was written, and what to do.
        message: String,
    },
    /// A checkpoint file is missing beside the others.
    #[error("checkpoint {path}: {message}")]
    Incomplete {
        /// The missing file.
        path: String,
        /// What is there instead, and what to do.
        message: String,
    },
    /// The trainer backend refused to save or restore.
    #[error("checkpoint trainer state: {0}")]
    Trainer(#[from] sluice_core::BackendError),
    /// An actor needed for the checkpoint is gone, or no checkpoint directory is configured.
    #[error("checkpoint: {0}")]
    Unavailable(String),
}

impl CheckpointError {
    /// The trainer refused to be checkpointed because a step panicked (its state is unknown and
    /// the last good checkpoint is kept on purpose): no failure to write.
    pub fn trainer_poisoned(&self) -> bool {
        matches!(self, Self::Trainer(e) if e.kind == TRAINER_POISONED)
    }

    /// Short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "checkpoint_io",
            Self::Corrupt { .. } => "checkpoint_corrupt",
            Self::Changed { .. } => "checkpoint_changed",
            Self::Incomplete { .. } => "checkpoint_incomplete",
            Self::Trainer(_) => "checkpoint_trainer",
            Self::Unavailable(_) => "checkpoint_unavailable",
        }
    }
}

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// The [`sluice_core::BackendError::kind`] of a trainer that refuses checkpoints after a step
/// panicked.
pub const TRAINER_POISONED: &str = "trainer_poisoned";

/// The checkpoint directory's name under `run.output_dir` (where `sluice run` keeps it).
pub const CHECKPOINT_DIR: &str = "checkpoint";

/// A checkpoint location (`<output_dir>/checkpoint`) and its staging siblings.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    root: PathBuf,
}

fn sibling(root: &Path, suffix: &str) -> PathBuf {
    let mut name = root
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(suffix);
    root.with_file_name(name)
}

/// Flushes a directory entry to disk (renames are durable only then).
fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

impl CheckpointDir {
    /// The checkpoint at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The committed checkpoint's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn staging(&self) -> PathBuf {
        sibling(&self.root, ".partial")
    }

    fn previous(&self) -> PathBuf {
        sibling(&self.root, ".old")
    }

    /// Starts a write: an empty staging directory (a leftover from a cut write is removed).
    /// Returns it; the trainer writes into `<staging>/trainer`.
    pub fn begin(&self) -> Result<PathBuf, CheckpointError> {
        let staging = self.staging();
        if staging.exists() {
            std::fs::remove_dir_all(&staging).map_err(|e| io(&staging, e))?;
        }
        std::fs::create_dir_all(&staging).map_err(|e| io(&staging, e))?;
        Ok(staging)
    }

    /// Finishes a write begun with [`Self::begin`]: sums the staged files into the manifest
    /// ([`Manifest::files`]), writes it, then swaps the staging directory into place. Returns
    /// the manifest as written.
    pub fn commit(&self, manifest: &Manifest) -> Result<Manifest, CheckpointError> {
        let staging = self.staging();
        let path = staging.join(MANIFEST);
        let manifest = Manifest {
            files: file_sums(&staging)?,
            ..manifest.clone()
        };
        let body = serde_json::to_vec_pretty(&manifest).map_err(|e| io(&path, e))?;
        let mut f = std::fs::File::create(&path).map_err(|e| io(&path, e))?;
        f.write_all(&body).map_err(|e| io(&path, e))?;
        f.sync_all().map_err(|e| io(&path, e))?;
        drop(f);
        sync_dir(&staging);
        let previous = self.previous();
        if previous.exists() {
            std::fs::remove_dir_all(&previous).map_err(|e| io(&previous, e))?;
        }
        if self.root.exists() {
            std::fs::rename(&self.root, &previous).map_err(|e| io(&self.root, e))?;
        }
        std::fs::rename(&staging, &self.root).map_err(|e| io(&staging, e))?;
        if let Some(parent) = self.root.parent() {
            sync_dir(parent);
        }
        if previous.exists() {
            std::fs::remove_dir_all(&previous).map_err(|e| io(&previous, e))?;
        }
        Ok(manifest)
    }

    /// The newest complete checkpoint: its directory and manifest, or `None` when there is none.
    /// A trainer checkpoint without its manifest is refused: the manifest goes into the staging
    /// directory before it is renamed into place, so no cut write leaves one (a leftover
    /// `checkpoint.partial/` is ignored), and starting from scratch beside it would silently
    /// throw its steps away.
    pub fn load(&self) -> Result<Option<(PathBuf, Manifest)>, CheckpointError> {
        for dir in [self.root.clone(), self.previous()] {
            let path = dir.join(MANIFEST);
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    let trainer = dir.join(TRAINER_DIR);
                    if trainer.exists() {
                        return Err(CheckpointError::Incomplete {
                            path: path.display().to_string(),
                            message: format!(
                                "missing, but the trainer checkpoint {} is there: without the \
                                 manifest the run cannot resume from it; put the manifest back, \
                                 or start over deliberately (a new `run.name` or \
                                 `run.output_dir`, or remove {})",
                                trainer.display(),
                                dir.display()
                            ),
                        });
                    }
                    continue;
                }
                Err(e) => return Err(io(&path, e)),
            };
            let manifest: Manifest =
                serde_json::from_str(&text).map_err(|e| CheckpointError::Corrupt {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })?;
            if manifest.format != FORMAT {
                return Err(CheckpointError::Corrupt {
                    path: path.display().to_string(),
                    message: format!(
                        "layout version {} (this build reads {FORMAT})",
                        manifest.format
                    ),
                });
            }
            check_counters(&manifest).map_err(|message| CheckpointError::Corrupt {
                path: path.display().to_string(),
                message,
            })?;
            check_sums(&dir, &manifest)?;
            return Ok(Some((dir, manifest)));
        }
        Ok(None)
    }
}

/// The manifest's counters as every run writes them: each step trains at least one group, every
/// trained group was consumed from the replay store first, and only admitted groups are
/// consumed (`steps ≤ trained_groups ≤ replay.consumed_total ≤ replay.admitted_total`). An
/// edited count (a step of 500 or `u64::MAX`) breaks the chain.
fn check_counters(m: &Manifest) -> Result<(), String> {
    let chain = [
        ("steps", m.steps),
        ("trained_groups", m.trained_groups),
        ("replay.consumed_total", m.replay.consumed_total),
        ("replay.admitted_total", m.replay.admitted_total),
    ];
    for pair in chain.windows(2) {
        let ((a, x), (b, y)) = (pair[0], pair[1]);
        if x > y {
            return Err(format!(
                "`{a}` = {x} is more than `{b}` = {y}: no run writes that (each step trains at \
                 least one group, each trained group was consumed, each consumed group admitted)"
            ));
        }
    }
    Ok(())
}

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests;
