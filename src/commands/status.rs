//! `sluice status [--json]`, `sluice pause` and `sluice resume`: the CLI faces of the admin API's
//! `GET /v1/status`, `POST /v1/pause` and `POST /v1/resume`, and [`target`], which resolves where
//! the API is and its token for every admin command (`sluice knobs` too).
//!
//! `sluice status` exits 0 when every actor is running or done, 2 when one failed or is
//! unreachable (so a cron job or probe can alert on it), and 1 when the API cannot be reached.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::Value;
use sluice_config::ADMIN_TOKEN_ENV;
use sluice_node::client::request;

use crate::cli::{AdminArgs, StatusArgs};

/// The admin API's address when neither `--url` nor `--config` says.
const DEFAULT_URL: &str = "http://127.0.0.1:9401";

/// Where to call and with which token.
pub(super) struct Target {
    /// `http://host:port`.
    pub url: String,
    /// Bearer token, if any.
    pub token: Option<String>,
}

/// Resolves `--url`/`--token`, then `$SLUICE_ADMIN_TOKEN`, then `--config`, then the default.
pub(super) fn target(args: &AdminArgs) -> anyhow::Result<Target> {
    let config = match &args.config {
        Some(path) if args.url.is_none() || args.token.is_none() => {
            Some(sluice_config::load(path, &[])?)
        }
        _ => None,
    };
    let url = match (&args.url, &config, &args.config) {
        (Some(url), _, _) => url.clone(),
        (None, Some(c), Some(path)) => {
            let listen = c.admin.listen;
            if listen.port() == 0 {
                bail!(
                    "{}: admin.listen has port 0 (picked at start-up); pass --url",
                    path.display()
                );
            }
            // A node listening on every address is reached on loopback.
            let ip = match listen.ip() {
                IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
                ip => ip,
            };
            format!("http://{}", std::net::SocketAddr::new(ip, listen.port()))
        }
        _ => DEFAULT_URL.to_owned(),
    };
    // Trimmed as the node trims its own (`admin.token`): a token file's newline is not part of it.
    let token = args
        .token
        .clone()
        .or_else(|| std::env::var(ADMIN_TOKEN_ENV).ok())
        .and_then(|t| sluice_http::auth::token(&t))
        .map(|t| t.expose().to_owned())
        .or_else(|| {
            config
                .as_ref()
                .and_then(|c| c.admin.token.as_ref().map(|t| t.expose().to_owned()))
        });
    Ok(Target { url, token })
}

/// Pretty JSON when `body` is JSON, the text itself otherwise.
pub(super) fn pretty(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| body.to_owned())
}

/// The reason of an admin API refusal (`{"error": {"message"}}`), or the body as it is.
pub(super) fn reason(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| body.trim().to_owned())
}

/// `sluice status`: calls `GET /v1/status` and prints the summary (or the JSON).
pub fn run(args: &StatusArgs) -> anyhow::Result<ExitCode> {
    let t = target(&args.target)?;
    let (code, body) = request(&t.url, "GET", "/v1/status", None, None)?;
    if code != 200 {
        bail!("admin API answered {code}: {}", reason(&body));
    }
    let status: Value = serde_json::from_str(&body).context("decoding /v1/status")?;
    if args.json {
        println!("{}", pretty(&body));
    } else {
        print!("{}", summary(&status));
    }
    let healthy = status["actors"].as_object().is_some_and(|actors| {
        actors
            .values()
            .all(|a| matches!(a["health"].as_str(), Some("running" | "done")))
    });
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

/// `sluice pause` / `sluice resume`: `POST /v1/pause|resume` with the token.
pub fn set_paused(args: &AdminArgs, paused: bool) -> anyhow::Result<ExitCode> {
    let t = target(args)?;
    let path = if paused { "/v1/pause" } else { "/v1/resume" };
    let (code, body) = request(&t.url, "POST", path, None, t.token.as_deref())?;
    if code != 200 {
        bail!("admin API answered {code}: {}", reason(&body));
    }
    let changed = serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|v| v["changes"].as_array().map(|c| !c.is_empty()))
        .unwrap_or(false);
    let state = if paused { "paused" } else { "admitting" };
    if changed {
        println!("{state}");
    } else {
        println!("already {state}");
    }
    Ok(ExitCode::SUCCESS)
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// The human summary of a `/v1/status` answer, a few aligned lines.
pub(super) fn summary(s: &Value) -> String {
    let mut out = String::new();
    let mut line = |label: &str, text: String| out.push_str(&format!("{label:<10}{text}\n"));
    let state = if s["paused"].as_bool() == Some(true) {
        "PAUSED (admitting nothing)"
    } else {
        "admitting"
    };
    line(
        "node",
        format!(
            "sluice {} · up {} · {state}",
            s["sluice_version"].as_str().unwrap_or("?"),
            duration(num(&s["uptime_seconds"]))
        ),
    );
    line(
        "training",
        format!(
            "step {} · policy version {}",
            s["step"], s["policy_version"]
        ),
    );
    let r = &s["rates"];
    line(
        "rates",
        format!(
            "{:.1} steps/min · {:.1} samples/s · {:.0} trained tok/s · {:.0} generated tok/s (last {:.0}s)",
            num(&r["steps_per_minute"]),
            num(&r["trained_samples_per_second"]),
            num(&r["trained_tokens_per_second"]),
            num(&r["generated_tokens_per_second"]),
            num(&r["window_seconds"]),
        ),
    );
    line(
        "ratios",
        format!(
            "engine busy {:.2} · trainer idle {:.2} · mean version lag {:.2}",
            num(&r["engine_busy_ratio"]),
            num(&r["trainer_idle_ratio"]),
            num(&r["mean_version_lag"]),
        ),
    );
    let balance = &s["controller"]["balance"];
    if balance.is_object() {
        let ema = balance["outcome_ema"]
            .as_f64()
            .map_or_else(|| "none yet".to_owned(), |e| format!("{e:.2}"));
        line(
            "rewards",
            format!(
                "outcome EMA {ema} · balance threshold {} · groups below {:.2} · above {:.2}",
                balance["threshold"],
                num(&balance["below_ratio"]),
                num(&balance["above_ratio"]),
            ),
        );
    }
    let e = &s["evaluation"];
    if e.is_object() {
        let domains: Vec<String> = e["domains"]
            .as_object()
            .map(|d| {
                d.iter()
                    .map(|(name, a)| format!("{name} {:.1}%", 100.0 * num(&a["heldout_accuracy"])))
                    .collect()
            })
            .unwrap_or_default();
        let each = if domains.is_empty() {
            String::new()
        } else {
            format!(" ({})", domains.join(", "))
        };
        line(
            "eval",
            format!(
                "step {} · held-out {:.1}%{each} · training problems {:.1}%",
                e["step"],
                100.0 * num(&e["heldout_accuracy"]),
                100.0 * num(&e["train_accuracy"]),
            ),
        );
    }
    let buckets = match s["buckets"].as_object() {
        Some(b) => b
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(" · "),
        None => "unknown (replay store unreachable)".to_owned(),
    };
    line("buckets", buckets);
    if let Some(knobs) = s["knobs"].as_object() {
        let text: Vec<String> = knobs
            .iter()
            .map(|(k, v)| match v {
                Value::String(x) => format!("{k}={x}"),
                other => format!("{k}={other}"),
            })
            .collect();
        line("knobs", text.join(" "));
    }
    if let Some(actors) = s["actors"].as_object() {
        let text: Vec<String> = actors
            .iter()
            .map(|(name, a)| {
                let health = a["health"].as_str().unwrap_or("?");
                match a["detail"].as_str() {
                    Some(d) => format!("{name} {health} ({d})"),
                    None => format!("{name} {health}"),
                }
            })
            .collect();
        line("actors", text.join(" · "));
    }
    if let Some(nodes) = s["nodes"].as_array() {
        line("nodes", format!("{} joined", nodes.len()));
        for n in nodes {
            let version = n["weight_version"]
                .as_u64()
                .map_or_else(|| "-".to_owned(), |v| format!("v{v}"));
            let replica = n["replica"]
                .as_u64()
                .map_or_else(String::new, |r| format!(" · replica {r}"));
            // Why the head cannot reach it (an engine node), and when it probes it again.
            let unreachable = n["unreachable"]["reason"]
                .as_str()
                .map_or_else(String::new, |why| {
                    format!(
                        " · unreachable ×{} ({why}); probed again in {:.1}s",
                        n["unreachable"]["times"].as_u64().unwrap_or(0),
                        num(&n["unreachable"]["next_probe_seconds"]),
                    )
                });
            line(
                "",
                format!(
                    "{} {} {} {} · weights {version} · load {} · seen {:.1}s ago{replica}{unreachable}",
                    n["name"].as_str().unwrap_or("?"),
                    n["role"].as_str().unwrap_or("?"),
                    n["url"].as_str().unwrap_or("?"),
                    n["health"].as_str().unwrap_or("?"),
                    n["load"]
                        .as_u64()
                        .map_or_else(|| "-".to_owned(), |l| l.to_string()),
                    num(&n["last_seen_seconds"]),
                ),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_names_every_part() {
        let status = serde_json::json!({
            "sluice_version": "0.1.0", "uptime_seconds": 3725.0, "policy_version": 7, "step": 7,
            "paused": true, "buckets": {"completed": 2, "consumed": 28},
            "rates": {"window_seconds": 10.0, "steps_per_minute": 6.0, "trained_samples_per_second": 4.5,
                      "trained_tokens_per_second": 900.0, "generated_tokens_per_second": 1200.0,
                      "engine_busy_ratio": 0.9, "trainer_idle_ratio": 0.2, "mean_version_lag": 0.5},
            "knobs": {"max_version_lag": 1, "weight_update_mode": "in_flight"},
            "actors": {"engine": {"health": "running"}, "trainer": {"health": "failed", "detail": "nan loss"}},
            "controller": {"balance": {"threshold": 0.25, "below_ratio": 0.5, "above_ratio": 0.125, "outcome_ema": 0.4}},
            "nodes": [{"name": "engine-a", "role": "engine", "url": "http://10.0.0.2:8000", "health": "lost",
                       "incarnation": 3, "last_seen_seconds": 7.25, "weight_version": 6, "load": 2, "replica": 1},
                      {"name": "engine-b", "role": "engine", "url": "http://10.0.0.3:8000", "health": "unreachable",
                       "incarnation": 4, "last_seen_seconds": 0.5, "weight_version": null, "load": 0,
                       "unreachable": {"reason": "connect: Connection refused", "times": 2, "next_probe_seconds": 1.5}}],
            "evaluation": {"step": 50, "heldout_accuracy": 0.167, "train_accuracy": 0.141,
                           "domains": {"agent": {"heldout_accuracy": 0.328, "train_accuracy": 0.2},
                                       "math": {"heldout_accuracy": 0.174, "train_accuracy": 0.2}}},
        });
        let text = summary(&status);
        for needle in [
            "up 1h02m",
            "PAUSED",
            "step 7 · policy version 7",
            "6.0 steps/min",
            "engine busy 0.90",
            "completed 2 · consumed 28",
            "max_version_lag=1 weight_update_mode=in_flight",
            "trainer failed (nan loss)",
            "outcome EMA 0.40 · balance threshold 0.25 · groups below 0.50 · above 0.12",
            "nodes     2 joined",
            "engine-a engine http://10.0.0.2:8000 lost · weights v6 · load 2 · seen 7.2s ago · replica 1",
            "engine-b engine http://10.0.0.3:8000 unreachable · weights - · load 0 · seen 0.5s ago · unreachable ×2 (connect: Connection refused); probed again in 1.5s",
            "eval      step 50 · held-out 16.7% (agent 32.8%, math 17.4%) · training problems 14.1%",
        ] {
            assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
        }
    }

    #[test]
    fn refusals_show_their_reason() {
        let body = r#"{"error": {"message": "wrong bearer token", "type": "unauthorized"}}"#;
        assert_eq!(reason(body), "wrong bearer token");
        assert_eq!(reason("plain"), "plain");
    }
}
