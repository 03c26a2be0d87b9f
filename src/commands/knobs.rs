//! `sluice knobs get` and `sluice knobs set key=value...`: the CLI face of the admin API's
//! `GET/PATCH /v1/knobs`. The token comes from `$SLUICE_ADMIN_TOKEN`.

use std::process::ExitCode;

use anyhow::{Context, bail};
use sluice_actors::client::request;
use sluice_core::KnobPatch;
use sluice_core::config::ADMIN_TOKEN_ENV;

use crate::cli::{KnobsAction, KnobsArgs};

/// Calls the admin API and prints its JSON answer.
pub fn run(args: &KnobsArgs) -> anyhow::Result<ExitCode> {
    let token = std::env::var(ADMIN_TOKEN_ENV).ok();
    let (code, body) = match &args.action {
        KnobsAction::Get => request(&args.admin, "GET", "/v1/knobs", None, None)?,
        KnobsAction::Set { assignments } => {
            let patch = KnobPatch::from_assignments(assignments)?;
            if patch.is_empty() {
                bail!("nothing to set: give knob=value pairs");
            }
            let body = serde_json::to_string(&patch).context("encoding the patch")?;
            request(
                &args.admin,
                "PATCH",
                "/v1/knobs",
                Some(&body),
                token.as_deref(),
            )?
        }
    };
    let pretty = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or(body);
    if code != 200 {
        bail!("admin API answered {code}: {pretty}");
    }
    println!("{pretty}");
    Ok(ExitCode::SUCCESS)
}
