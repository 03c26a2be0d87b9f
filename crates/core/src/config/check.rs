//! The building blocks of phase two, public so that every crate validates its own config section
//! with the same messages: the validation context [`Ctx`] (file, `--set` keys, environment) and
//! the checks of one value (integers, numbers, durations, enum names, addresses, devices).
//!
//! Each check takes the dotted key it reads, so its error names the file, the key and what was
//! expected, and says `--set` when an override supplied the value.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::str::FromStr;
use std::time::Duration;

use super::error::{ConfigError, ConfigErrorKind};
use super::typed::Device;
use crate::choice::Choice;

/// What validation needs to know besides the raw values.
pub struct Ctx<'a> {
    /// The file the values came from (or `<string>`), for every error.
    pub file: &'a str,
    /// Keys set by `--set`, so their errors can say so.
    pub overridden: &'a BTreeSet<String>,
    /// Looks an environment variable up (injected so tests do not touch the process's).
    pub env: &'a dyn Fn(&str) -> Option<String>,
}

impl Ctx<'_> {
    /// An error of `kind` at `key`, marked `--set` when an override explains it.
    pub fn err(&self, key: &str, kind: ConfigErrorKind, message: impl Into<String>) -> ConfigError {
        let e = ConfigError::key(self.file, key, kind, message);
        // An override of `a.b` explains errors at `a.b`, below it (a table value) and above it
        // (an unknown section it created).
        let from_override = self.overridden.iter().any(|o| {
            o == key || o.starts_with(&format!("{key}.")) || key.starts_with(&format!("{o}."))
        });
        if from_override { e.via("--set") } else { e }
    }

    /// A value of the right type outside its allowed range or set.
    pub fn value(&self, key: &str, message: impl Into<String>) -> ConfigError {
        self.err(key, ConfigErrorKind::Value, message)
    }
}

/// An integer ≥ 1 that fits `u32`.
pub fn non_zero_u32(ctx: &Ctx<'_>, key: &str, v: i64) -> Result<NonZeroU32, ConfigError> {
    let n = u32_at_least(ctx, key, v, 1)?;
    Ok(NonZeroU32::new(n).expect("checked ≥ 1"))
}

/// An integer ≥ 0 that fits `u32`.
pub fn u32_incl_zero(ctx: &Ctx<'_>, key: &str, v: i64) -> Result<u32, ConfigError> {
    u32_at_least(ctx, key, v, 0)
}

/// An integer ≥ `min` that fits `u32`.
pub fn u32_at_least(ctx: &Ctx<'_>, key: &str, v: i64, min: u32) -> Result<u32, ConfigError> {
    if v < i64::from(min) {
        return Err(ctx.value(key, format!("expected an integer ≥ {min}, got {v}")));
    }
    u32::try_from(v)
        .map_err(|_| ctx.value(key, format!("expected an integer ≤ {}, got {v}", u32::MAX)))
}

/// An integer ≥ 0.
pub fn u64_incl_zero(ctx: &Ctx<'_>, key: &str, v: i64) -> Result<u64, ConfigError> {
    u64::try_from(v).map_err(|_| ctx.value(key, format!("expected an integer ≥ 0, got {v}")))
}

/// An integer ≥ 1.
pub fn non_zero_u64(ctx: &Ctx<'_>, key: &str, v: i64) -> Result<NonZeroU64, ConfigError> {
    u64::try_from(v)
        .ok()
        .and_then(NonZeroU64::new)
        .ok_or_else(|| ctx.value(key, format!("expected an integer ≥ 1, got {v}")))
}

/// A finite number satisfying `ok`, described by `expected` in the error.
pub fn number(
    ctx: &Ctx<'_>,
    key: &str,
    v: f64,
    expected: &str,
    ok: impl Fn(f64) -> bool,
) -> Result<f64, ConfigError> {
    if v.is_finite() && ok(v) {
        Ok(v)
    } else {
        Err(ctx.value(key, format!("expected {expected}, got {v}")))
    }
}

/// A number in [0, 1].
pub fn fraction(ctx: &Ctx<'_>, key: &str, v: f64) -> Result<f64, ConfigError> {
    number(ctx, key, v, "a fraction in [0, 1]", |v| {
        (0.0..=1.0).contains(&v)
    })
}

/// A number > 0.
pub fn positive(ctx: &Ctx<'_>, key: &str, v: f64) -> Result<f64, ConfigError> {
    number(ctx, key, v, "a number > 0", |v| v > 0.0)
}

/// A number ≥ 0.
pub fn non_negative(ctx: &Ctx<'_>, key: &str, v: f64) -> Result<f64, ConfigError> {
    number(ctx, key, v, "a number ≥ 0", |v| v >= 0.0)
}

/// A duration in seconds, strictly positive.
pub fn positive_seconds(ctx: &Ctx<'_>, key: &str, v: f64) -> Result<Duration, ConfigError> {
    let v = number(ctx, key, v, "a number of seconds > 0", |v| v > 0.0)?;
    Ok(Duration::from_secs_f64(v))
}

/// A duration in seconds where 0 switches the feature off.
pub fn optional_seconds(ctx: &Ctx<'_>, key: &str, v: f64) -> Result<Option<Duration>, ConfigError> {
    let v = number(ctx, key, v, "a number of seconds ≥ 0 (0 = off)", |v| {
        v >= 0.0
    })?;
    Ok((v > 0.0).then(|| Duration::from_secs_f64(v)))
}

/// One of the names of a [`Choice`] enum (its serde names); the error names the key, the
/// value and every name.
pub fn choice<T: Choice>(ctx: &Ctx<'_>, key: &str, v: &str) -> Result<T, ConfigError> {
    T::parse(v).map_err(|reason| ctx.value(key, reason))
}

/// A listen address, `host:port`.
pub fn socket(ctx: &Ctx<'_>, key: &str, v: &str) -> Result<SocketAddr, ConfigError> {
    v.parse().map_err(|_| {
        ctx.value(
            key,
            format!("expected an address like 127.0.0.1:9400, got `{v}`"),
        )
    })
}

/// A `device` key: `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
pub fn device(ctx: &Ctx<'_>, key: &str, value: &str) -> Result<Device, ConfigError> {
    Device::from_str(value)
        .map_err(|()| ctx.value(key, format!("expected cpu, cuda or cuda:N, got `{value}`")))
}

/// A role's `device` key, `default` (another key's device) when absent.
pub fn role_device(
    ctx: &Ctx<'_>,
    key: &str,
    value: Option<&str>,
    default: Device,
) -> Result<Device, ConfigError> {
    value.map_or(Ok(default), |v| device(ctx, key, v))
}
