//! The Prometheus text format as the scrape test reads it: sample lines parsed into name, labels
//! and value, the catalog entry each belongs to, the series that only grow, `# HELP` and
//! `# TYPE` lines sorted out, and `promtool check metrics` when it is installed.

use std::collections::{BTreeMap, BTreeSet};

use sluice_core::metrics::{self as m, MetricKind};

/// One sample line: name, labels, value.
pub(crate) type Sample = (String, BTreeMap<String, String>, String);

/// The name, labels and value of one sample line.
pub(crate) fn parse_sample(line: &str) -> Sample {
    let (series, value) = line.rsplit_once(' ').expect("`series value`");
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => {
            let body = rest.strip_suffix('}').expect("closing brace");
            let labels = body
                .split("\",")
                .filter(|kv| !kv.is_empty())
                .map(|kv| {
                    let (k, v) = kv.split_once("=\"").expect("k=\"v\"");
                    (k.to_owned(), v.trim_end_matches('"').to_owned())
                })
                .collect();
            (name.to_owned(), labels)
        }
        None => (series.to_owned(), BTreeMap::new()),
    };
    (name, labels, value.to_owned())
}

/// The catalog entry a sample belongs to (histogram series carry `_bucket`, `_sum`, `_count`).
pub(crate) fn owner(name: &str) -> Option<&'static m::MetricDef> {
    m::find(name).or_else(|| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|s| name.strip_suffix(s))
            .filter_map(m::find)
            .find(|d| d.kind == MetricKind::Histogram)
    })
}

/// The value of every counter series (histogram `_bucket`, `_sum` and `_count` series too: they
/// only grow), keyed by the whole series.
pub(crate) fn monotone_series(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (name, labels, value) = parse_sample(l);
            let def = owner(&name)?;
            let monotone = def.kind != MetricKind::Gauge;
            monotone.then(|| (format!("{name}{labels:?}"), value.parse::<f64>().unwrap()))
        })
        .collect()
}

/// `promtool check metrics` on `text`, when promtool is installed: `None` when it is not.
pub(crate) fn promtool(text: &str) -> Option<(bool, String)> {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), said))
}

/// The lines of one scrape, sorted by kind.
pub(crate) struct Exposition {
    /// Names with a non-empty `# HELP` line.
    pub(crate) help: BTreeSet<String>,
    /// The kind each `# TYPE` line declares, by name.
    pub(crate) types: BTreeMap<String, String>,
    /// Every sample line.
    pub(crate) samples: Vec<Sample>,
}

/// Sorts the lines of a scrape into HELP names, TYPE kinds and samples: every HELP is non-empty
/// and no other comment appears.
pub(crate) fn parse_exposition(text: &str) -> Exposition {
    let mut help = BTreeSet::new();
    let mut types = BTreeMap::new();
    let mut samples = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, h) = rest.split_once(' ').unwrap();
            assert!(!h.trim().is_empty(), "{name}: empty HELP");
            help.insert(name.to_owned());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            types.insert(name.to_owned(), kind.to_owned());
        } else {
            assert!(!line.starts_with('#'), "unexpected comment: {line}");
            samples.push(parse_sample(line));
        }
    }
    Exposition {
        help,
        types,
        samples,
    }
}
