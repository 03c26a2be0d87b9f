//! Reading files whose content comes from users (configs, templates, model and dataset files):
//! regular files only, never more bytes than a cap, and an error that names the file and the cap.
//!
//! Without this, `sluice check /dev/zero` reads until memory runs out and a dataset that is a
//! FIFO blocks its reader forever. The type is checked with `stat` (following symlinks) before
//! the file is opened, because opening a FIFO for reading already blocks; it is checked again on
//! the open handle, so a file swapped in between is still caught.

use std::io::Read;
use std::path::{Path, PathBuf};

/// One mebibyte, the unit caps are written in.
pub const MIB: u64 = 1 << 20;

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum ReadFileError {
    /// The OS refused (missing file, permissions, …).
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The path is a device, FIFO, socket or directory.
    #[error("{}: is a {kind}, not a regular file", path.display())]
    NotRegular {
        /// The file.
        path: PathBuf,
        /// What it is instead (`character device`, `FIFO`, …).
        kind: &'static str,
    },
    /// The file holds more bytes than its cap.
    #[error("{}: larger than the {} limit for {what}", path.display(), human_bytes(*cap))]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The cap, bytes.
        cap: u64,
        /// What kind of file the cap is for (`config files`, `chat templates`, …).
        what: &'static str,
    },
    /// The file is not UTF-8 text.
    #[error("{}: not UTF-8 text (invalid byte at offset {offset})", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Offset of the first invalid byte.
        offset: usize,
    },
}

impl ReadFileError {
    /// What went wrong without the file's name, for callers whose messages already name it.
    pub fn reason(&self) -> String {
        match self {
            ReadFileError::Io { source, .. } => source.to_string(),
            ReadFileError::NotRegular { kind, .. } => format!("is a {kind}, not a regular file"),
            ReadFileError::TooLarge { cap, what, .. } => {
                format!("larger than the {} limit for {what}", human_bytes(*cap))
            }
            ReadFileError::NotUtf8 { offset, .. } => {
                format!("not UTF-8 text (invalid byte at offset {offset})")
            }
        }
    }

    /// Short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            ReadFileError::Io { .. } => "file_io",
            ReadFileError::NotRegular { .. } => "file_not_regular",
            ReadFileError::TooLarge { .. } => "file_too_large",
            ReadFileError::NotUtf8 { .. } => "file_not_utf8",
        }
    }
}

/// `bytes` in the largest binary unit that divides it (`16 MiB`, `4 GiB`, `1000 bytes`).
pub fn human_bytes(bytes: u64) -> String {
    for (unit, size) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{} {unit}", bytes / size);
        }
    }
    format!("{bytes} bytes")
}

/// The contents of the regular file at `path` (symlinks followed), refused when it holds more
/// than `cap` bytes; `what` names the kind of file in that error (`config files`).
pub fn read_capped(path: &Path, cap: u64, what: &'static str) -> Result<Vec<u8>, ReadFileError> {
    let io = |source| ReadFileError::Io {
        path: path.to_owned(),
        source,
    };
    let too_large = || ReadFileError::TooLarge {
        path: path.to_owned(),
        cap,
        what,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    check_regular(path, &meta)?;
    if meta.len() > cap {
        return Err(too_large());
    }
    let file = std::fs::File::open(path).map_err(io)?;
    check_regular(path, &file.metadata().map_err(io)?)?;
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    // One byte past the cap tells a file that grew since `stat` from one exactly at the cap.
    file.take(cap.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > cap {
        return Err(too_large());
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_text_capped(
    path: &Path,
    cap: u64,
    what: &'static str,
) -> Result<String, ReadFileError> {
    let bytes = read_capped(path, cap, what)?;
    String::from_utf8(bytes).map_err(|e| ReadFileError::NotUtf8 {
        path: path.to_owned(),
        offset: e.utf8_error().valid_up_to(),
    })
}

fn check_regular(path: &Path, meta: &std::fs::Metadata) -> Result<(), ReadFileError> {
    let file_type = meta.file_type();
    if file_type.is_file() {
        return Ok(());
    }
    Err(ReadFileError::NotRegular {
        path: path.to_owned(),
        kind: type_name(&file_type),
    })
}

#[cfg(unix)]
fn type_name(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

#[cfg(not(unix))]
fn type_name(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "directory"
    } else {
        "special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_name_the_file_and_the_limit() {
        let dir = std::env::temp_dir().join(format!("sluice-core-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.txt");
        std::fs::write(&path, "12345").unwrap();
        assert_eq!(read_text_capped(&path, 5, "tests").unwrap(), "12345");
        let err = read_capped(&path, 4, "tests").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}: larger than the 4 bytes limit for tests",
                path.display()
            )
        );
        let err = read_capped(&dir, 4, "tests").unwrap_err();
        assert!(
            err.to_string()
                .ends_with("is a directory, not a regular file")
        );
        std::fs::write(&path, [b'a', 0xff]).unwrap();
        let err = read_text_capped(&path, 5, "tests").unwrap_err();
        assert!(err.to_string().contains("offset 1"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(human_bytes(16 * MIB), "16 MiB");
        assert_eq!(human_bytes(1000), "1000 bytes");
    }

    #[cfg(unix)]
    #[test]
    fn devices_are_refused_without_reading() {
        let err = read_capped(Path::new("/dev/zero"), MIB, "tests").unwrap_err();
        assert_eq!(err.kind(), "file_not_regular");
        assert!(err.to_string().contains("character device"), "{err}");
    }
}
