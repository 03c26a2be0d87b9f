//! `[trainer]` and `[trainer.simulated]`: the trainer's config section, owned here. Raw (serde,
//! defaults; [`RawTrainer`]) → [`validate_trainer`] → [`TrainerConfig`]; `sluice-config` composes
//! it into the whole file and resolves `minibatches` with `rollout.groups_per_step`
//! ([`default_minibatches`]).

mod raw;
mod typed;
mod validate;

pub use raw::{RawSimTrainer, RawTrainer};
pub use typed::*;
pub use validate::{DECOUPLED_MINIBATCHES, default_minibatches, validate_trainer};
