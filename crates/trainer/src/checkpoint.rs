//! Trainer checkpoints: everything needed to resume a run exactly.
//!
//! Layout under the checkpoint directory:
//! - `model/`: the f32 master weights as a Hugging Face directory (`config.json`,
//!   `model.safetensors`, generation config, and the tokenizer/template files of the source model),
//!   loadable by any HF tool and by `sluice`;
//! - `optimizer.safetensors`: AdamW moments `m.{i}`, `v.{i}` (and `master.{i}` for non-f32
//!   parameters), `i` the parameter's position in checkpoint order;
//! - `trainer_state.json`: [`TrainerState`];
//! - with LoRA, `adapter/`: the adapters as PEFT writes them (`adapter_model.safetensors`,
//!   `adapter_config.json`), while `model/` holds the merged weights and the optimizer file the
//!   adapters' moments;
//! - with `advantage = "gae"`, `critic/`: the critic as a checkpoint of this same layout (its
//!   model, its optimizer, its state) plus `value_head.safetensors` (`score.weight`,
//!   `[1, hidden]`).
//!
//! A checkpoint is written into `<dir>.partial` and renamed into place, the old one removed just
//! before, so a crash never leaves a half-written `<dir>` behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use sluice_model::{
    LoadOptions, ModelWeights, SaveOptions, copy_aux_files, load_checkpoint, save_checkpoint,
};

use crate::config::{LrSchedule, MAX_MINIBATCHES};
use crate::error::TrainerError;

/// Version of this layout, checked on load.
pub const FORMAT_VERSION: u32 = 1;

/// The model subdirectory.
pub const MODEL_DIR: &str = "model";
/// The optimizer file.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The state file.
pub const STATE_FILE: &str = "trainer_state.json";

/// `trainer_state.json`: counters and the schedule position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Layout version ([`FORMAT_VERSION`]).
    pub format: u32,
    /// Optimizer steps taken by the trainer (RL and supervised).
    pub step: u64,
    /// Policy version of the saved weights.
    pub version: u64,
    /// AdamW's step count (bias correction and schedule position).
    pub optimizer_step: u64,
    /// The run's seed (the trainer itself draws no random numbers).
    pub seed: u64,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Learning rate the next step will use.
    pub next_learning_rate: f64,
    /// Warmup steps of the schedule.
    pub warmup_steps: u64,
    /// Total steps of the schedule.
    pub total_steps: u64,
    /// `constant` or `cosine`.
    pub schedule: String,
    /// With `trainer.kl_in_reward`, the coefficient the next step applies (the adaptive
    /// controller's state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_in_reward_coef: Option<f64>,
}

/// The `schedule` names a state file may hold (as [`schedule_name`] writes them).
const SCHEDULES: [LrSchedule; 2] = [LrSchedule::Constant, LrSchedule::Cosine];

/// How `trainer_state.json` names `schedule`.
pub fn schedule_name(schedule: LrSchedule) -> String {
    format!("{schedule:?}").to_lowercase()
}

/// Refuses a state no run writes: an unknown schedule, or more optimizer updates than the steps
/// can have taken (each takes at most [`MAX_MINIBATCHES`]; a huge count ends the warm-up and
/// the cosine at once and, before the bias correction was computed without wrapping, turned
/// every weight NaN).
fn check_state(state: &TrainerState, path: &Path) -> Result<(), TrainerError> {
    if !SCHEDULES
        .iter()
        .any(|&s| schedule_name(s) == state.schedule)
    {
        let known: Vec<String> = SCHEDULES.iter().map(|&s| schedule_name(s)).collect();
        return Err(TrainerError::checkpoint(
            path,
            format!(
                "`schedule` = {:?} is not a known schedule (one of {})",
                state.schedule,
                known.join(", ")
            ),
        ));
    }
    // A step that failed after some of its updates (a `trainer_error` checkpoint) adds updates
    // but no step: one step more is allowed for it.
    let most = state
        .step
        .saturating_add(1)
        .saturating_mul(u64::from(MAX_MINIBATCHES));
    if state.optimizer_step > most {
        return Err(TrainerError::checkpoint(
            path,
            format!(
                "`optimizer_step` = {} is more than {MAX_MINIBATCHES} optimizer updates for each \
                 of the {} steps (`step`): the file is corrupt",
                state.optimizer_step, state.step
            ),
        ));
    }
    Ok(())
}

fn partial_dir(dir: &Path) -> PathBuf {
    let mut name = dir
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".partial");
    dir.with_file_name(name)
}

/// Writes a checkpoint of `master` (f32 weights), the optimizer tensors and `state` to `dir`;
/// `extra` writes what else belongs to it into the directory it is given (the LoRA adapters),
/// before the checkpoint is moved into place.
pub fn save(
    dir: &Path,
    master: &ModelWeights,
    aux_source: Option<&Path>,
    optimizer: &HashMap<String, Tensor>,
    state: &TrainerState,
    extra: impl FnOnce(&Path) -> Result<(), TrainerError>,
) -> Result<(), TrainerError> {
    let tmp = partial_dir(dir);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| TrainerError::checkpoint(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| TrainerError::checkpoint(&tmp, e))?;
    let model_dir = tmp.join(MODEL_DIR);
    save_checkpoint(master, &model_dir, &SaveOptions::default())?;
    if let Some(src) = aux_source {
        copy_aux_files(src, &model_dir)?;
    }
    let opt_path = tmp.join(OPTIMIZER_FILE);
    let cpu: HashMap<String, Tensor> = optimizer
        .iter()
        .map(|(k, t)| t.to_device(&Device::Cpu).map(|t| (k.clone(), t)))
        .collect::<candle_core::Result<_>>()
        .map_err(|e| TrainerError::checkpoint(&opt_path, e))?;
    candle_core::safetensors::save(&cpu, &opt_path)
        .map_err(|e| TrainerError::checkpoint(&opt_path, e))?;
    let state_path = tmp.join(STATE_FILE);
    let json = serde_json::to_string_pretty(state)
        .map_err(|e| TrainerError::checkpoint(&state_path, e))?;
    std::fs::write(&state_path, json + "\n")
        .map_err(|e| TrainerError::checkpoint(&state_path, e))?;
    extra(&tmp)?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| TrainerError::checkpoint(dir, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| TrainerError::checkpoint(dir, e))
}

/// Reads a checkpoint written by [`save`]: f32 master weights, optimizer tensors and state.
pub fn load(
    dir: &Path,
    device: &Device,
) -> Result<(ModelWeights, HashMap<String, Tensor>, TrainerState), TrainerError> {
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path)
        .map_err(|e| TrainerError::checkpoint(&state_path, e))?;
    let state: TrainerState =
        serde_json::from_str(&text).map_err(|e| TrainerError::checkpoint(&state_path, e))?;
    if state.format != FORMAT_VERSION {
        return Err(TrainerError::checkpoint(
            &state_path,
            format!(
                "format {} is not the supported {FORMAT_VERSION}",
                state.format
            ),
        ));
    }
    check_state(&state, &state_path)?;
    let options = LoadOptions {
        dtype: Some(candle_core::DType::F32),
        device: device.clone(),
    };
    let snapshot = load_checkpoint(&dir.join(MODEL_DIR), &options)?
        .with_version(sluice_core::PolicyVersion(state.version));
    let opt_path = dir.join(OPTIMIZER_FILE);
    let optimizer = candle_core::safetensors::load(&opt_path, device)
        .map_err(|e| TrainerError::checkpoint(&opt_path, e))?;
    Ok((snapshot, optimizer, state))
}
