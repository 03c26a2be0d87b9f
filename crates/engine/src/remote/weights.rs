//! [`WeightDirs`]: the published weights the remote backend hands its servers, one Hugging Face
//! directory per version under the weights directory (`v000042`).
//!
//! A version is written once per process, into a temporary directory renamed into place, so a
//! server never reads a half-written checkpoint. Every replica of a node shares one `WeightDirs`,
//! so two replicas never write the same directory. After each write only the newest `keep`
//! versions stay on disk; a version a server is still loading is *pinned* ([`Pinned`]) and
//! survives until the next prune after its load ends. Directories left by an earlier process of
//! the same run count like ours: older ones are pruned, and ones newer than what this process
//! publishes (a longer earlier run) are stale and go too.
//!
//! Served over HTTP ([`WeightDirs::served_at`], a head whose engine nodes share no disk with
//! it): each version's `model.safetensors` also gets a CRC-32 when written, and servers are
//! told to fetch `<url>/v1/weights/<version>` and check it instead of reading the directory.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use sluice_core::PolicyVersion;
use sluice_model::ModelWeights;

/// The weights directory of a run (see the module docs).
#[derive(Debug)]
pub struct WeightDirs {
    root: PathBuf,
    aux_files_from: Option<PathBuf>,
    keep: usize,
    /// The base URL servers fetch versions from (`None`: they read the directory).
    served_at: Option<String>,
    /// One writer at a time (held only on blocking threads, for a whole write and prune).
    write: Mutex<()>,
    /// Quick bookkeeping (held for a few map operations, also from async code).
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Versions this process wrote completely.
    written: BTreeSet<u64>,
    /// Loads in progress per version.
    pins: BTreeMap<u64, usize>,
    /// CRC-32 of each written version's `model.safetensors` (when served over HTTP).
    checksums: BTreeMap<u64, u32>,
}

/// A version directory a server is loading: not pruned while this lives.
#[derive(Debug)]
pub struct Pinned {
    dirs: Arc<WeightDirs>,
    version: u64,
    path: PathBuf,
}

impl Pinned {
    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its version.
    pub fn version(&self) -> PolicyVersion {
        PolicyVersion(self.version)
    }

    /// Where a server fetches it and the CRC-32 to check, when the weights are served over
    /// HTTP ([`WeightDirs::served_at`]).
    pub fn fetch(&self) -> Option<(String, u32)> {
        let url = self.dirs.served_at.as_ref()?;
        let crc = *lock(&self.dirs.state).checksums.get(&self.version)?;
        Some((format!("{url}/v1/weights/{}", self.version), crc))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut state = lock(&self.dirs.state);
        if let Some(n) = state.pins.get_mut(&self.version) {
            *n -= 1;
            if *n == 0 {
                state.pins.remove(&self.version);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the data consistent: a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The version a directory name stands for (`v000042` → 42).
fn version_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix('v')?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

impl WeightDirs {
    /// Versions under `root`, keeping the newest `keep` (at least 1); the tokenizer and config
    /// files of `aux_files_from` are copied next to each (servers such as SGLang load the whole
    /// directory).
    pub fn new(root: PathBuf, aux_files_from: Option<PathBuf>, keep: usize) -> Arc<Self> {
        Arc::new(Self {
            root,
            aux_files_from,
            keep: keep.max(1),
            served_at: None,
            write: Mutex::new(()),
            state: Mutex::new(State::default()),
        })
    }

    /// Versions under `root`, keeping the newest `keep`, served at `url` (`GET
    /// <url>/v1/weights/<version>`, see [`Self::file`]): servers fetch them over HTTP.
    pub fn served_at(root: PathBuf, keep: usize, url: String) -> Arc<Self> {
        Arc::new(Self {
            root,
            aux_files_from: None,
            keep: keep.max(1),
            served_at: Some(url.trim_end_matches('/').to_owned()),
            write: Mutex::new(()),
            state: Mutex::new(State::default()),
        })
    }

    /// The `model.safetensors` of `version` with its CRC-32, when this process wrote it and it
    /// is still kept (what `GET /v1/weights/<version>` streams).
    pub fn file(&self, version: PolicyVersion) -> Option<(PathBuf, u32)> {
        let crc = *lock(&self.state).checksums.get(&version.0)?;
        let path = self
            .path(version)
            .join(sluice_model::checkpoint::SINGLE_FILE);
        path.is_file().then_some((path, crc))
    }

    /// Versions this process wrote that are still kept, oldest first.
    pub fn written(&self) -> Vec<u64> {
        lock(&self.state).written.iter().copied().collect()
    }

    /// The directory of `version`.
    pub fn path(&self, version: PolicyVersion) -> PathBuf {
        self.root.join(format!("v{:06}", version.0))
    }

    /// Versions on disk now, oldest first.
    pub fn on_disk(&self) -> Vec<u64> {
        let mut versions: Vec<u64> = std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| version_of(&e.file_name().to_string_lossy()))
            .collect();
        versions.sort_unstable();
        versions
    }

    fn pin(self: &Arc<Self>, state: &mut State, version: u64) -> Pinned {
        *state.pins.entry(version).or_default() += 1;
        Pinned {
            dirs: Arc::clone(self),
            version,
            path: self.path(PolicyVersion(version)),
        }
    }

    /// Makes sure `weights` are on disk (written now unless this process already wrote them
    /// and they are still there), pins them for a load, and prunes old versions. Blocking: call
    /// it from a blocking thread.
    pub fn publish(self: &Arc<Self>, weights: &ModelWeights) -> Result<Pinned, String> {
        let _one_writer = lock(&self.write);
        let version = weights.version.0;
        let path = self.path(weights.version);
        {
            let mut state = lock(&self.state);
            if state.written.contains(&version) && path.join("config.json").is_file() {
                return Ok(self.pin(&mut state, version));
            }
        }
        self.write(weights, &path)?;
        let crc = match self.served_at {
            Some(_) => Some(checksum(&path.join(sluice_model::checkpoint::SINGLE_FILE))?),
            None => None,
        };
        let pinned = {
            let mut state = lock(&self.state);
            state.written.insert(version);
            if let Some(crc) = crc {
                state.checksums.insert(version, crc);
            }
            self.pin(&mut state, version)
        };
        self.prune();
        Ok(pinned)
    }

    /// Writes `weights` into a temporary directory and renames it to `path`.
    fn write(&self, weights: &ModelWeights, path: &Path) -> Result<(), String> {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = self.root.join(format!(".{name}.tmp"));
        let io = |what: &str, p: &Path, e: std::io::Error| format!("{what} {}: {e}", p.display());
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| io("removing", &tmp, e))?;
        }
        sluice_model::save_checkpoint(weights, &tmp, &sluice_model::SaveOptions::default())
            .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        if let Some(src) = &self.aux_files_from {
            sluice_model::copy_aux_files(src, &tmp)
                .map_err(|e| format!("copying model files into {}: {e}", tmp.display()))?;
        }
        if path.exists() {
            // Left by an earlier process (this one would have returned it above): replaced.
            std::fs::remove_dir_all(path).map_err(|e| io("removing", path, e))?;
        }
        std::fs::rename(&tmp, path).map_err(|e| io("renaming into", path, e))
    }

    /// Deletes every version directory but the newest `keep` up to the newest this process
    /// wrote, sparing pinned ones, and any temporary directory left by a crash.
    fn prune(&self) {
        let (newest, pins): (u64, BTreeSet<u64>) = {
            let state = lock(&self.state);
            let Some(&newest) = state.written.last() else {
                return;
            };
            (newest, state.pins.keys().copied().collect())
        };
        let on_disk = self.on_disk();
        let kept: BTreeSet<u64> = on_disk
            .iter()
            .rev()
            .filter(|&&v| v <= newest)
            .take(self.keep)
            .copied()
            .collect();
        for v in on_disk {
            if kept.contains(&v) || pins.contains(&v) {
                continue;
            }
            let path = self.path(PolicyVersion(v));
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!(path = %path.display(), error = %e, "could not prune old weights");
            }
            let mut state = lock(&self.state);
            state.written.remove(&v);
            state.checksums.remove(&v);
        }
        let leftovers = std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten();
        for e in leftovers {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(".v") && name.ends_with(".tmp") {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// CRC-32 of a file, read in 1 MiB chunks (blocking).
pub fn checksum(path: &Path) -> Result<u32, String> {
    use std::io::Read;
    let mut file =
        std::fs::File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        if n == 0 {
            return Ok(hasher.finalize());
        }
        hasher.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_model::candle::{DType, Device};
    use sluice_model::presets::{Preset, preset_config, random_snapshot};

    fn weights(version: u64) -> ModelWeights {
        let config = Arc::new(preset_config(Preset::Tiny));
        random_snapshot(config, version, DType::F32, &Device::Cpu)
            .unwrap()
            .with_version(PolicyVersion(version))
    }

    #[test]
    fn names_parse() {
        assert_eq!(version_of("v000042"), Some(42));
        assert_eq!(version_of("v"), None);
        assert_eq!(version_of("v12a"), None);
        assert_eq!(version_of(".v000001.tmp"), None);
    }

    #[test]
    fn keeps_the_newest_and_spares_a_version_being_loaded() {
        let dir = tempfile::tempdir().unwrap();
        // Left by an earlier, longer run: stale.
        std::fs::create_dir_all(dir.path().join("v000009")).unwrap();
        std::fs::create_dir_all(dir.path().join(".v000003.tmp")).unwrap();
        let dirs = WeightDirs::new(dir.path().into(), None, 2);
        let loading = dirs.publish(&weights(1)).unwrap();
        assert!(loading.path().join("config.json").is_file());
        drop(dirs.publish(&weights(2)).unwrap());
        drop(dirs.publish(&weights(3)).unwrap());
        // v1 is still being loaded: kept beyond the two newest.
        assert_eq!(dirs.on_disk(), vec![1, 2, 3]);
        drop(loading);
        drop(dirs.publish(&weights(4)).unwrap());
        assert_eq!(dirs.on_disk(), vec![3, 4]);
        assert!(!dir.path().join(".v000003.tmp").exists());
        // Asked again for a version it still has, it writes nothing.
        let again = dirs.publish(&weights(4)).unwrap();
        assert_eq!(again.version(), PolicyVersion(4));
    }
}
