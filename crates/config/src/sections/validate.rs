//! Phase two of the node-level sections: raw section → typed section. The composition calls these
//! in order and resolves what depends on other sections before it passes it in.

use std::num::NonZeroU64;
use std::path::PathBuf;

use sluice_core::config::check::{Ctx, socket, u64_incl_zero};
use sluice_core::config::{ConfigError, REDACTED, Secret};

use super::raw::*;
use super::typed::*;
use crate::ADMIN_TOKEN_ENV;

mod node;
mod quickstart;
mod rollout;
mod supervision;

pub use node::validate_node;
pub use quickstart::{validate_eval, validate_warmup};
pub use rollout::validate_rollout;
pub use supervision::{validate_faults, validate_supervision};

/// Phase two of `[run]`.
pub fn validate_run(raw: RawRun, ctx: &Ctx<'_>) -> Result<RunConfig, ConfigError> {
    let valid_name = !raw.name.is_empty()
        && raw
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if !valid_name {
        return Err(ctx.value(
            "run.name",
            format!(
                "expected a non-empty name of [A-Za-z0-9._-], got `{}`",
                raw.name
            ),
        ));
    }
    let output_dir = match raw.output_dir {
        Some(d) if d.trim().is_empty() => {
            return Err(ctx.value(
                "run.output_dir",
                "expected a directory path, got an empty string",
            ));
        }
        Some(d) => PathBuf::from(d),
        None => PathBuf::from("runs").join(&raw.name),
    };
    let seed = u64_incl_zero(ctx, "run.seed", raw.seed)?;
    let max_steps = u64::try_from(raw.max_steps)
        .ok()
        .and_then(NonZeroU64::new)
        .ok_or_else(|| {
            ctx.value(
                "run.max_steps",
                format!("expected an integer ≥ 1, got {}", raw.max_steps),
            )
        })?;
    Ok(RunConfig {
        name: raw.name,
        output_dir,
        seed,
        max_steps,
    })
}

/// Phase two of `[admin]`; the token falls back to `$SLUICE_ADMIN_TOKEN`.
pub fn validate_admin(raw: RawAdmin, ctx: &Ctx<'_>) -> Result<AdminConfig, ConfigError> {
    let listen = socket(ctx, "admin.listen", &raw.listen)?;
    let (token, via_env) = match raw.token {
        Some(t) => (Some(t), false),
        None => ((ctx.env)(ADMIN_TOKEN_ENV), true),
    };
    let token = match token {
        // `<redacted>` is what `sluice check` prints in the token's place: a config saved from
        // that output would otherwise run with the placeholder as its token.
        Some(t) if t.trim().is_empty() || t == REDACTED => {
            let e = ctx.value(
                "admin.token",
                if t == REDACTED {
                    "`<redacted>` is the placeholder `sluice check` prints; set the real token"
                } else {
                    "expected a non-empty token, got an empty string"
                },
            );
            return Err(if via_env {
                e.via(format!("${ADMIN_TOKEN_ENV}"))
            } else {
                e
            });
        }
        // Surrounding whitespace is not part of a token (a Kubernetes Secret made from a file
        // ends in a newline); every caller trims the same way (`sluice_http::auth::token`).
        Some(t) => Some(Secret::new(t.trim())),
        None => None,
    };
    if token.is_none() && !listen.ip().is_loopback() {
        return Err(ctx.value(
            "admin.listen",
            format!(
                "{listen} is not a loopback address; set admin.token or ${ADMIN_TOKEN_ENV} to expose the admin API"
            ),
        ));
    }
    Ok(AdminConfig { listen, token })
}
