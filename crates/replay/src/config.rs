//! `[replay]`: where the replay store lives, how many groups it may hold, and what happens to
//! expired and zero-advantage groups. Raw (serde, defaults) → [`validate_replay`] → [`ReplayConfig`]; `sluice-config`
//! composes it into the whole file.

use std::num::NonZeroU64;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sluice_core::config::ConfigError;
use sluice_core::config::check::{Ctx, choice};

/// `[replay]`: the replay store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawReplay {
    /// Database directory (default `<output_dir>/replay`).
    pub path: Option<String>,
    /// What happens to expired rollouts: `regenerate` or `drop`.
    pub expired: String,
    /// Move groups whose rewards are all equal to the `Filtered` bucket.
    pub filter_zero_advantage: bool,
    /// Most groups admitted and not yet trained (unset: bounded by η alone).
    pub capacity: Option<u64>,
}

impl Default for RawReplay {
    fn default() -> Self {
        Self {
            path: None,
            expired: "regenerate".into(),
            filter_zero_advantage: true,
            capacity: None,
        }
    }
}

/// What happens to rollouts whose oldest token fell past η.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpiredPolicy {
    /// Regenerate from the prompt.
    Regenerate,
    /// Drop the group.
    Drop,
}

sluice_core::impl_choice!(ExpiredPolicy);

/// `[replay]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayConfig {
    /// Database directory.
    pub path: PathBuf,
    /// Expired policy.
    pub expired: ExpiredPolicy,
    /// Filter zero-advantage groups.
    pub filter_zero_advantage: bool,
    /// Most groups admitted and not yet trained — in flight, completed, or waiting to resume —
    /// that the store holds. Policy: at the bound fresh admission waits (resumes do not); nothing
    /// is evicted, so no generated token is lost. `None`: η alone bounds it (`(η + 1) · B` plus
    /// what is in flight).
    pub capacity: Option<NonZeroU64>,
}

/// Phase two of `[replay]`; the default path is `<output_dir>/replay` (`run.output_dir`).
pub fn validate_replay(
    raw: RawReplay,
    output_dir: &Path,
    ctx: &Ctx<'_>,
) -> Result<ReplayConfig, ConfigError> {
    let path = match raw.path {
        Some(p) if p.trim().is_empty() => {
            return Err(ctx.value(
                "replay.path",
                "expected a directory path, got an empty string",
            ));
        }
        Some(p) => PathBuf::from(p),
        None => output_dir.join("replay"),
    };
    let capacity = match raw.capacity {
        Some(0) => {
            return Err(ctx.value(
                "replay.capacity",
                "expected a positive number of groups (leave it out for no bound beyond η), got 0",
            ));
        }
        c => c.and_then(NonZeroU64::new),
    };
    Ok(ReplayConfig {
        path,
        expired: choice(ctx, "replay.expired", &raw.expired)?,
        filter_zero_advantage: raw.filter_zero_advantage,
        capacity,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn validate(raw: RawReplay) -> Result<ReplayConfig, String> {
        let overridden = BTreeSet::new();
        let ctx = Ctx {
            file: "t.toml",
            overridden: &overridden,
            env: &|_| None,
        };
        validate_replay(raw, Path::new("runs/a"), &ctx).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_resolve_under_the_output_dir() {
        let c = validate(RawReplay::default()).unwrap();
        assert_eq!(c.path, PathBuf::from("runs/a/replay"));
        assert_eq!(c.expired, ExpiredPolicy::Regenerate);
        assert!(c.filter_zero_advantage);
    }

    #[test]
    fn bad_values_name_the_key() {
        let empty = RawReplay {
            path: Some(" ".into()),
            ..RawReplay::default()
        };
        assert_eq!(
            validate(empty).unwrap_err(),
            "t.toml: replay.path: expected a directory path, got an empty string"
        );
        let unknown = RawReplay {
            expired: "keep".into(),
            ..RawReplay::default()
        };
        let err = validate(unknown).unwrap_err();
        assert!(err.starts_with("t.toml: replay.expired: "), "{err}");
        assert!(err.contains("regenerate, drop"), "{err}");
        let zero = RawReplay {
            capacity: Some(0),
            ..RawReplay::default()
        };
        assert_eq!(
            validate(zero).unwrap_err(),
            "t.toml: replay.capacity: expected a positive number of groups (leave it out for no bound beyond η), got 0"
        );
    }
}
