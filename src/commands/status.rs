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
    for (label, text) in rollout_lines(&s["controller"], &s["trainer"]) {
        line(label, text);
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

/// Seconds with a unit, `-` when not measured yet.
fn seconds(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "-".to_owned(), |s| format!("{s:.2}s"))
}

/// What the rollouts look like per domain, the length bias and the train/inference mismatch,
/// as (label, text) lines; none for a part the status lacks.
fn rollout_lines(controller: &Value, trainer: &Value) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if let Some(domains) = controller["shape"].as_object() {
        for (domain, d) in domains {
            let reasons: Vec<String> = d["finish_reasons"]
                .as_object()
                .map(|r| r.iter().map(|(k, v)| format!("{k} {v}")).collect())
                .unwrap_or_default();
            out.push((
                "rollouts",
                format!(
                    "{domain}: {} tokens mean (p50 {}, p90 {}, max {}) · {:.1} turns · truncated {:.2} · {}",
                    num(&d["response_tokens_mean"]).round(),
                    d["response_tokens_p50"],
                    d["response_tokens_p90"],
                    d["response_tokens_max"],
                    num(&d["turns_mean"]),
                    num(&d["truncated_ratio"]),
                    reasons.join(", "),
                ),
            ));
            out.push((
                "",
                format!(
                    "{domain}: group {} from admission to stored · per rollout engine {} · env {}",
                    seconds(&d["group_seconds"]),
                    seconds(&d["engine_seconds"]),
                    seconds(&d["env_seconds"]),
                ),
            ));
        }
    }
    let b = &controller["length_bias"];
    if b.is_object() {
        out.push((
            "lengths",
            format!(
                "generated {:.0} tokens mean · trained {:.0} · length bias {:+.1}% · KS {:.3} (last {} generated, {} trained)",
                num(&b["generated_mean"]),
                num(&b["trained_mean"]),
                100.0 * num(&b["bias_ratio"]),
                num(&b["ks_distance"]),
                b["generated_rollouts"],
                b["trained_rollouts"],
            ),
        ));
    }
    let m = &trainer["mismatch"];
    if m.is_object() {
        out.push((
            "mismatch",
            format!(
                "step {} · |Δ logprob| mean {:.2e} max {:.2e} · KL {:.2e} nats · {} tokens at lag 0",
                m["step"],
                num(&m["logprob_abs_mean"]),
                num(&m["logprob_abs_max"]),
                num(&m["kl"]),
                m["tokens"],
            ),
        ));
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
            "controller": {"balance": {"threshold": 0.25, "below_ratio": 0.5, "above_ratio": 0.125, "outcome_ema": 0.4},
                           "shape": {"math": {"response_tokens_mean": 120.4, "response_tokens_p50": 96, "response_tokens_p90": 240,
                                              "response_tokens_max": 512, "turns_mean": 1.0, "truncated_ratio": 0.25,
                                              "finish_reasons": {"completed": 30, "truncated": 10},
                                              "group_seconds": 3.5, "engine_seconds": 2.25, "env_seconds": null}},
                           "length_bias": {"generated_rollouts": 40, "trained_rollouts": 32, "generated_mean": 120.4,
                                           "trained_mean": 100.0, "ks_distance": 0.125, "bias_ratio": -0.17}},
            "trainer": {"mismatch": {"step": 7, "tokens": 300, "logprob_abs_mean": 0.0001, "logprob_abs_max": 0.002, "kl": 1e-7}},
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
            "rollouts  math: 120 tokens mean (p50 96, p90 240, max 512) · 1.0 turns · truncated 0.25 · completed 30, truncated 10",
            "          math: group 3.50s from admission to stored · per rollout engine 2.25s · env -",
            "lengths   generated 120 tokens mean · trained 100 · length bias -17.0% · KS 0.125 (last 40 generated, 32 trained)",
            "mismatch  step 7 · |Δ logprob| mean 1.00e-4 max 2.00e-3 · KL 1.00e-7 nats · 300 tokens at lag 0",
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
