//! What every crate's config section is built from (`STYLE.md` habit 8): TOML → raw serde
//! section (unknown keys refused, defaults filled) → its `validate_*` → typed section (ranges
//! checked).
//!
//! Each section lives with the crate that consumes it (`sluice_replay::config`,
//! `sluice_trainer::config`, `sluice_data::config`, `sluice_engine::config`,
//! `sluice_model::section`); the node-level sections and the whole file (`Config`, `RawConfig`,
//! `parse`, `load`, `--set` overrides, the upper bounds and the rules between sections) are
//! composed in `sluice-config`, above the library crates. What stays here is what several crates
//! share: [`ConfigError`], the validation context and one-value checks ([`check`]), the upper
//! bounds' row type and shared limits ([`bounds`]), and the
//! shared types ([`Device`], [`DType`], [`LengthDistribution`], [`Secret`]).

pub mod bounds;
pub mod check;
mod error;
mod typed;

pub use error::{ConfigError, ConfigErrorKind, closest, edit_distance};
pub use typed::*;
