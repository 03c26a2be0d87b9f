//! `sluice knobs get` and `sluice knobs set key=value...`: the CLI face of the admin API's
//! `GET/PATCH /v1/knobs`. The API's address and token resolve as for `sluice status`
//! (`--url`/`--admin`, `--token`, `$SLUICE_ADMIN_TOKEN`, `--config`).

use std::process::ExitCode;

use anyhow::{Context, bail};
use sluice_core::KnobPatch;
use sluice_node::client::request;

use super::status::{pretty, reason, target};
use crate::cli::{KnobsAction, KnobsArgs};

/// Calls the admin API and prints its JSON answer.
pub fn run(args: &KnobsArgs) -> anyhow::Result<ExitCode> {
    let t = target(&args.target)?;
    let (code, body) = match &args.action {
        KnobsAction::Get => request(&t.url, "GET", "/v1/knobs", None, None)?,
        KnobsAction::Set { assignments } => {
            // Parsed here too, so a typo is refused before any call, with the same message.
            let patch = KnobPatch::from_assignments(assignments)?;
            if patch.is_empty() {
                bail!("nothing to set: give knob=value pairs");
            }
            let body = serde_json::to_string(&patch).context("encoding the patch")?;
            request(
                &t.url,
                "PATCH",
                "/v1/knobs",
                Some(&body),
                t.token.as_deref(),
            )?
        }
    };
    if code != 200 {
        bail!("admin API answered {code}: {}", reason(&body));
    }
    println!("{}", pretty(&body));
    Ok(ExitCode::SUCCESS)
}
