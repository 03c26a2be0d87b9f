//! Sluice's trainer: turns rollout groups into weight updates.
//!
//! Module map (semantics in DESIGN.md sections 5 and 6; see `docs/trainer.md`):
//! - `advantage`: group (GRPO), situational and discounted advantages; zero-advantage filtering.
//! - `loss`: `ppo`, `tis` and `decoupled_ppo` objectives with aggregation and per-step statistics.
//! - `batcher`: training texts packed into fixed `[B, L]` micro-batches with sequence ids.
//! - `optim`: AdamW with f32 master weights, global-norm clipping, warmup + constant/cosine schedule.
//! - `checkpoint`: model (HF format), optimizer state (safetensors) and trainer state (JSON).
//!
//! The trainer backend trait and the simulated backend live beside these modules and are owned by the
//! async pipeline.

pub mod advantage;
pub mod batcher;
pub mod loss;
pub mod optim;

pub use advantage::{AdvantageBatch, AdvantageConfig, ScoredText, compute_advantages};
pub use batcher::{BatcherConfig, MicroBatch, Packing, PackingStats, TrainingText, pack};
pub use loss::{LossConfig, LossStats, LossSummary, LossTerms, TokenInputs, token_terms};
pub use optim::{AdamW, GradAccumulator, OptimConfig, OptimError, StepReport};
