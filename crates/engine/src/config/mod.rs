//! `[engine]` and `[engine.simulated]`: rollout generation's config section, owned here. Raw
//! (serde, defaults; [`RawEngine`]) → [`validate_engine`] → [`EngineConfig`]; `sluice-config`
//! composes it into the whole file and checks the upper bounds of its numbers ([`BOUNDS`])
//! first. [`EngineLimits`] and [`compute_dtype`] check the keys `sluice serve` takes as flags by
//! the same rules.
//! The completion-length distribution stays in core
//! (`sluice_core::config::LengthDistribution`): core's seeded generator draws from it.

mod bounds;
mod limits;
mod raw;
mod typed;
mod validate;

pub use bounds::BOUNDS;
pub use limits::{EngineLimits, LimitError};
pub use raw::*;
pub use typed::*;
pub use validate::{compute_dtype, compute_dtype_flag, validate_engine};
