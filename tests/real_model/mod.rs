//! The real pretrained model of the end-to-end tests: SmolLM2-135M-Instruct, fetched and
//! imported by `scripts/fetch-smollm2` (cached under `~/.cache/sluice/models`, or
//! `$SLUICE_MODEL_CACHE`). There is no skip: a test that needs the model fails, with the script's
//! own words, when it cannot be had.

use std::path::PathBuf;
use std::process::Command;

/// The imported model directory, fetching and importing it (with this build's `sluice`) the
/// first time.
pub fn smollm2_dir() -> PathBuf {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/fetch-smollm2");
    let out = Command::new(script)
        .arg(env!("CARGO_BIN_EXE_sluice"))
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed (the real-model tests need SmolLM2-135M-Instruct; see README):\n{stderr}"
    );
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        dir.join("config.json").is_file(),
        "{script} printed {dir:?}, which holds no config.json:\n{stderr}"
    );
    dir
}
