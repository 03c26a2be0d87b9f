//! A run across "machines": real processes on loopback, each 127.0.0.x address standing for a
//! host, each node with its own output directory (no shared disk). A head (tiny native model,
//! remote engine slots), two engine nodes and an env node that join it:
//!
//! - the run's episodes go to the env node because it joined (`env_nodes = true`, no URL in
//!   the head's config): its own counters show the envs it created and stepped; `kill -9` of
//!   it mid-run does not stop the run, and restarted, it joins again and serves episodes again;
//! - both nodes join, get a replica each and serve the head's versions, fetched over HTTP: the
//!   file an engine node loaded is byte for byte the head's, and not its own start weights;
//! - a node with a wrong token is refused with 401, and both sides say so; tokens with a
//!   trailing newline or padding (head, node, CLI) match; a member URL with a path, query or
//!   credentials is refused at the join; an engine node's weight and control routes answer 401
//!   without the node token, and it takes no weights from disk;
//! - `kill -9` of one engine node mid-run: the head loses it, the run goes on with the other,
//!   and a restarted node joins again, gets a replica back and generates;
//! - zero staleness violations throughout;
//! - `kill -9` of the head: restarted with the same config, it resumes from its checkpoint and
//!   replay store, the engine nodes join it again by themselves, and no group is trained twice.
//!
//! And a drill of one dead engine node while the other serves (`lost_after_s` long, so
//! heartbeats alone would keep the dead node "live"): a node that heartbeats but advertises a
//! URL the head cannot reach, then a `kill -9` of a serving node. Neither ends the run: the
//! head marks each unreachable at once, its slot moves to the other node or waits vacant, and
//! none of it counts towards `supervision.engine_max_restarts`.
//!
//! Timings are printed (`-- --nocapture`), never asserted.

use std::fs::File;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_replay::{Persister, ReplayStore};

#[path = "cluster/configs.rs"]
mod configs;
#[path = "cluster/dead_node.rs"]
mod dead_node;
#[path = "cluster/superseded.rs"]
mod superseded;

use configs::*;

const TOKEN: &str = "cluster-test-token";
const B: u64 = 4;

fn free_port(ip: &str) -> u16 {
    let ip: IpAddr = ip.parse().unwrap();
    TcpListener::bind(SocketAddr::new(ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Proc {
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Proc {
    fn start(dir: &Path, config: &Path, tag: &str, token: &str) -> Self {
        Self::start_with(dir, config, tag, token, &[])
    }

    fn start_with(dir: &Path, config: &Path, tag: &str, token: &str, sets: &[String]) -> Self {
        let stdout = dir.join(format!("{tag}.out"));
        let stderr = dir.join(format!("{tag}.err"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        cmd.arg("run").arg(config);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let child = cmd
            .env("SLUICE_ADMIN_TOKEN", token)
            .env_remove("SLUICE_LOG")
            .stdout(Stdio::from(File::create(&stdout).unwrap()))
            .stderr(Stdio::from(File::create(&stderr).unwrap()))
            .spawn()
            .unwrap();
        Self {
            child,
            stdout,
            stderr,
        }
    }

    fn logs(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            std::fs::read_to_string(&self.stdout).unwrap_or_default(),
            std::fs::read_to_string(&self.stderr).unwrap_or_default()
        )
    }

    fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(code) = self.child.try_wait().unwrap() {
                return code;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("did not exit within {limit:?}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn get(base: &str, path: &str) -> Option<Value> {
    let (code, body) = sluice_node::client::request(base, "GET", path, None, None).ok()?;
    (code == 200).then(|| serde_json::from_str(&body).unwrap())
}

/// Polls the head's status until `ok` holds.
fn wait_status(head: &mut Proc, base: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(s) = get(base, "/v1/status")
            && ok(&s)
        {
            return s;
        }
        if let Some(code) = head.child.try_wait().unwrap() {
            panic!("the head exited ({code}) before {what}\n{}", head.logs());
        }
        assert!(
            Instant::now() < deadline,
            "timed out: {what}\n{}",
            head.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn steps(s: &Value) -> u64 {
    s["trainer"]["steps"].as_u64().unwrap()
}

fn node<'a>(s: &'a Value, name: &str) -> Option<&'a Value> {
    s["nodes"].as_array()?.iter().find(|n| n["name"] == name)
}

fn live_with_replica(s: &Value, name: &str) -> bool {
    node(s, name).is_some_and(|n| n["health"] == "live" && n["replica"].is_u64())
}

#[test]
fn nodes_join_serve_over_http_and_survive_kill_9_of_a_node_and_of_the_head() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let admin = format!("127.0.0.2:{}", free_port("127.0.0.2"));
    let base = format!("http://{admin}");
    let e1_addr = format!("127.0.0.3:{}", free_port("127.0.0.3"));
    let e2_addr = format!("127.0.0.4:{}", free_port("127.0.0.4"));
    let env_addr = format!("127.0.0.6:{}", free_port("127.0.0.6"));
    let metrics = format!("127.0.0.2:{}", free_port("127.0.0.2"));
    let head_toml = head_config(d, &admin, &metrics);
    let e1_toml = engine_config(d, "e1", &base, &e1_addr);
    let e2_toml = engine_config(d, "e2", &base, &e2_addr);
    let env_toml = env_config(d, &base, &env_addr);

    let started = Instant::now();
    let mut env1 = Proc::start(d, &env_toml, "env1", TOKEN);
    // The head's token ends in a newline and e2's is padded (Secrets made from files): trimmed
    // on every side, they are the same token (they used to start and then match nothing).
    let mut head = Proc::start(d, &head_toml, "head", &format!("{TOKEN}\n"));
    let mut e1 = Proc::start(d, &e1_toml, "e1", TOKEN);
    let _e2 = Proc::start(d, &e2_toml, "e2", &format!("  {TOKEN} \r\n"));
    let s = wait_status(&mut head, &base, "both nodes serving and 5 steps", |s| {
        live_with_replica(s, "e1") && live_with_replica(s, "e2") && steps(s) >= 5
    });
    // The env node joined too, advertising its tasks, and ran the episodes the run trains on:
    // its own counters say so.
    let env = node(&s, "env1").expect("the env node is listed");
    assert_eq!(
        (env["role"].as_str(), env["health"].as_str()),
        (Some("env"), Some("live"))
    );
    assert!(
        env["tasks"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t == "arithmetic")),
        "{env}"
    );
    let env_base = format!("http://{env_addr}");
    let served_by_env = |what: &str| {
        let h = get(&env_base, "/v1/health").expect("the env node answers");
        assert!(
            h["envs_created_total"].as_u64() > Some(0) && h["steps_total"].as_u64() > Some(0),
            "{what}: the env node served no episode: {h}"
        );
    };
    served_by_env("the first steps");
    let joined_seconds = started.elapsed().as_secs_f64();
    let replicas: Vec<u64> = ["e1", "e2"]
        .iter()
        .map(|n| node(&s, n).unwrap()["replica"].as_u64().unwrap())
        .collect();
    assert_ne!(replicas[0], replicas[1], "one replica per node");

    // A wrong token: refused with 401, the node exits 1 naming it, the head logs it.
    let bad_toml = engine_config(
        d,
        "bad",
        &base,
        &format!("127.0.0.5:{}", free_port("127.0.0.5")),
    );
    let mut bad = Proc::start(d, &bad_toml, "bad", "not-the-token");
    let code = bad.wait_exit(Duration::from_secs(60));
    assert_eq!(code.code(), Some(1), "{}", bad.logs());
    let bad_err = std::fs::read_to_string(&bad.stderr).unwrap();
    assert!(
        bad_err.contains("refused this node's token (401): wrong bearer token"),
        "{bad_err}"
    );
    let head_err = std::fs::read_to_string(&head.stderr).unwrap();
    assert!(
        head_err.contains("refused a node's call: wrong or missing node token"),
        "{head_err}"
    );

    // The CLI with the same newline-ended variable: accepted (resume is a no-op here).
    let resumed = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["resume", "--url", &base])
        .env("SLUICE_ADMIN_TOKEN", format!("{TOKEN}\n"))
        .output()
        .unwrap();
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );

    // A member URL with credentials, a path and a query is refused at the join.
    let evil = r#"{"name": "evil", "role": "engine", "url": "http://u:p@127.0.0.9:1/a/../b?c"}"#;
    let (code, body) =
        sluice_node::client::request(&base, "POST", "/v1/nodes", Some(evil), Some(TOKEN)).unwrap();
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("is not exactly http://host:port"), "{body}");
    assert!(node(&get(&base, "/v1/status").unwrap(), "evil").is_none());

    // An engine node's weight and control routes need the node token: without it, 401 and the
    // node serves on; with it, weights come only from the head, as the version the URL names.
    let e1_base = format!("http://{e1_addr}");
    let inject = r#"{"model_path": "/tmp/x", "weight_version": 999999}"#;
    for (path, body) in [
        ("/update_weights_from_disk", inject),
        ("/pause_generation", "{}"),
        ("/abort_request", r#"{"abort_all": true}"#),
    ] {
        let (code, reply) =
            sluice_node::client::request(&e1_base, "POST", path, Some(body), None).unwrap();
        assert_eq!(code, 401, "{path}: {reply}");
    }
    let (code, reply) = sluice_node::client::request(
        &e1_base,
        "POST",
        "/update_weights_from_disk",
        Some(inject),
        Some(TOKEN),
    )
    .unwrap();
    assert_eq!(
        code, 404,
        "an engine node takes no weights from disk: {reply}"
    );
    let held = get(&e1_base, "/get_weight_version").unwrap()["weight_version"]
        .as_u64()
        .unwrap();
    assert!(held < 999_999, "{held}");

    // kill -9 of e1 mid-run: lost at the head, the run goes on with e2 alone.
    let at_kill = steps(&get(&base, "/v1/status").unwrap());
    e1.child.kill().unwrap();
    e1.wait_exit(Duration::from_secs(10));
    let killed = Instant::now();
    let s = wait_status(&mut head, &base, "e1 lost and 5 more steps", |s| {
        node(s, "e1").is_some_and(|n| n["health"] == "lost") && steps(s) >= at_kill + 5
    });
    let continued_seconds = killed.elapsed().as_secs_f64();
    assert!(live_with_replica(&s, "e2"));

    // Restarted, it joins again (a new incarnation), gets a replica and generates.
    let incarnation = node(&s, "e1").unwrap()["incarnation"].as_u64().unwrap();
    let restarted = Instant::now();
    let _e1 = Proc::start(d, &e1_toml, "e1b", TOKEN);
    wait_status(&mut head, &base, "e1 back with a replica", |s| {
        live_with_replica(s, "e1")
            && node(s, "e1").unwrap()["incarnation"].as_u64().unwrap() > incarnation
    });
    let rejoined_seconds = restarted.elapsed().as_secs_f64();
    let e1_base = format!("http://{e1_addr}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let served = loop {
        let v = get(&e1_base, "/get_weight_version");
        if let Some(v) = v.filter(|v| v["generated_tokens"].as_u64() > Some(0)) {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "the rejoined node never served\n{}",
            head.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        served["weight_version"].as_u64().unwrap() > 0,
        "it serves the head's versions"
    );

    // Weights over HTTP: what e2 loaded is the head's file byte for byte, not its own start.
    // The node fetches newer versions meanwhile (and drops older ones): read a version it
    // reports both before and after reading the files.
    let e2_base = format!("http://{e2_addr}");
    let version_of = || {
        get(&e2_base, "/get_weight_version").unwrap()["weight_version"]
            .as_u64()
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let (name, fetched, published) = loop {
        let version = version_of();
        let name = format!("v{version:06}");
        let fetched = std::fs::read(d.join("e2/weights").join(&name).join("model.safetensors"));
        let published = std::fs::read(
            d.join("head/weights_served")
                .join(&name)
                .join("model.safetensors"),
        );
        if let (Ok(f), Ok(p)) = (fetched, published)
            && version_of() == version
        {
            break (name, f, p);
        }
        assert!(
            Instant::now() < deadline,
            "no stable version to compare on e2"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        fetched == published,
        "the fetched {name} differs from the head's"
    );
    let own = std::fs::read(d.join("e2/model/model.safetensors")).unwrap();
    assert!(
        fetched != own,
        "e2 serves the head's weights, not its own start"
    );

    // kill -9 of the env node mid-run: the head loses it, the run waits for it (its episodes
    // have no other env node), and restarted it joins again and serves the episodes again (a
    // fresh process: its counters start at 0).
    let env_incarnation = node(&get(&base, "/v1/status").unwrap(), "env1").unwrap()["incarnation"]
        .as_u64()
        .unwrap();
    // Killed while it holds episodes (when it does within a few seconds), so that some move.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline
        && get(&env_base, "/v1/health").is_none_or(|h| h["envs"].as_u64() == Some(0))
    {
        std::thread::sleep(Duration::from_millis(2));
    }
    env1.child.kill().unwrap();
    env1.wait_exit(Duration::from_secs(10));
    let env_killed = Instant::now();
    let at_env_kill = steps(&wait_status(&mut head, &base, "env1 lost", |s| {
        node(s, "env1").is_some_and(|n| n["health"] == "lost")
    }));
    let _env1 = Proc::start(d, &env_toml, "env1b", TOKEN);
    wait_status(&mut head, &base, "env1 back and 3 more steps", |s| {
        node(s, "env1").is_some_and(|n| {
            n["health"] == "live" && n["incarnation"].as_u64() > Some(env_incarnation)
        }) && steps(s) >= at_env_kill + 3
    });
    let env_back_seconds = env_killed.elapsed().as_secs_f64();
    served_by_env("after its restart");
    // Episodes open on it when it died moved (replayed on the restarted node); how many
    // depends on timing, so it is printed, not asserted (crates/env/tests/routed.rs checks
    // the move itself). None failed for it: the node's death is not the env's failure.
    let (_, scrape) =
        sluice_node::client::request(&format!("http://{metrics}"), "GET", "/metrics", None, None)
            .unwrap();
    let series = |prefix: &str| {
        scrape
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let moved = series("sluice_env_failover_rollouts_total ").unwrap_or(0.0);
    assert_eq!(
        series("sluice_env_failures_total{kind=\"env_remote\"}").unwrap_or(0.0),
        0.0,
        "rollouts failed because the env node died"
    );

    // No token trained beyond the staleness bound, across the node's loss and return.
    let s = get(&base, "/v1/status").unwrap();
    assert_eq!(s["trainer"]["lag_violations"], 0, "{s}");

    // kill -9 of the head: a restart resumes from its checkpoint and replay store, and the
    // engine nodes (still running) join it again by themselves.
    let manifest_path = d.join("head/checkpoint/manifest.json");
    wait_status(&mut head, &base, "a periodic checkpoint", |_| {
        manifest_path.exists()
    });
    head.child.kill().unwrap();
    head.wait_exit(Duration::from_secs(10));
    let (persister, recovered) = Persister::open(&d.join("head/replay")).unwrap();
    drop(persister);
    let consumed_at_kill = recovered.counters.consumed_total;
    let m: Value = serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    let (m_steps, m_trained) = (
        m["steps"].as_u64().unwrap(),
        m["trained_groups"].as_u64().unwrap(),
    );
    let more = 3;
    let head_restarted = Instant::now();
    let mut head = Proc::start_with(
        d,
        &head_toml,
        "head2",
        TOKEN,
        &[format!("run.max_steps={}", m_steps + more)],
    );
    let s = wait_status(
        &mut head,
        &base,
        "both nodes back at the restarted head",
        |s| live_with_replica(s, "e1") && live_with_replica(s, "e2"),
    );
    let head_rejoined_seconds = head_restarted.elapsed().as_secs_f64();
    assert!(steps(&s) >= m_steps, "resumes at the checkpoint's step");
    let code = head.wait_exit(Duration::from_secs(120));
    assert!(code.success(), "exit {code}\n{}", head.logs());
    let out = std::fs::read_to_string(&head.stdout).unwrap();
    assert!(out.contains("(violations 0)"), "{out}");

    // Nothing trained twice: the restart consumed only new batches, and the checkpoint counts
    // exactly those on top of its own.
    let (persister, recovered) = Persister::open(&d.join("head/replay")).unwrap();
    drop(persister);
    let store = ReplayStore::recover(false, false, recovered.counters, recovered.groups);
    store.reconcile().unwrap();
    assert_eq!(store.counters().consumed_total, consumed_at_kill + more * B);
    let m2: Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    assert_eq!(m2["trained_groups"].as_u64().unwrap(), m_trained + more * B);
    println!(
        "cluster: both nodes serving at {joined_seconds:.1} s; after kill -9 of a node at step \
         {at_kill}, 5 more steps in {continued_seconds:.1} s; the restarted node back with a \
         replica in {rejoined_seconds:.1} s; after kill -9 of the env node ({moved} episodes \
         moved), back and 3 more steps in {env_back_seconds:.1} s; after kill -9 of the head (checkpoint at step \
         {m_steps}), both nodes back at the restarted head in {head_rejoined_seconds:.1} s"
    );
}

/// Sends SIGTERM to `p` (the graceful stop: checkpoint, exit 0).
fn terminate(p: &Proc) {
    let status = Command::new("kill")
        .args(["-TERM", &p.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// A series' value in a Prometheus scrape (0 when absent).
fn series(scrape: &str, prefix: &str) -> f64 {
    scrape
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}
