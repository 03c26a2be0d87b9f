//! `sluice replay clear [--force] [--bucket B]...`: the CLI face of the admin API's
//! `POST /v1/replay/clear`. The API's address and token resolve as for `sluice status`. With
//! `--store DIR` it clears a stopped run's store on disk instead.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use sluice_node::client::request;
use sluice_replay::Bucket;

use super::status::{reason, target};
use crate::cli::ReplayClearArgs;

/// Calls the admin API (or opens the stopped store) and prints what was cleared.
pub fn clear(args: &ReplayClearArgs) -> anyhow::Result<ExitCode> {
    if let Some(dir) = &args.store {
        return clear_stopped(dir, &args.buckets);
    }
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
    print_cleared(&v);
    Ok(ExitCode::SUCCESS)
}

fn clear_stopped(dir: &Path, names: &[String]) -> anyhow::Result<ExitCode> {
    let buckets = if names.is_empty() {
        Bucket::CLEARABLE.to_vec()
    } else {
        names
            .iter()
            .map(|n| {
                Bucket::CLEARABLE
                    .into_iter()
                    .find(|b| b.as_label() == n)
                    .ok_or_else(|| {
                        anyhow::anyhow!("--bucket {n}: expected one of completed, aborted, expired")
                    })
            })
            .collect::<anyhow::Result<_>>()?
    };
    let outcome = sluice_replay::clear_stopped_store(dir, &buckets)?;
    print_cleared(&serde_json::to_value(&outcome).context("encoding the outcome")?);
    Ok(ExitCode::SUCCESS)
}

/// `cleared 3 completed, 1 aborted, 0 expired groups (412 generated tokens discarded)`.
fn print_cleared(v: &Value) {
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
}
