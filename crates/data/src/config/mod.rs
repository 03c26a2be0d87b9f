//! `[data]` and `[data.domains.<domain>]`: the datasets and per-domain options, owned here (the
//! env crate reads the domains' tasks, rubrics and env servers through this crate). Raw (serde,
//! defaults; [`RawData`]) → [`validate_data`] → [`DataConfig`]; `sluice-config` composes it into
//! the whole file and checks the upper bounds of its numbers ([`BOUNDS`]) first.

mod bounds;
mod judge;
mod raw;
mod reward_model;
mod typed;
mod validate;

pub use bounds::BOUNDS;
pub use judge::*;
pub use raw::*;
pub use reward_model::*;
pub use typed::*;
pub use validate::{MAX_REWARD_FNS, validate_data};
