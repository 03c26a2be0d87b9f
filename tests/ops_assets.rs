//! The ops assets refer only to metrics the catalog defines, the dashboard is valid JSON, and the
//! launchers (`ops/slurm`, `ops/kubernetes`) parse and use only flags and config keys that exist;
//! `slurm.rs` runs the sbatch script under a real Slurm, `kubernetes.rs` validates the manifests
//! against Kubernetes' schemas, `deploy_checks.rs` drives `sluice check`'s deployment checks.

#[path = "ops_assets/deploy_checks.rs"]
mod deploy_checks;
#[path = "ops_assets/kubernetes.rs"]
mod kubernetes;
#[path = "ops_assets/slurm.rs"]
mod slurm;

use std::path::Path;

use sluice_core::metrics::{self, MetricKind};

fn ops(file: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ops").join(file)).unwrap()
}

/// Every `sluice_…` identifier in `text`, with Prometheus' histogram suffixes resolved.
fn metric_refs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("sluice_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

fn assert_known(file: &str) -> usize {
    let refs = metric_refs(&ops(file));
    for r in &refs {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                r.strip_suffix(s)
                    .filter(|b| metrics::find(b).is_some_and(|m| m.kind == MetricKind::Histogram))
            })
            .unwrap_or(r);
        assert!(
            metrics::find(base).is_some(),
            "{file} uses {r}, which the catalog lacks"
        );
    }
    refs.len()
}

#[test]
fn alerts_use_catalog_metrics() {
    assert!(assert_known("alerts.yml") >= 6);
}

#[test]
fn dashboard_is_json_and_uses_catalog_metrics() {
    let dash: serde_json::Value = serde_json::from_str(&ops("grafana-dashboard.json")).unwrap();
    assert!(dash["panels"].as_array().unwrap().len() >= 10);
    assert!(assert_known("grafana-dashboard.json") >= 20);
}

// ---- The launchers (ops/slurm, ops/kubernetes): every `sluice` flag and config key they use
// exists, and every config they start loads with the overrides they pass.

const TOKEN: &str = "ops-assets-token";

/// What a launcher runs: `sluice <sub> <config> [--flag ...] [--set key=value ...]`.
#[derive(Debug)]
struct Invocation {
    file: String,
    sub: String,
    config: String,
    flags: Vec<String>,
    sets: Vec<String>,
}

/// Words of a shell line: `"..."` (with `\"` escapes) and `'...'` quoting, `$(...)` kept whole.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut chars = line.chars().peekable();
    let mut started = false;
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                started = true;
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => word.extend(chars.next()),
                        '"' => break,
                        c => word.push(c),
                    }
                }
            }
            '\'' => {
                started = true;
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    word.push(c);
                }
            }
            c if c.is_whitespace() => {
                if started {
                    out.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            c => {
                started = true;
                word.push(c);
            }
        }
    }
    if started {
        out.push(word);
    }
    out
}

/// `sub config [--flag [value]]...` after the binary's word.
fn invocation(file: &str, argv: &[String]) -> Invocation {
    let mut inv = Invocation {
        file: file.to_owned(),
        sub: argv[0].clone(),
        config: argv[1].clone(),
        flags: Vec::new(),
        sets: Vec::new(),
    };
    let mut rest = argv[2..].iter();
    while let Some(w) = rest.next() {
        if matches!(w.as_str(), ">" | "&" | "|" | ";" | "&&") {
            break;
        }
        assert!(
            w.starts_with("--"),
            "{file}: unexpected word `{w}` in {argv:?}"
        );
        inv.flags.push(w.clone());
        if w == "--set" {
            inv.sets.push(rest.next().expect("a --set value").clone());
        }
    }
    inv
}

/// The `sluice` invocations of the sbatch script (continuation lines joined, the head's
/// `"${HEAD_ARGS[@]}"` expanded to the words of its `HEAD_ARGS=(...)` line).
fn slurm_invocations() -> Vec<Invocation> {
    let text = ops("slurm/sluice.sbatch").replace("\\\n", " ");
    let head_args = text
        .lines()
        .find_map(|l| l.strip_prefix("HEAD_ARGS=(")?.strip_suffix(')'))
        .map(words)
        .expect("the sbatch script's HEAD_ARGS=(...) line");
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        let w: Vec<String> = words(line)
            .into_iter()
            .flat_map(|w| {
                if w == "${HEAD_ARGS[@]}" {
                    head_args.clone()
                } else {
                    vec![w]
                }
            })
            .collect();
        if let Some(i) = w.iter().position(|w| w == "$SLUICE") {
            out.push(invocation("slurm/sluice.sbatch", &w[i + 1..]));
        }
    }
    out
}

/// The YAML documents of a manifest.
fn documents(file: &str) -> Vec<String> {
    ops(file)
        .split("\n---\n")
        .map(str::to_owned)
        .filter(|d| d.lines().any(|l| l.starts_with("kind:")))
        .collect()
}

/// The block-list items under `key:` (the next lines indented deeper, each `- item`).
fn block_list(doc: &str, key: &str) -> Vec<Vec<String>> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if l.trim() != format!("{key}:") {
            continue;
        }
        let indent = l.len() - l.trim_start().len();
        let items = lines[i + 1..]
            .iter()
            .take_while(|l| l.len() - l.trim_start().len() > indent)
            .filter_map(|l| l.trim().strip_prefix("- "))
            .map(|item| words(item).join(" "))
            .collect();
        out.push(items);
    }
    out
}

/// The embedded files of the ConfigMap (`name: |` blocks).
fn configmap_files() -> std::collections::BTreeMap<String, String> {
    let doc = ops("kubernetes/configmap.yaml");
    let lines: Vec<&str> = doc.lines().collect();
    let mut out = std::collections::BTreeMap::new();
    for (i, l) in lines.iter().enumerate() {
        if let Some(name) = l.trim().strip_suffix(": |") {
            let indent = l.len() - l.trim_start().len();
            let body: Vec<String> = lines[i + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .map(|l| l.get(indent + 2..).unwrap_or("").to_owned())
                .collect();
            out.insert(name.to_owned(), body.join("\n"));
        }
    }
    out
}

fn kubernetes_invocations() -> Vec<Invocation> {
    let mut out = Vec::new();
    for file in [
        "kubernetes/head.yaml",
        "kubernetes/engine.yaml",
        "kubernetes/env.yaml",
    ] {
        for doc in documents(file) {
            if doc.contains("command: [\"sluice\"]") {
                let args = block_list(&doc, "args");
                assert_eq!(args.len(), 1, "{file}: one args list per workload");
                out.push(invocation(file, &args[0]));
            }
        }
    }
    out
}

/// Shell and Kubernetes variables replaced by values of the right shape.
fn substitute(value: &str) -> String {
    let mut v = value.to_owned();
    for (var, with) in [
        ("$(POD_IP)", "10.1.2.3"),
        ("$(POD_NAME)", "sluice-engine-7d9f"),
        ("$HEAD_URL", "http://10.0.0.1:9401"),
        ("$HEAD_IP", "10.0.0.1"),
        ("$ENGINE_NODES", "2"),
        ("$role-$host", "engine-gpu-node-2"),
        ("$ADMIN_PORT", "9401"),
        ("$METRICS_PORT", "9400"),
        ("$ENGINE_PORT", "8000"),
        ("$ENV_PORT", "8071"),
        ("$RUN_DIR", "/scratch/runs/sluice-42"),
        ("$ip", "10.0.0.2"),
        ("$port", "8000"),
    ] {
        v = v.replace(var, with);
    }
    assert!(!v.contains('$'), "unknown variable in `{value}`");
    v
}

/// Loads `config` with the invocation's overrides (the node token from the environment) and
/// runs the deployment checks of `sluice check` on it, for a binary built with CUDA or not.
fn load_with_sets(name: &str, text: &str, sets: &[String], cuda_built: bool) {
    let overrides: Vec<sluice_config::Override> = sets
        .iter()
        .map(|s| {
            substitute(s)
                .parse()
                .unwrap_or_else(|e| panic!("{name}: --set {s}: {e}"))
        })
        .collect();
    let env = |k: &str| (k == sluice_config::ADMIN_TOKEN_ENV).then(|| TOKEN.to_owned());
    let config = sluice_config::parse(text, name, &overrides, &env)
        .unwrap_or_else(|e| panic!("{name} with {sets:?}: {e}"));
    let deployment = sluice_config::Deployment {
        cuda_built,
        env_token: true,
    };
    sluice_config::check_deployment(&config, name, &deployment)
        .unwrap_or_else(|e| panic!("{name} with {sets:?}: {e}"));
}

/// Every flag of every invocation is one `sluice <sub> --help` lists.
fn assert_flags_exist(invocations: &[Invocation]) {
    for inv in invocations {
        let help = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([inv.sub.as_str(), "--help"])
            .output()
            .unwrap();
        assert!(
            help.status.success(),
            "{}: no subcommand `{}`",
            inv.file,
            inv.sub
        );
        let help = String::from_utf8_lossy(&help.stdout);
        for flag in &inv.flags {
            assert!(
                help.contains(flag.as_str()),
                "{}: `sluice {} {flag}` is not a flag",
                inv.file,
                inv.sub
            );
        }
    }
}

#[test]
fn the_slurm_launcher_uses_only_existing_flags_and_keys() {
    let invocations = slurm_invocations();
    // check × 3 and run for the head and the members.
    assert!(invocations.len() >= 5, "{invocations:?}");
    assert_flags_exist(&invocations);
    for inv in &invocations {
        let files: &[&str] = match inv.config.as_str() {
            "$HEAD_CONFIG" => &["head.toml"],
            "$ENGINE_CONFIG" => &["engine.toml"],
            "$ENV_CONFIG" => &["env.toml"],
            // The members' loop picks the engine or the env config.
            "$config" => &["engine.toml", "env.toml"],
            other => panic!("slurm/sluice.sbatch: unknown config `{other}`"),
        };
        for f in files {
            // The CPU example runs on the default build; the GPU one needs `--features cuda`.
            load_with_sets(
                &format!("slurm/{f}"),
                &ops(&format!("slurm/{f}")),
                &inv.sets,
                false,
            );
            let gpu = format!("slurm/gpu/{f}");
            load_with_sets(&gpu, &ops(&gpu), &inv.sets, true);
        }
    }
    let readme = ops("slurm/README.md");
    assert!(readme.contains("sbatch"), "the README says how to submit");
}

#[test]
fn the_kubernetes_manifests_are_well_formed_and_use_existing_flags_and_keys() {
    let mut kinds = Vec::new();
    for file in [
        "kubernetes/configmap.yaml",
        "kubernetes/head.yaml",
        "kubernetes/engine.yaml",
        "kubernetes/env.yaml",
        "kubernetes/networkpolicy.yaml",
    ] {
        let text = ops(file);
        assert!(
            !text.contains('\t'),
            "{file}: YAML indents with spaces only"
        );
        for doc in documents(file) {
            let kind = doc
                .lines()
                .find_map(|l| l.strip_prefix("kind: "))
                .unwrap()
                .to_owned();
            assert!(
                doc.lines().any(|l| l.starts_with("apiVersion: ")),
                "{file}: {kind} lacks apiVersion"
            );
            assert!(
                doc.contains("metadata:\n  name: "),
                "{file}: {kind} lacks a name"
            );
            if kind == "Deployment" || kind == "StatefulSet" {
                for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
                    assert!(
                        doc.contains(&format!(
                            "{probe}:\n            httpGet:\n              path: /"
                        )),
                        "{file}: {kind} lacks an HTTP {probe}"
                    );
                }
            }
            if kind == "StatefulSet" {
                assert!(
                    doc.contains("volumeClaimTemplates:"),
                    "{file}: the head keeps a volume"
                );
                assert!(
                    doc.contains("prometheus.io/scrape: \"true\""),
                    "{file}: scrape annotations"
                );
            }
            kinds.push(kind);
        }
    }
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ConfigMap",
            "Deployment",
            "Deployment",
            "NetworkPolicy",
            "Service",
            "Service",
            "Service",
            "Service",
            "StatefulSet"
        ]
    );
    let files = configmap_files();
    assert_eq!(
        files.keys().collect::<Vec<_>>(),
        ["engine.toml", "env.toml", "head.toml"]
    );
    let invocations = kubernetes_invocations();
    assert_eq!(invocations.len(), 3);
    assert_flags_exist(&invocations);
    for inv in &invocations {
        let name = inv.config.strip_prefix("/etc/sluice/").unwrap();
        let text = files
            .get(name)
            .unwrap_or_else(|| panic!("{}: no {name} in the ConfigMap", inv.file));
        // The manifests' configs are the GPU example: the image holds a CUDA build.
        load_with_sets(&format!("{}:{name}", inv.file), text, &inv.sets, true);
    }
    // The readiness paths are routes the servers have.
    assert!(ops("kubernetes/head.yaml").contains("path: /health"));
    assert!(ops("kubernetes/engine.yaml").contains("path: /health"));
    assert!(ops("kubernetes/env.yaml").contains("path: /v1/health"));
}
