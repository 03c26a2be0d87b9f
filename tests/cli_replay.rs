//! `sluice replay clear` against a running node: refused while the run trains, forced anyway,
//! allowed once paused and settled; the cleared groups are never trained, admission reopens for
//! them, and the run goes on with its staleness rule intact. With `--store`, a stopped run's
//! store on disk, refused while another process holds it.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use sluice_core::{
    DataSample, GroupId, NodeId, PolicyVersion, RolloutGroup, RolloutStatus, RolloutTurn, RunId,
};
use sluice_node::{Node, NodeOptions};
use sluice_replay::{Bucket, Persister, ReplayStore};

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
    let config = sluice_config::parse(
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
        status.store.buckets[&bucket]
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
            .filter(|(t, _)| t.to == Bucket::Cleared)
            .map(|(_, v)| v)
            .sum::<u64>(),
        forced + settled
    );

    runtime.block_on(node.shutdown());
}

/// Group `counter` with two rollouts of two generated tokens each, ended with `status`.
fn generated(counter: u64, status: RolloutStatus) -> RolloutGroup {
    let sample = DataSample {
        id: counter.to_string(),
        domain: "math".into(),
        dataset: "math".into(),
        input: serde_json::Value::Null,
        system_prompt: None,
    };
    let id = GroupId {
        run: RunId::from_name("stopped"),
        node: NodeId(0),
        counter,
    };
    let mut group = RolloutGroup::new(id, sample, 2, PolicyVersion(0));
    for (i, r) in group.rollouts.iter_mut().enumerate() {
        let mut turn = RolloutTurn::new(vec![1, 2, 3]);
        turn.append_tokens(&[7, 8], &[-0.5, -0.5], &[PolicyVersion(0); 2])
            .unwrap();
        r.turns.push(turn);
        r.status = status.clone();
        r.reward = i as f64;
    }
    group
}

#[test]
fn replay_clear_on_a_stopped_store() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("replay");
    let arg = store_dir.to_str().unwrap();
    let d = dir.path();
    let (code, _, err) = sluice(&["replay", "clear", "--store", arg], d);
    assert_eq!(code, 1);
    assert!(err.contains("no replay store here"), "{err}");
    assert!(!store_dir.exists(), "nothing is created");

    // A run that stopped with one group completed, one aborted and one in flight.
    let (db, _) = Persister::open(&store_dir).unwrap();
    let mut store = ReplayStore::new(false, true);
    for c in 0..3 {
        let ended = generated(c, RolloutStatus::Ongoing);
        store
            .admit(RolloutGroup::new(
                ended.id,
                ended.sample,
                2,
                PolicyVersion(0),
            ))
            .unwrap();
    }
    store
        .finish(generated(0, RolloutStatus::Completed), PolicyVersion(0), 1)
        .unwrap();
    store.abort(generated(1, RolloutStatus::Aborted)).unwrap();
    db.apply(&store.drain_outbox()).unwrap();

    // While a node holds the database, the CLI leaves it alone.
    let (code, _, err) = sluice(&["replay", "clear", "--store", arg], d);
    assert_eq!(code, 1, "held: refused");
    assert!(
        err.contains("replay.redb") && err.contains("clear through its admin API"),
        "{err}"
    );
    drop(db);

    let (code, out, err) = sluice(
        &["replay", "clear", "--store", arg, "--bucket", "completed"],
        d,
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.trim(),
        "cleared 1 completed groups (4 generated tokens discarded)"
    );
    // The in-flight group of the stopped run is aborted on recovery, as a restarted run would
    // see it, and goes with the aborted one.
    let (code, out, err) = sluice(&["replay", "clear", "--store", arg], d);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.trim(),
        "cleared 0 completed, 2 aborted, 0 expired groups (4 generated tokens discarded)"
    );
    let (_, recovered) = Persister::open(&store_dir).unwrap();
    assert!(recovered.groups.is_empty(), "every group is gone from disk");
    let store = ReplayStore::recover(false, true, recovered.counters, recovered.groups);
    assert_eq!(store.count(Bucket::Cleared), 3);
    assert_eq!(store.counters().admitted_load(), 0);
    store.reconcile().unwrap();
}
