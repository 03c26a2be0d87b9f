//! The user-facing docs list exactly what the code defines: every metric in `docs/metrics.md`, every
//! knob in `docs/config.md` and in `docs/pipeline.md`'s knob list (no more, no fewer), and every
//! code fence in `docs/` stands on a line of its own.

use sluice_core::knobs::knob_names;
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
    for knob in knob_names() {
        assert!(
            doc.contains(&format!("`{knob}`")),
            "docs/config.md lacks knob {knob}"
        );
    }
}

/// The knobs named in backticks in `docs/pipeline.md`'s `## Knobs` section, before its list of
/// routes (the paragraph that names them).
fn pipeline_knob_list(doc: &str) -> Vec<String> {
    let section = doc
        .split("\n## Knobs\n")
        .nth(1)
        .expect("docs/pipeline.md has a `## Knobs` section");
    let paragraph = section
        .split("\n\n")
        .find(|p| !p.trim().is_empty())
        .unwrap_or("");
    paragraph
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|name| name.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .map(str::to_owned)
        .collect()
}

#[test]
fn pipeline_doc_lists_exactly_the_knobs() {
    let listed = pipeline_knob_list(&doc("pipeline.md"));
    for knob in knob_names() {
        assert!(
            listed.iter().any(|l| l == knob),
            "docs/pipeline.md's knob list lacks {knob}"
        );
    }
    for name in &listed {
        assert!(
            knob_names().contains(&name.as_str()),
            "docs/pipeline.md's knob list names {name}, which is no knob"
        );
    }
}

#[test]
fn code_fences_stand_alone_and_pair_up() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "md") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut fences = 0;
        for (n, line) in text.lines().enumerate() {
            let trimmed = line.trim_start();
            if trimmed.starts_with("```") {
                fences += 1;
                let rest = trimmed.trim_start_matches('`');
                assert!(
                    rest.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
                    "{}:{}: text after a code fence: `{line}`",
                    path.display(),
                    n + 1
                );
            } else {
                assert!(
                    !line.contains("```"),
                    "{}:{}: a code fence inside a line: `{line}`",
                    path.display(),
                    n + 1
                );
            }
        }
        assert_eq!(fences % 2, 0, "{}: an unclosed code fence", path.display());
    }
}
