//! `sluice replay clear` against a running node: refused while the run trains, forced anyway,
//! allowed once paused and settled; the cleared groups are never trained, admission reopens for
//! them, and the run goes on with its staleness rule intact.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use sluice_actors::{Node, NodeOptions};
use sluice_replay::Bucket;

const TOKEN: &str = "cli-replay-token";

fn sluice(args: &[&str], dir: &Path) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .current_dir(dir)
        .env("SLUICE_ADMIN_TOKEN", TOKEN)
        .output()
        .expect("run sluice");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Groups cleared per bucket, read back from the CLI's line
/// `cleared 3 completed, 0 aborted, 1 expired groups (…)`.
fn cleared(line: &str, bucket: &str) -> u64 {
    line.split([',', ' '])
        .collect::<Vec<_>>()
        .windows(2)
        .find(|w| w[1] == bucket)
        .and_then(|w| w[0].parse().ok())
        .unwrap_or_else(|| panic!("no count for {bucket} in {line:?}"))
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out: {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn replay_clear_is_refused_while_training_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Generation far faster than training and admission up to the η ceiling, so completed
    // groups wait in the store.
    let config = sluice_core::config::parse(
        &format!(
            r#"
[run]
name = "cli-replay"
max_steps = 1000000
[engine]
backend = "simulated"
replicas = 1
[engine.simulated]
decode_step_base_seconds = 0.001
[trainer.simulated]
step_base_seconds = 0.4
[metrics]
enabled = false
[replay]
filter_zero_advantage = false
[rollout]
group_size = 2
groups_per_step = 2
max_new_tokens = 32
max_version_lag = 3
admission = "eta"
[admin]
listen = "127.0.0.1:0"
token = "{TOKEN}"
"#
        ),
        "cli_replay.toml",
        &[],
        &|_| None,
    )
    .unwrap();
    let options = NodeOptions {
        serve_admin: true,
        ..NodeOptions::default()
    };
    let node = runtime.block_on(Node::start(&config, options)).unwrap();
    let url = format!("http://{}", node.admin_addr().unwrap());
    let d = dir.path();
    let h = &node.handles;
    let replay = |bucket: Bucket| {
        let status = runtime.block_on(h.replay.status()).unwrap();
        status.store.buckets[bucket.as_label()]
    };

    wait_until("completed groups waiting", || {
        replay(Bucket::Completed) >= 3
    });
    let (code, _, err) = sluice(&["replay", "clear", "--url", &url], d);
    assert_eq!(code, 1, "training: refused");
    assert!(
        err.contains("409") && err.contains("the run is training (admission is open)"),
        "{err}"
    );
    assert_eq!(
        replay(Bucket::Cleared),
        0,
        "a refused clear changes nothing"
    );
    let (code, _, err) = sluice(
        &[
            "replay",
            "clear",
            "--force",
            "--bucket",
            "in_flight",
            "--url",
            &url,
        ],
        d,
    );
    assert_eq!(code, 1);
    assert!(
        err.contains(
            "bucket `in_flight` cannot be cleared: expected one of completed, aborted, expired"
        ),
        "{err}"
    );

    // Forced: the groups at rest go, the ones generating keep going.
    let (code, out, err) = sluice(&["replay", "clear", "--force", "--url", &url], d);
    assert_eq!(code, 0, "{err}");
    let forced = cleared(&out, "completed") + cleared(&out, "aborted") + cleared(&out, "expired");
    assert!(cleared(&out, "completed") >= 1, "{out}");
    assert_eq!(replay(Bucket::Cleared), forced);

    // Paused and settled: allowed without force.
    let (code, _, err) = sluice(&["pause", "--url", &url], d);
    assert_eq!(code, 0, "{err}");
    wait_until("in-flight groups settle", || {
        replay(Bucket::Pending) + replay(Bucket::InFlight) == 0
    });
    let (code, out, err) = sluice(&["replay", "clear", "--url", &url], d);
    assert_eq!(code, 0, "{err}");
    let settled = cleared(&out, "completed") + cleared(&out, "aborted") + cleared(&out, "expired");
    assert_eq!(replay(Bucket::Cleared), forced + settled);
    for bucket in Bucket::CLEARABLE {
        assert_eq!(replay(bucket), 0, "{bucket} emptied");
    }

    // Admission reopens for the cleared groups, and the run trains on fresh ones.
    let steps = h.trainer.status().steps;
    let (code, _, err) = sluice(&["resume", "--url", &url], d);
    assert_eq!(code, 0, "{err}");
    wait_until("two more steps after the clear", || {
        h.trainer.status().steps >= steps + 2
    });
    let trainer = h.trainer.status();
    assert_eq!(trainer.lag_violations, 0);
    assert_eq!(trainer.duplicate_groups, 0);
    let counters = runtime.block_on(h.replay.status()).unwrap().store.counters;
    assert_eq!(
        counters
            .transitions
            .iter()
            .filter(|(k, _)| k.ends_with("->cleared"))
            .map(|(_, v)| v)
            .sum::<u64>(),
        forced + settled
    );

    runtime.block_on(node.shutdown());
}
