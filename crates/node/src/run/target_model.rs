//! The weights that met the run's held-out target (`eval.stop_at_accuracy`), written as a
//! Hugging Face model directory beside the checkpoint. The trainer trains on while an
//! evaluation runs, so by the time a run ends its checkpoint holds weights a step or more past
//! the evaluated ones, which may score below the target; these are the ones that met it.

use std::path::{Path, PathBuf};

use sluice_core::WeightSnapshot;
use sluice_model::{ModelWeights, SaveOptions};

/// The directory under `run.output_dir`.
pub const TARGET_MODEL_DIR: &str = "model_at_target";

/// Writes `weights` (with the tokenizer and template files of the run's model `model_dir`)
/// to `out/model_at_target`, replacing what a previous end left there: written beside it and
/// renamed into place, so the directory is whole or absent. Off the runtime.
pub(super) async fn write(
    weights: &WeightSnapshot,
    model_dir: &Path,
    out: &Path,
) -> Result<PathBuf, String> {
    let weights = ModelWeights::from_envelope(weights)
        .ok_or_else(|| "the evaluated weights are not a model's".to_owned())?;
    let (model_dir, out) = (model_dir.to_owned(), out.to_owned());
    tokio::task::spawn_blocking(move || write_now(&weights, &model_dir, &out))
        .await
        .map_err(|e| format!("writer thread: {e}"))?
}

fn write_now(weights: &ModelWeights, model_dir: &Path, out: &Path) -> Result<PathBuf, String> {
    let dir = out.join(TARGET_MODEL_DIR);
    let tmp = out.join(format!(".{TARGET_MODEL_DIR}.tmp"));
    let io = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    sluice_model::save_checkpoint(weights, &tmp, &SaveOptions::default())
        .map_err(|e| e.to_string())?;
    sluice_model::copy_aux_files(model_dir, &tmp).map_err(|e| e.to_string())?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| io(&dir, e))?;
    }
    std::fs::rename(&tmp, &dir).map_err(|e| io(&dir, e))?;
    Ok(dir)
}
