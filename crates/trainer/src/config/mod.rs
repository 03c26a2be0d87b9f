//! `[trainer]` and `[trainer.simulated]`: the trainer's config section, owned here. Raw (serde,
//! defaults; [`RawTrainer`]) → [`validate_trainer`] → [`TrainerConfig`]; `sluice-config` composes
//! it into the whole file, checks the upper bounds of its numbers ([`BOUNDS`]) first and
//! resolves `minibatches` with `rollout.groups_per_step` ([`default_minibatches`]).

mod bounds;
mod raw;
mod typed;
mod validate;

pub use bounds::{BOUNDS, MAX_MINIBATCHES};
pub use raw::{RawSimTrainer, RawTrainer};
pub use typed::*;
pub use validate::{
    DECOUPLED_MINIBATCHES, default_clip, default_kept_logits_mib, default_loss_aggregation,
    default_minibatches, validate_trainer,
};
