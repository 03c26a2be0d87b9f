//! Sluice's trainer: turns rollout groups into weight updates.
//!
//! Module map (semantics in DESIGN.md sections 5 and 6; see `docs/trainer.md`):
//! - `advantage`: group (GRPO), situational and discounted advantages; zero-advantage filtering.
//! - `loss`: `ppo`, `tis`, `decoupled_ppo` and `gspo` objectives (with the dual clip), aggregation
//!   and per-step statistics.
//! - `batcher`: training texts packed into fixed `[B, L]` micro-batches with sequence ids.
//! - `optim`: AdamW with f32 master weights, global-norm clipping, warmup + constant/cosine schedule.
//! - `checkpoint`: model (HF format), optimizer state (safetensors) and trainer state (JSON).
//! - `lora`: low-rank adapters (PEFT's format) trained through the merged weights.
//! - `kl_reward`: the KL penalty in the reward and its adaptive coefficient.
//! - `critic`: generalized advantage estimation and the value loss of PPO's critic
//!   (`advantage = "gae"`; the critic model itself is the native trainer's).
//! - `native`: [`NativeTrainer`], the candle trainer implementing `sluice_core::TrainerBackend`:
//!   RL steps, supervised steps, weight publishing, checkpoints.
//! - `config`: the `[trainer]` config section (raw → `validate_trainer` → `TrainerConfig`).
//! - `settings`, `report`: the native trainer's settings and its per-step statistics/metrics.
//! - `error`: [`TrainerError`] with stable `kind()` names.
//!
//! The backend trait itself lives in `sluice_core::backend`; the simulated trainer in
//! `sluice-engine`.

pub mod adamw_kernel;
pub mod advantage;
pub mod batcher;
pub mod checkpoint;
pub mod config;
pub mod critic;
pub mod error;
pub mod kl_reward;
pub mod lora;
pub mod loss;
pub mod native;
pub mod optim;
pub mod report;
pub mod settings;
pub mod simulated;
mod steps;

pub use advantage::{
    AdvantageBatch, AdvantageConfig, ScoredText, SituationAdvantage, compute_advantages,
    situation_advantages, situation_summary,
};
pub use batcher::{BatcherConfig, MicroBatch, Packing, PackingStats, TrainingText, pack};
pub use error::TrainerError;
pub use lora::{Adapters, LoraConfig};
pub use loss::{
    Aggregation, LossConfig, LossStats, LossSummary, LossTerms, TokenInputs, token_terms,
};
pub use native::{NativeTrainer, SupervisedExample};
pub use optim::{AdamW, GradAccumulator, OptimConfig, OptimError, StepReport};
pub use report::{Mismatch, StepParts, StepStats, step_metrics};
pub use settings::{NativeTrainerConfig, TrainerRunContext};
pub use simulated::SimTrainer;
