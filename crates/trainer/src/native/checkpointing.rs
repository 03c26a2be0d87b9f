//! A [`NativeTrainer`]'s checkpoint: written from its state, and read back into it (the layout
//! and its checks: [`crate::checkpoint`]).

use std::path::Path;
use std::sync::Arc;

use sluice_core::PolicyVersion;
use sluice_model::TrainableModel;

use super::critic::{CRITIC_DIR, Critic};
use super::{NativeTrainer, master_model, train_adapters, trained_vars};
use crate::checkpoint;
use crate::error::TrainerError;
use crate::lora::{ADAPTER_DIR, Adapters};
use crate::optim::AdamW;
use crate::settings::NativeTrainerConfig;

impl NativeTrainer {
    /// Writes the checkpoint of the current state under `dir` (see [`checkpoint`]).
    pub fn save(&self, dir: &Path) -> Result<(), TrainerError> {
        let state = checkpoint::TrainerState {
            format: checkpoint::FORMAT_VERSION,
            step: self.steps,
            version: self.version.0,
            optimizer_step: self.optim.step_count(),
            seed: self.config.seed,
            learning_rate: self.config.optim.learning_rate,
            next_learning_rate: self.config.optim.learning_rate_at(self.optim.step_count()),
            warmup_steps: self.config.optim.warmup_steps,
            total_steps: self.config.optim.total_steps,
            schedule: checkpoint::schedule_name(self.config.optim.schedule),
            kl_in_reward_coef: self.kl_controller.map(|c| c.coef()),
        };
        let master = self.model.snapshot(self.version, None)?;
        let aux = self.aux_source.as_deref();
        checkpoint::save(
            dir,
            &master,
            aux,
            &self.optim.state_tensors(),
            &state,
            |tmp| {
                if let Some(a) = &self.adapters {
                    a.save(&tmp.join(ADAPTER_DIR), aux)?;
                }
                match &self.critic {
                    Some(c) => c.save(&tmp.join(CRITIC_DIR), &state),
                    None => Ok(()),
                }
            },
        )
    }

    /// Replaces the current state with the checkpoint under `dir`.
    pub fn load(&mut self, dir: &Path) -> Result<(), TrainerError> {
        let device = self.model.device().clone();
        let (snapshot, optim_tensors, state) = checkpoint::load(dir, &device)?;
        if let Some(coef) = state
            .kl_in_reward_coef
            .filter(|c| !(c.is_finite() && *c > 0.0))
        {
            return Err(TrainerError::checkpoint(
                dir.join(checkpoint::STATE_FILE),
                format!("`kl_in_reward_coef` = {coef} is not a coefficient (> 0)"),
            ));
        }
        let mut model = master_model(&snapshot, self.config.compute_dtype)?;
        let adapters = checkpoint_adapters(&model, self.config.lora.as_ref(), dir)?;
        train_adapters(&mut model, adapters.as_ref())?;
        let vars = trained_vars(&model, adapters.as_ref());
        let mut optim = AdamW::new(vars, self.config.optim)?;
        optim
            .load_state(optim_tensors, state.optimizer_step)
            .map_err(|e| TrainerError::checkpoint(dir.join(checkpoint::OPTIMIZER_FILE), e))?;
        let critic = checkpoint_critic(&self.config, dir, &device)?;
        self.model = model;
        self.critic = critic;
        self.adapters = adapters;
        self.optim = optim;
        self.steps = state.step;
        if let Some(controller) = &mut self.kl_controller {
            match state.kl_in_reward_coef {
                Some(coef) => controller.set_coef(coef),
                None => tracing::info!(
                    coef = controller.coef(),
                    "the checkpoint has no KL-in-reward coefficient: it starts at trainer.kl_in_reward"
                ),
            }
        }
        self.version = PolicyVersion(state.version);
        self.published = Arc::new(
            self.model
                .snapshot(self.version, Some(self.config.publish_dtype))?,
        );
        sluice_model::device::settle(&device)?;
        Ok(())
    }
}

/// The adapters of the checkpoint under `dir` for a trainer configured with `lora`; refuses a
/// checkpoint of the other kind (LoRA's where every weight trains, or the reverse).
fn checkpoint_adapters(
    model: &TrainableModel,
    lora: Option<&crate::lora::LoraConfig>,
    dir: &Path,
) -> Result<Option<Adapters>, TrainerError> {
    let saved = dir.join(ADAPTER_DIR);
    match (lora, saved.is_dir()) {
        (Some(lora), true) => Ok(Some(Adapters::load(model, lora, &saved)?)),
        (None, false) => Ok(None),
        (Some(lora), false) => Err(TrainerError::checkpoint(
            dir,
            format!(
                "every weight trained in this checkpoint, and trainer.lora_rank = {} asks for \
                 adapters: resume with trainer.lora_rank = 0, or start a new run from its model \
                 directory",
                lora.rank
            ),
        )),
        (None, true) => Err(TrainerError::checkpoint(
            dir,
            format!(
                "LoRA adapters trained in this checkpoint ({ADAPTER_DIR}/), and \
                 trainer.lora_rank = 0 asks to train every weight: resume with the adapters' \
                 settings, or start a new run from its model directory (the merged weights)"
            ),
        )),
    }
}

/// The critic of the checkpoint under `dir` for a trainer configured with `config`: none when
/// the checkpoint has none (with `advantage = "gae"` the next RL step starts one from the
/// restored policy, as the first RL step of a run does); refuses a checkpoint with a critic
/// where `advantage` is not `gae`, which would drop it.
fn checkpoint_critic(
    config: &NativeTrainerConfig,
    dir: &Path,
    device: &candle_core::Device,
) -> Result<Option<Critic>, TrainerError> {
    let saved = dir.join(CRITIC_DIR);
    match (&config.critic, saved.is_dir()) {
        (Some(c), true) => Ok(Some(Critic::load(
            &saved,
            c.clone(),
            config.compute_dtype,
            device,
        )?)),
        (Some(c), false) => {
            let from = match &c.init {
                Some(dir) => dir.display().to_string(),
                None => "its policy's weights".to_owned(),
            };
            tracing::info!(
                checkpoint = %dir.display(),
                "the checkpoint has no critic: the next RL step starts one from {from}"
            );
            Ok(None)
        }
        (None, false) => Ok(None),
        (None, true) => Err(TrainerError::checkpoint(
            dir,
            format!(
                "this checkpoint's run trained a critic ({CRITIC_DIR}/), and trainer.advantage \
                 is not \"gae\": resume with advantage = \"gae\", or remove {CRITIC_DIR}/ to \
                 go on without it"
            ),
        )),
    }
}
