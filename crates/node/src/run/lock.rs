//! One run per output directory: [`RunLock`] holds an exclusive lock on
//! `<run.output_dir>/sluice.lock` from the start of [`super::prepare`] until the run's process
//! lets go of it (at exit, whatever the exit: the kernel drops a dead process's locks). A second
//! `sluice run` on the same directory (a job submitted twice, a resume started while the run
//! still runs) stops at once, naming the process that holds it, where it used to warm up in full
//! beside the first and then fail on a rename or write into the first one's checkpoints.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The lock file's name in the run's output directory.
pub const LOCK_FILE: &str = "sluice.lock";

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds it.
    #[error(
        "{}: another `sluice run` ({holder}) is using this run directory; stop it first, or give this run its own `run.output_dir`",
        path.display()
    )]
    InUse {
        /// The lock file.
        path: PathBuf,
        /// The holder as its lock file names it (`pid 1234`), or `a process` when unreadable.
        holder: String,
    },
    /// The lock file could not be opened or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The lock file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// The held lock (see the module docs); released when dropped.
#[derive(Debug)]
pub struct RunLock {
    _file: File,
}

impl RunLock {
    /// Takes the lock of the run directory `dir` (which exists), and writes this process's id
    /// into it for the next one to name. A file system that cannot lock (some network mounts)
    /// gets a warning and no lock.
    pub fn take(dir: &Path) -> Result<Option<Self>, LockError> {
        let path = dir.join(LOCK_FILE);
        let io = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut held = String::new();
                let holder = match file.read_to_string(&mut held) {
                    Ok(_) if held.trim().parse::<u32>().is_ok() => format!("pid {}", held.trim()),
                    _ => "a process".to_owned(),
                };
                return Err(LockError::InUse { path, holder });
            }
            Err(TryLockError::Error(e)) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot lock the run directory; nothing stops a second run from using it");
                return Ok(None);
            }
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        file.flush().map_err(io)?;
        Ok(Some(Self { _file: file }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_directory_is_refused_until_the_first_goes() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::take(dir.path()).unwrap().expect("locked");
        let err = RunLock::take(dir.path()).unwrap_err().to_string();
        let pid = std::process::id();
        assert!(
            err.contains(&format!(
                "another `sluice run` (pid {pid}) is using this run directory"
            )),
            "{err}"
        );
        drop(first);
        assert!(RunLock::take(dir.path()).unwrap().is_some());
    }
}
