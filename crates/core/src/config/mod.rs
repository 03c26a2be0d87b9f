//! The config sections every crate reads, and the pieces each crate validates its own section
//! with (`STYLE.md` habit 8): TOML → raw serde section (unknown keys refused, defaults filled) →
//! its `validate_*` → typed section (ranges checked).
//!
//! The whole file (`Config`, `RawConfig`, `parse`, `load`, `--set` overrides, the upper bounds
//! and the rules between sections) is composed in `sluice-config`, which sits above the library
//! crates; sections move from here into the crate that consumes them (issue 19). What stays here
//! is what several crates share: [`ConfigError`], the validation context and one-value checks
//! ([`check`]), and the sections not yet moved.

pub mod check;
mod error;
pub mod raw;
mod typed;
pub mod validate;

pub use error::{ConfigError, ConfigErrorKind, closest, edit_distance};
pub use typed::*;

/// The environment variable that supplies `admin.token` when the file does not.
pub const ADMIN_TOKEN_ENV: &str = "SLUICE_ADMIN_TOKEN";
