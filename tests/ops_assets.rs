//! The ops assets refer only to metrics the catalog defines, and the dashboard is valid JSON.

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
