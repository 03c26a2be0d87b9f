//! Config in two phases (`STYLE.md` habit 8): TOML → [`raw::RawConfig`] (serde, unknown keys
//! refused, defaults filled) → [`RawConfig::validate`] → [`Config`] (typed, ranges checked).
//!
//! `--set key.path=value` overrides are applied to the parsed TOML tree *before* phase one, so an
//! override is checked exactly like the file, and an error caused by one says so. Every error is
//! one line naming the file, the key and what was expected; an unknown key suggests the closest
//! valid one.

pub mod check;
mod error;
mod overrides;
pub mod raw;
mod typed;
mod validate;

use crate::WeightUpdateMode;
use std::collections::BTreeSet;
use std::path::Path;

pub use error::{ConfigError, ConfigErrorKind, closest, edit_distance};
pub use overrides::Override;
pub use raw::RawConfig;
pub use typed::*;

/// The environment variable that supplies `admin.token` when the file does not.
pub const ADMIN_TOKEN_ENV: &str = "SLUICE_ADMIN_TOKEN";

/// Reads, overrides and validates the config at `path`, taking the admin token from the process
/// environment when the file has none.
pub fn load(path: &Path, overrides: &[Override]) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigError::file(
            &file,
            ConfigErrorKind::Io,
            format!("cannot read config: {e}"),
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
    validate::bounds::check(&tree, &ctx)?;
    let raw = validate::deserialize(toml::Value::Table(tree), &ctx)?;
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

impl Config {
    /// The resolved config as TOML, in the file's own shape (secrets redacted).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// Settings that are valid but unsound, with why and what to set instead; `sluice check`
    /// prints them and `sluice run` logs them as warnings.
    pub fn advisories(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let eta = self.rollout.knobs.max_version_lag;
        if self.trainer.loss == LossKind::DecoupledPpo
            && self.trainer.minibatches.get() == 1
            && eta > 0
        {
            notes.push(format!(
                "trainer.minibatches = 1 with loss = \"decoupled_ppo\" and rollout.max_version_lag = {eta}: with one update per step the proximal policy is the current one, nothing is clipped and no trust region bounds {eta} versions of drift (the η = 4 ablation in docs/pipeline.md); leave trainer.minibatches unset ({} updates) or use loss = \"ppo\"",
                validate::DECOUPLED_MINIBATCHES
            ));
        }
        let lag = self.engine.prefix_cache_version_lag;
        if lag > 0 && !self.engine.prefix_caching {
            notes.push(format!(
                "engine.prefix_cache_version_lag = {lag} with engine.prefix_caching = false: nothing is cached, so the lag changes nothing"
            ));
        } else if lag > 0 && self.rollout.knobs.weight_update_mode != WeightUpdateMode::InFlight {
            notes.push(format!(
                "engine.prefix_cache_version_lag = {lag} with rollout.weight_update_mode = \"{}\": only in_flight updates let a request's keys and values span versions, so older blocks are reused only while that mode is set (a runtime knob)",
                self.rollout.knobs.weight_update_mode.as_str()
            ));
        }
        notes
    }
}
