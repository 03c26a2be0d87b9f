//! Each checkpoint file's size and CRC-32: summed as a write commits, checked as a checkpoint
//! loads ([`super::Manifest::files`]).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{CheckpointError, MANIFEST, Manifest, io};

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
pub(super) fn check_sums(dir: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
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
