//! The Kubernetes manifests checked against Kubernetes' own schemas, offline and strict (unknown
//! fields refused), with the `kubernetes-validate` Python package (`scripts/test-tools` installs it in a
//! cached venv, `~/.cache/sluice-ci/kubernetes-validate`; `$SLUICE_KUBERNETES_VALIDATE` names
//! another), and wired as a run needs: the env path (token, `env_nodes`), a headless Service
//! governing the StatefulSet, and the NetworkPolicy the README shows.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{configmap_files, documents, ops};

const VERSIONS: [&str; 2] = ["1.30", "1.33"];

fn validator() -> PathBuf {
    if let Some(p) = std::env::var_os("SLUICE_KUBERNETES_VALIDATE") {
        return p.into();
    }
    let home = std::env::var_os("HOME").expect("$HOME");
    Path::new(&home).join(".cache/sluice-ci/kubernetes-validate/bin/kubernetes-validate")
}

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn the_manifests_pass_kubernetes_schema_validation_strictly() {
    let validator = validator();
    assert!(
        validator.exists(),
        "{} is missing: install it (python3 -m venv ~/.cache/sluice-ci/kubernetes-validate && \
         ~/.cache/sluice-ci/kubernetes-validate/bin/pip install kubernetes-validate==1.37.0, as \
         scripts/test-tools does) or point $SLUICE_KUBERNETES_VALIDATE at one",
        validator.display()
    );
    let files = manifests();
    assert!(files.len() >= 5, "{files:?}");
    for version in VERSIONS {
        let out = Command::new(&validator)
            .args(["--strict", "--kubernetes-version", version])
            .args(&files)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "Kubernetes {version}:\n{text}");
        // Every object was checked (one line per object), none skipped for an unknown kind.
        assert_eq!(text.matches(" passed for resource ").count(), 9, "{text}");
    }
}

#[test]
fn a_manifest_the_schema_refuses_fails_the_validator() {
    // The validator is strict: a misspelt field fails (so the test above can fail).
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    let text = ops("kubernetes/engine.yaml").replace("readinessProbe:", "readinesProbe:");
    std::fs::write(&bad, text).unwrap();
    let validator = validator();
    assert!(
        validator.exists(),
        "{}: see the test above",
        validator.display()
    );
    let out = Command::new(validator)
        .args(["--strict", "--kubernetes-version", VERSIONS[0]])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success(), "a misspelt field passed");
}

#[test]
fn the_env_path_and_the_head_service_are_wired() {
    // env_nodes = true in the head's config, and the token it sends in the head's pod and the
    // env pods (each refuses calls without it beyond loopback).
    let files = configmap_files();
    assert!(files["head.toml"].contains("env_nodes = true"));
    for file in ["kubernetes/head.yaml", "kubernetes/env.yaml"] {
        assert!(
            ops(file).contains("- name: SLUICE_ENV_TOKEN\n              valueFrom:\n                secretKeyRef:\n                  name: sluice-token"),
            "{file}: $SLUICE_ENV_TOKEN from the Secret"
        );
    }
    // The StatefulSet's serviceName names a headless Service.
    let head = documents("kubernetes/head.yaml");
    let set = head
        .iter()
        .find(|d| d.contains("kind: StatefulSet"))
        .unwrap();
    let name = set
        .lines()
        .find_map(|l| l.trim().strip_prefix("serviceName: "))
        .expect("serviceName");
    let service = head
        .iter()
        .find(|d| {
            d.contains("kind: Service") && d.contains(&format!("metadata:\n  name: {name}\n"))
        })
        .unwrap_or_else(|| panic!("no Service {name}"));
    assert!(
        service.contains("clusterIP: None"),
        "{name} is not headless"
    );
    // Only the head reaches the engine and env ports.
    let policy = ops("kubernetes/networkpolicy.yaml");
    assert!(policy.contains("values: [\"engine\", \"env\"]"), "{policy}");
    assert!(
        policy.contains("app.kubernetes.io/component: head"),
        "{policy}"
    );
    for port in ["port: 8000", "port: 8071"] {
        assert!(policy.contains(port), "{policy}");
    }
    let readme = ops("kubernetes/README.md");
    assert!(
        readme.contains("networkpolicy.yaml"),
        "the README shows the policy"
    );
}
