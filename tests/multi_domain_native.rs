//! The multi-domain native recipe, shortened: `sluice run configs/multi_domain_native.toml` as a
//! user runs it (the binary, the shipped config and template, the embedded tiny model), with a
//! short warm-start and a few RL steps so it fits in CI.
//!
//! What it checks:
//! - the warm-start probes every domain (math, tools, agent) on its own training problems;
//! - every evaluation scores every domain's held-out split (`eval_accuracy.<domain>` in
//!   `metrics.jsonl`, per-domain lines in the summary, the `eval` line of `sluice status` while
//!   the run goes), and `eval_accuracy` is their mean;
//! - every domain's rollouts reach the trainer: the trained groups of each domain are logged, and
//!   over the run the mix stays near its 40/30/30 target although tool and agent episodes take
//!   several turns;
//! - the multi-turn domains' turns reach the trainer with their situation labels (`tool_call`,
//!   `answer`, `move`, `invalid`, …) and the situational baseline: within each (group × situation)
//!   the advantages sum to zero, so every situation's mean advantage is 0 while its absolute
//!   mean (the signal) is not, for at least one situation.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

const RL_STEPS: u64 = 8;
const DOMAINS: [&str; 3] = ["math", "tools", "agent"];
const TARGET_MIX: [f64; 3] = [0.4, 0.3, 0.3];

#[test]
fn the_multi_domain_recipe_evaluates_every_domain_and_trains_situations() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("run");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // A free port for the admin API, so `sluice status` can follow the run.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sets = [
        format!("run.output_dir={}", out_dir.display()),
        format!("run.max_steps={RL_STEPS}"),
        "warmup.max_steps=20".to_owned(),
        "warmup.check_every=10".to_owned(),
        "warmup.probe_samples=8".to_owned(),
        "eval.every_steps=4".to_owned(),
        "eval.samples=8".to_owned(),
        // Without padding every (group × situation) bucket is its own zero-sum baseline, which
        // the advantage check below relies on; the shipped recipe pads (docs/trainer.md).
        "trainer.pad_situations=false".to_owned(),
        // Keep the signal-less buckets, so every env's labels reach the trainer even when the
        // short warm-start left a domain without reward.
        "trainer.drop_zero_signal_situations=false".to_owned(),
        "metrics.enabled=false".to_owned(),
        format!("admin.listen=127.0.0.1:{port}"),
    ];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    // The config names its template relative to the repository root.
    cmd.current_dir(root)
        .arg("run")
        .arg("configs/multi_domain_native.toml");
    for s in &sets {
        cmd.arg("--set").arg(s);
    }
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Follow the run with `sluice status` until it ends, keeping the evaluation lines seen.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let done = std::sync::Arc::clone(&done);
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
                    .args(["status", "--url", &format!("http://127.0.0.1:{port}")])
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                seen.extend(
                    text.lines()
                        .filter(|l| l.starts_with("eval"))
                        .map(String::from),
                );
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            seen
        })
    };
    let output = child.wait_with_output().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let status_lines = watcher.join().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        output.status
    );
    eprintln!("{stdout}");

    // Warm-up and evaluation lines name every domain.
    let probe = stdout
        .lines()
        .find(|l| l.starts_with("warm-up step"))
        .expect("warm-up progress lines");
    let before = stdout
        .lines()
        .find(|l| l.starts_with("before RL"))
        .expect("the baseline evaluation line");
    for d in DOMAINS {
        assert!(probe.contains(&format!("{d} ")), "{probe}");
        assert!(before.contains(&format!("{d} ")), "{before}");
        assert!(
            stdout
                .lines()
                .any(|l| l.trim_start().starts_with(d) && l.contains("held-out")),
            "summary line of {d}:\n{stdout}"
        );
    }

    // `sluice status` showed the evaluations per domain while the run went.
    let last = status_lines
        .last()
        .unwrap_or_else(|| panic!("no eval line in sluice status"));
    for d in DOMAINS {
        assert!(last.contains(&format!("{d} ")), "{last}");
    }

    let log = std::fs::read_to_string(out_dir.join("metrics.jsonl")).unwrap();
    let records: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let rl: Vec<&Value> = records.iter().filter(|r| r["phase"] == "rl").collect();
    assert_eq!(rl.len() as u64, RL_STEPS, "one record per RL step");

    // Every evaluation scores every domain; the run's accuracy is their mean.
    let evaluated: Vec<&&Value> = rl.iter().filter(|r| r["eval_accuracy"].is_f64()).collect();
    assert_eq!(evaluated.len(), 2, "steps 4 and 8 evaluated");
    for r in &evaluated {
        let each: Vec<f64> = DOMAINS
            .iter()
            .map(|d| r[format!("eval_accuracy.{d}")].as_f64().expect(d))
            .collect();
        for a in &each {
            assert!((0.0..=1.0).contains(a), "{r}");
        }
        let mean = each.iter().sum::<f64>() / 3.0;
        assert!(
            (r["eval_accuracy"].as_f64().unwrap() - mean).abs() < 1e-9,
            "{r}"
        );
    }

    // Every domain's groups reach the trainer, near the target mix.
    let mut groups: BTreeMap<&str, f64> = BTreeMap::new();
    for r in &rl {
        for d in DOMAINS {
            *groups.entry(d).or_default() += r[format!("groups.{d}")].as_f64().unwrap_or(0.0);
        }
    }
    let total: f64 = groups.values().sum();
    assert!(total > 0.0, "{groups:?}");
    for (d, target) in DOMAINS.iter().zip(TARGET_MIX) {
        let share = groups[d] / total;
        // Eight steps of 12 groups: the adaptive mix holds each share within 10 points (the
        // shipped run's 150 steps hold 3).
        assert!(
            (share - target).abs() <= 0.10,
            "{d}: {share:.3} vs {target} ({groups:?})"
        );
    }

    // Situations reach the trainer with the situational baseline.
    let mut seen: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for r in &rl {
        for (key, v) in r.as_object().unwrap() {
            let Some(name) = key
                .strip_prefix("situation.")
                .and_then(|k| k.strip_suffix(".texts"))
            else {
                continue;
            };
            assert!(v.as_f64().unwrap() > 0.0, "{key}");
            let mean = r[format!("situation.{name}.advantage")].as_f64().unwrap();
            let abs = r[format!("situation.{name}.abs_advantage")]
                .as_f64()
                .unwrap();
            assert!(
                mean.abs() < 1e-5,
                "situational baseline: {name} mean {mean}"
            );
            let e = seen.entry(name.to_owned()).or_default();
            e.0 += 1.0;
            e.1 = e.1.max(abs);
        }
    }
    // Each multi-turn domain's turns carry its env's labels (a short warm-start may not have
    // taught the good moves yet, so any of them).
    let labelled = |domain: &str, labels: &[&str]| {
        seen.keys().any(|k| {
            k.strip_prefix(domain)
                .and_then(|k| k.strip_prefix('.'))
                .is_some_and(|l| labels.contains(&l))
        })
    };
    assert!(
        labelled(
            "tools",
            &["tool_call", "tool_error", "answer", "tool_budget"]
        ),
        "tool situations: {seen:?}"
    );
    assert!(
        labelled("agent", &["move", "invalid", "done", "out_of_steps"]),
        "agent situations: {seen:?}"
    );
    assert!(
        seen.values().any(|(_, abs)| *abs > 0.0),
        "some situation carries a signal: {seen:?}"
    );
}
