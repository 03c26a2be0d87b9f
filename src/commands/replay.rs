//! `sluice replay clear [--force] [--bucket B]...`: the CLI face of the admin API's
//! `POST /v1/replay/clear`. The API's address and token resolve as for `sluice status`.

use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use sluice_actors::client::request;

use super::status::{reason, target};
use crate::cli::ReplayClearArgs;

/// Calls the admin API and prints what was cleared.
pub fn clear(args: &ReplayClearArgs) -> anyhow::Result<ExitCode> {
    let t = target(&args.target)?;
    let mut body = json!({ "force": args.force });
    if !args.buckets.is_empty() {
        body["buckets"] = json!(args.buckets);
    }
    let (code, answer) = request(
        &t.url,
        "POST",
        "/v1/replay/clear",
        Some(&body.to_string()),
        t.token.as_deref(),
    )?;
    if code != 200 {
        bail!("admin API answered {code}: {}", reason(&answer));
    }
    let v: Value = serde_json::from_str(&answer).context("decoding the admin API's answer")?;
    let counts: Vec<String> = v["cleared"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(bucket, n)| format!("{} {bucket}", n.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    println!(
        "cleared {} groups ({} generated tokens discarded)",
        counts.join(", "),
        v["discarded_tokens"].as_u64().unwrap_or(0)
    );
    Ok(ExitCode::SUCCESS)
}
