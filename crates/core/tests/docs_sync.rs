//! The user-facing docs list exactly what the code defines: every metric in `docs/metrics.md`, every
//! knob in `docs/config.md`.

use sluice_core::knobs::KNOB_NAMES;
use sluice_core::metrics::CATALOG;

fn doc(name: &str) -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/");
    std::fs::read_to_string(format!("{path}{name}")).unwrap()
}

#[test]
fn metrics_doc_lists_the_catalog() {
    let doc = doc("metrics.md");
    let documented: Vec<&str> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    let catalog: Vec<&str> = CATALOG.iter().map(|m| m.name).collect();
    for name in &catalog {
        assert!(documented.contains(name), "docs/metrics.md lacks {name}");
    }
    for name in &documented {
        assert!(
            catalog.contains(name),
            "docs/metrics.md lists {name}, which the catalog lacks"
        );
    }
}

#[test]
fn config_doc_lists_every_knob() {
    let doc = doc("config.md");
    for knob in KNOB_NAMES {
        assert!(
            doc.contains(&format!("`{knob}`")),
            "docs/config.md lacks knob {knob}"
        );
    }
}
