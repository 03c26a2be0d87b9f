//! The whole config file of a Sluice node, composed from the sections each crate owns.
//!
//! Config in two phases (`STYLE.md` habit 8): TOML → [`RawConfig`] (serde, unknown keys refused,
//! defaults filled) → `RawConfig::validate` → [`Config`] (typed, ranges checked). Each section's
//! raw type, typed type and checks live with the crate that consumes it (`[replay]`, `[trainer]`,
//! `[data]`, `[engine]`, `[model]`), built from `sluice_core::config::check`; the node-level
//! sections (`[run]`, `[rollout]`, `[metrics]`, `[admin]`, `[warmup]`, `[eval]`, `[supervision]`,
//! `[faults]`, `[node]`) live here in `sections/`. This crate also holds what only the whole file
//! knows: the composition (`compose.rs`), `--set` overrides, the upper bounds of every numeric key
//! (`compose/bounds.rs`), the rules between sections and the advisories. Every section and the
//! validation building blocks are re-exported, so `sluice_config::X` names every config type.
//!
//! No library crate depends on this one: library functions take their own section or plain
//! values, and whoever holds the whole [`Config`] (the actors, the binary) hands them out.
//!
//! `--set key.path=value` overrides are applied to the parsed TOML tree *before* phase one, so an
//! override is checked exactly like the file, and an error caused by one says so. Every error is
//! one line naming the file, the key and what was expected; an unknown key suggests the closest
//! valid one.

mod compose;
pub mod deploy;
mod overrides;
pub mod raw;
mod sections;
mod typed;

use std::collections::BTreeSet;
use std::path::Path;

pub use deploy::{Deployment, ENV_TOKEN_ENV, check_deployment};
pub use overrides::Override;
pub use raw::RawConfig;
pub use sections::validate::*;
pub use sections::*;
pub use sluice_core::config::*;
pub use sluice_data::config::{
    AnswerMarker, BadLinePolicy, DEFAULT_JUDGE_PROMPT, DEFAULT_SCORE_REGEX, DataConfig,
    DatasetSpec, DomainConfig, DomainRubric, JudgeConfig, MAX_REWARD_FNS, validate_data,
};
pub use sluice_engine::config::{EngineBackend, EngineConfig, SimEngineConfig, validate_engine};
pub use sluice_model::section::{ModelPreset, ModelSection, validate_model};
pub use sluice_replay::config::{ExpiredPolicy, ReplayConfig, validate_replay};
pub use sluice_trainer::config::{
    AdvantageKind, DECOUPLED_MINIBATCHES, LossAggregation, LossKind, LrSchedule, OversizedText,
    SimTrainerConfig, TisLevel, TisMode, TrainerConfig, default_minibatches, validate_trainer,
};
pub use typed::Config;

/// The environment variable that supplies `admin.token` when the file does not.
pub const ADMIN_TOKEN_ENV: &str = "SLUICE_ADMIN_TOKEN";

/// Largest config file read: configs are a few kilobytes; this only stops `/dev/zero`-like
/// inputs from reading until memory runs out.
pub const CONFIG_FILE_MAX_BYTES: u64 = 16 * sluice_core::files::MIB;

/// Reads, overrides and validates the config at `path`, taking the admin token from the process
/// environment when the file has none.
pub fn load(path: &Path, overrides: &[Override]) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let text = sluice_core::files::read_text_capped(path, CONFIG_FILE_MAX_BYTES, "config files")
        .map_err(|e| {
            ConfigError::file(
                &file,
                ConfigErrorKind::Io,
                format!("cannot read config: {}", e.reason()),
            )
        })?;
    parse(&text, &file, overrides, &|k| std::env::var(k).ok())
}

/// Parses config text. `file` names the source in errors; `env` looks environment variables up
/// (injected so tests do not touch the process environment).
pub fn parse(
    text: &str,
    file: &str,
    overrides: &[Override],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigError> {
    let mut tree: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| syntax_error(file, text, &e))?;
    let mut overridden = BTreeSet::new();
    for o in overrides {
        o.apply(&mut tree).map_err(|msg| {
            ConfigError::key(file, &o.key, ConfigErrorKind::Override, msg).via("--set")
        })?;
        overridden.insert(o.key.clone());
    }
    let ctx = check::Ctx {
        file,
        overridden: &overridden,
        env,
    };
    compose::bounds::check(&tree, &ctx)?;
    let raw = compose::deserialize(toml::Value::Table(tree), &ctx)?;
    raw.validate(&ctx)
}

/// A TOML syntax error as `file: line L, column C: invalid TOML: what`.
fn syntax_error(file: &str, text: &str, e: &toml::de::Error) -> ConfigError {
    let message = match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
            format!(
                "line {line}, column {column}: invalid TOML: {}",
                e.message()
            )
        }
        None => format!("invalid TOML: {}", e.message()),
    };
    ConfigError::file(file, ConfigErrorKind::Syntax, message)
}
