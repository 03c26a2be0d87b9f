//! `sluice check` refuses what `sluice run` of this build on this host would refuse, naming the
//! key: a CUDA device in a CPU-only build (D8), an env or engine node listening beyond loopback
//! without its token (D3), a head sending episodes to env nodes without `$SLUICE_ENV_TOKEN` (D4),
//! and a loopback `node.advertise` on a node that other machines reach (D6). Each row is one
//! mistake made on the shipped example configs, with the message asserted.

use std::path::Path;
use std::process::Command;

const HEAD: &str = "ops/slurm/head.toml";
const ENGINE: &str = "ops/slurm/engine.toml";
const ENV: &str = "ops/slurm/env.toml";
const GPU_HEAD: &str = "ops/slurm/gpu/head.toml";
const GPU_ENGINE: &str = "ops/slurm/gpu/engine.toml";

/// `sluice check CONFIG --set ...` with exactly the tokens given in the environment.
fn check(config: &str, sets: &[&str], tokens: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.arg("check")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(config))
        .env_remove("SLUICE_ADMIN_TOKEN")
        .env_remove("SLUICE_ENV_TOKEN");
    for s in sets {
        cmd.args(["--set", s]);
    }
    for (k, v) in tokens {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const BOTH: &[(&str, &str)] = &[
    ("SLUICE_ADMIN_TOKEN", "t0ken"),
    ("SLUICE_ENV_TOKEN", "t0ken"),
];
/// One mistake: the config, its `--set`s, the tokens in the environment, what the error says.
type Row = (
    &'static str,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
    &'static [&'static str],
);

const MEMBER_HEAD: &str = "node.head=\"http://10.0.0.1:9401\"";

#[test]
fn deployment_mistakes_are_refused_naming_the_key() {
    #[rustfmt::skip]
    let rows: &[Row] = &[
        // An env node beyond loopback without $SLUICE_ENV_TOKEN exits 1 at once when run.
        (ENV, &[MEMBER_HEAD, "node.listen=\"0.0.0.0:8071\"", "node.advertise=\"http://10.0.0.3:8071\""],
         &[("SLUICE_ADMIN_TOKEN", "t0ken")], &["node.listen", "SLUICE_ENV_TOKEN"]),
        // An engine node beyond loopback without the node token.
        (ENGINE, &[MEMBER_HEAD, "node.listen=\"10.0.0.2:8000\""],
         &[], &["node.listen", "SLUICE_ADMIN_TOKEN"]),
        // A head serving other machines with env-node domains and no env token: every call refused.
        (HEAD, &["admin.listen=\"0.0.0.0:9401\"", "node.advertise=\"http://10.0.0.1:9401\""],
         &[("SLUICE_ADMIN_TOKEN", "t0ken")], &["data.domains.math.env_nodes", "SLUICE_ENV_TOKEN"]),
        // `hostname -i` answering 127.0.1.1 on a head that listens for other machines.
        (HEAD, &["admin.listen=\"0.0.0.0:9401\"", "node.advertise=\"http://127.0.1.1:9401\""],
         BOTH, &["node.advertise", "loopback"]),
        (ENGINE, &[MEMBER_HEAD, "node.listen=\"0.0.0.0:8000\"", "node.advertise=\"http://localhost:8000\""],
         BOTH, &["node.advertise", "loopback"]),
    ];
    for (config, sets, tokens, expected) in rows {
        let (ok, stderr) = check(config, sets, tokens);
        assert!(!ok, "{config} {sets:?} passed");
        for e in *expected {
            assert!(
                stderr.contains(e),
                "{config} {sets:?}: `{e}` not in: {stderr}"
            );
        }
    }
}

#[test]
fn the_same_configs_pass_when_deployed_right() {
    let rows: &[(&str, &[&str])] = &[
        (
            ENV,
            &[
                MEMBER_HEAD,
                "node.listen=\"0.0.0.0:8071\"",
                "node.advertise=\"http://10.0.0.3:8071\"",
            ],
        ),
        (ENGINE, &[MEMBER_HEAD, "node.listen=\"10.0.0.2:8000\""]),
        (
            HEAD,
            &[
                "admin.listen=\"0.0.0.0:9401\"",
                "node.advertise=\"http://10.0.0.1:9401\"",
            ],
        ),
        // All nodes on one machine: loopback everywhere is consistent.
        (
            HEAD,
            &[
                "admin.listen=\"127.0.0.11:9401\"",
                "node.advertise=\"http://127.0.0.11:9401\"",
            ],
        ),
    ];
    for (config, sets) in rows {
        let (ok, stderr) = check(config, sets, BOTH);
        assert!(ok, "{config} {sets:?}: {stderr}");
    }
}

#[test]
fn a_cuda_config_is_refused_by_a_cpu_build_naming_the_device_key() {
    for config in [GPU_HEAD, GPU_ENGINE] {
        let sets: &[&str] = if config == GPU_ENGINE {
            &[MEMBER_HEAD]
        } else {
            &[]
        };
        let (ok, stderr) = check(config, sets, BOTH);
        if cfg!(feature = "cuda") {
            assert!(ok, "{config}: {stderr}");
        } else {
            assert!(!ok, "{config} passed a CPU-only build");
            for e in ["model.device", "built without CUDA", "--features cuda"] {
                assert!(stderr.contains(e), "{config}: `{e}` not in: {stderr}");
            }
        }
    }
    // The device of the role the config runs: an env node loads no model.
    let (ok, stderr) = check(ENV, &[MEMBER_HEAD, "model.device=\"cuda\""], BOTH);
    assert!(ok, "an env node with a CUDA model.device: {stderr}");
}
