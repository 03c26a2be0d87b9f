//! Node checkpoints on disk: what a restarted run resumes from, beside the replay store.
//!
//! Layout of `<output_dir>/checkpoint/`:
//! - `manifest.json`: [`Manifest`] (version, step, replay counters at the time, sampler state);
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
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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

/// A checkpoint file's size and CRC-32, as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    /// Its length, bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of its bytes.
    pub crc32: u32,
}

impl FileSum {
    /// Reads `path` whole and sums it.
    pub fn of(path: &Path) -> std::io::Result<Self> {
        let mut file = std::fs::File::open(path)?;
        let mut hasher = crc32fast::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            bytes += n as u64;
        }
        Ok(Self {
            bytes,
            crc32: hasher.finalize(),
        })
    }
}

/// The sums of every file under `dir` but its manifest, by `/`-separated relative path.
pub fn file_sums(dir: &Path) -> Result<BTreeMap<String, FileSum>, CheckpointError> {
    let mut sums = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(at) = pending.pop() {
        let entries = std::fs::read_dir(&at).map_err(|e| io(&at, e))?;
        for entry in entries {
            let path = entry.map_err(|e| io(&at, e))?.path();
            let kind = std::fs::symlink_metadata(&path).map_err(|e| io(&path, e))?;
            if kind.is_dir() {
                pending.push(path);
                continue;
            }
            let relative = path.strip_prefix(dir).unwrap_or(&path);
            let name = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            if name == MANIFEST {
                continue;
            }
            let sum = FileSum::of(&path).map_err(|e| io(&path, e))?;
            sums.insert(name, sum);
        }
    }
    Ok(sums)
}

/// Refuses the first file of `manifest.files` under `dir` that is missing or differs.
fn check_sums(dir: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
    for (name, want) in &manifest.files {
        let path = dir.join(name);
        let changed = |found: String| CheckpointError::Changed {
            path: path.display().to_string(),
            message: format!(
                "{found}, where the manifest recorded {} bytes with CRC-32 {:08x}: the file \
                 changed since the checkpoint was written (a disk error, a cut copy, an edit); \
                 put the written file back, or start over deliberately (a new `run.name` or \
                 `run.output_dir`, or remove {})",
                want.bytes,
                want.crc32,
                dir.display()
            ),
        };
        match FileSum::of(&path) {
            Ok(found) if found == *want => {}
            Ok(found) => {
                return Err(changed(format!(
                    "{} bytes with CRC-32 {:08x}",
                    found.bytes, found.crc32
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(changed("missing".into()));
            }
            Err(e) => return Err(io(&path, e)),
        }
    }
    Ok(())
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
mod tests {
    use super::*;

    fn manifest(version: u64) -> Manifest {
        Manifest {
            format: FORMAT,
            version,
            steps: version,
            trained_groups: 4 * version,
            replay: ReplayMark {
                admitted_total: 5 * version,
                consumed_total: 4 * version,
                policy_version: version,
            },
            sampler: None,
            reason: "request".into(),
            written_unix_seconds: unix_now(),
            files: BTreeMap::new(),
        }
    }

    #[test]
    fn a_commit_replaces_the_previous_checkpoint_atomically() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
        assert!(dir.load().unwrap().is_none());
        let staging = dir.begin().unwrap();
        std::fs::create_dir_all(staging.join(TRAINER_DIR)).unwrap();
        std::fs::write(staging.join(TRAINER_DIR).join("w"), "1").unwrap();
        dir.commit(&manifest(1)).unwrap();
        let (root, m) = dir.load().unwrap().unwrap();
        assert_eq!(m.version, 1);
        assert_eq!(
            std::fs::read_to_string(root.join(TRAINER_DIR).join("w")).unwrap(),
            "1"
        );

        // A cut write (staging left behind) does not disturb the committed checkpoint.
        let staging = dir.begin().unwrap();
        std::fs::write(staging.join("junk"), "x").unwrap();
        assert_eq!(dir.load().unwrap().unwrap().1.version, 1);
        dir.begin().unwrap();
        dir.commit(&manifest(2)).unwrap();
        let (root, m) = dir.load().unwrap().unwrap();
        assert_eq!(m.version, 2);
        assert!(!root.join(TRAINER_DIR).exists(), "the old files are gone");
        assert!(!tmp.path().join("checkpoint.old").exists());
        assert!(!tmp.path().join("checkpoint.partial").exists());
    }

    /// Each file is summed as the write commits; one that changed after (a flipped byte, a
    /// cut copy, a removal) is refused by name, and a manifest without sums (an older
    /// checkpoint) loads unchecked.
    #[test]
    fn a_file_changed_since_the_write_is_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
        let staging = dir.begin().unwrap();
        std::fs::create_dir_all(staging.join("trainer/model")).unwrap();
        std::fs::write(staging.join("trainer/model/w.safetensors"), [7u8; 3000]).unwrap();
        std::fs::write(staging.join("trainer/state.json"), "{}").unwrap();
        let written = dir.commit(&manifest(1)).unwrap();
        assert_eq!(
            written.files.keys().collect::<Vec<_>>(),
            ["trainer/model/w.safetensors", "trainer/state.json"]
        );
        assert_eq!(written.files["trainer/model/w.safetensors"].bytes, 3000);
        let (root, m) = dir.load().unwrap().unwrap();
        // (Not the whole manifest: its f64 time need not survive JSON to the last bit.)
        assert_eq!(m.files, written.files);

        let weights = root.join("trainer/model/w.safetensors");
        let mut bytes = std::fs::read(&weights).unwrap();
        bytes[1500] ^= 0x10;
        std::fs::write(&weights, &bytes).unwrap();
        let err = dir.load().unwrap_err();
        assert_eq!(err.kind(), "checkpoint_changed");
        let text = err.to_string();
        assert!(
            text.contains("w.safetensors: 3000 bytes with CRC-32")
                && text.contains("where the manifest recorded 3000 bytes"),
            "{text}"
        );
        bytes[1500] ^= 0x10;
        std::fs::write(&weights, &bytes[..2000]).unwrap();
        let text = dir.load().unwrap_err().to_string();
        assert!(text.contains("2000 bytes with CRC-32"), "{text}");
        std::fs::remove_file(&weights).unwrap();
        let text = dir.load().unwrap_err().to_string();
        assert!(text.contains("w.safetensors: missing"), "{text}");

        // A manifest from before the sums: nothing to check.
        let mut old: serde_json::Value =
            serde_json::from_slice(&std::fs::read(root.join(MANIFEST)).unwrap()).unwrap();
        old.as_object_mut().unwrap().remove("files");
        std::fs::write(root.join(MANIFEST), old.to_string()).unwrap();
        assert!(dir.load().unwrap().is_some());
    }

    #[test]
    fn a_rename_cut_in_between_falls_back_to_the_previous_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
        dir.begin().unwrap();
        dir.commit(&manifest(3)).unwrap();
        // As if the process died after moving the old one aside.
        std::fs::rename(
            tmp.path().join("checkpoint"),
            tmp.path().join("checkpoint.old"),
        )
        .unwrap();
        assert_eq!(dir.load().unwrap().unwrap().1.version, 3);
    }

    #[test]
    fn a_corrupt_manifest_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("checkpoint");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join(MANIFEST), "{").unwrap();
        let err = CheckpointDir::new(&root).load().unwrap_err();
        assert_eq!(err.kind(), "checkpoint_corrupt");
        assert!(err.to_string().contains("manifest.json"), "{err}");
    }

    #[test]
    fn a_trainer_checkpoint_without_its_manifest_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
        dir.begin().unwrap();
        dir.commit(&manifest(2)).unwrap();
        std::fs::create_dir_all(dir.root().join(TRAINER_DIR)).unwrap();
        std::fs::remove_file(dir.root().join(MANIFEST)).unwrap();
        let err = dir.load().unwrap_err();
        assert_eq!(err.kind(), "checkpoint_incomplete");
        let text = err.to_string();
        for expected in [
            "checkpoint/manifest.json: missing",
            "checkpoint/trainer",
            "remove",
        ] {
            assert!(text.contains(expected), "`{expected}` in {text}");
        }
        // A leftover staging directory beside nothing is no checkpoint at all.
        std::fs::remove_dir_all(dir.root()).unwrap();
        let staging = dir.begin().unwrap();
        std::fs::create_dir_all(staging.join(TRAINER_DIR)).unwrap();
        assert!(dir.load().unwrap().is_none());
    }

    #[test]
    fn manifest_counters_no_run_writes_are_refused_naming_the_keys() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
        type Edit = fn(&mut Manifest);
        let cases: [(Edit, &str); 3] = [
            (
                |m| m.steps = 500,
                "`steps` = 500 is more than `trained_groups` = 40",
            ),
            (
                |m| m.trained_groups = u64::MAX,
                "`trained_groups` = 18446744073709551615 is more than `replay.consumed_total` = 40",
            ),
            (
                |m| m.replay.admitted_total = 3,
                "`replay.consumed_total` = 40 is more than `replay.admitted_total` = 3",
            ),
        ];
        for (edit, expected) in cases {
            let mut m = manifest(10);
            dir.begin().unwrap();
            dir.commit(&m).unwrap();
            assert_eq!(dir.load().unwrap().unwrap().1.steps, m.steps);
            edit(&mut m);
            dir.begin().unwrap();
            dir.commit(&m).unwrap();
            let err = dir.load().unwrap_err();
            assert_eq!(err.kind(), "checkpoint_corrupt");
            let text = err.to_string();
            assert!(
                text.contains("manifest.json") && text.contains(expected),
                "{text}"
            );
        }
    }
}
