//! `/metrics` scraped over HTTP from a running simulated pipeline: every catalog name is present
//! with `# HELP` and `# TYPE` of its kind, follows the naming convention, carries only its declared
//! labels, histograms have exactly the catalog's buckets, and nothing outside the catalog is
//! exported. Its own test binary: the Prometheus recorder is global to the process.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use sluice_actors::client::request;
use sluice_actors::{Node, NodeOptions};
use sluice_core::metrics::{self as m, MetricKind};

/// One sample line: name, labels, value.
type Sample = (String, BTreeMap<String, String>, String);

fn parse_sample(line: &str) -> Sample {
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
fn owner(name: &str) -> Option<&'static m::MetricDef> {
    m::find(name).or_else(|| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|s| name.strip_suffix(s))
            .filter_map(m::find)
            .find(|d| d.kind == MetricKind::Histogram)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_catalog_metric_is_scraped_with_help_type_and_declared_labels() {
    let mut config = common::config("", "time_scale = 1.0");
    config.metrics.listen = "127.0.0.1:0".parse().unwrap();
    config.run.max_steps = std::num::NonZeroU64::new(3).unwrap();
    let options = NodeOptions {
        serve_metrics: true,
        ..NodeOptions::default()
    };
    let node = Node::start(&config, options).await.unwrap();
    let status = node
        .wait_done(Duration::from_secs(30), |_| {})
        .await
        .unwrap();
    common::check_invariants(&status);
    // Let the telemetry task tick (engine gauges, knobs, per-replica seeding).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let base = format!("http://{}", node.metrics_addr().unwrap());
    let (code, text) =
        tokio::task::spawn_blocking(move || request(&base, "GET", "/metrics", None, None).unwrap())
            .await
            .unwrap();
    node.shutdown().await;
    assert_eq!(code, 200);

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

    for def in m::CATALOG {
        m::check_name(def).unwrap();
        assert!(help.contains(def.name), "{}: no # HELP line", def.name);
        let expected = match def.kind {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        };
        assert_eq!(
            types.get(def.name).map(String::as_str),
            Some(expected),
            "{}: # TYPE",
            def.name
        );
        assert!(
            samples
                .iter()
                .any(|(n, _, _)| owner(n).is_some_and(|d| d.name == def.name)),
            "{}: no sample line",
            def.name
        );
    }

    for (name, labels, value) in &samples {
        let def = owner(name).unwrap_or_else(|| panic!("`{name}` is not in the catalog"));
        assert!(value.parse::<f64>().is_ok(), "{name}: value `{value}`");
        for key in labels.keys() {
            let declared =
                def.labels.contains(&key.as_str()) || (key == "le" && name.ends_with("_bucket"));
            assert!(
                declared,
                "{name}: label `{key}` not declared in the catalog"
            );
        }
        if name.ends_with("_bucket") {
            let le = &labels["le"];
            let ok = le == "+Inf" || def.buckets.iter().any(|b| le.parse::<f64>() == Ok(*b));
            assert!(ok, "{name}: bucket le={le} is not in the catalog's buckets");
        }
    }
    // Each histogram series has every catalog bucket.
    for def in m::CATALOG
        .iter()
        .filter(|d| d.kind == MetricKind::Histogram)
    {
        let bucket_name = format!("{}_bucket", def.name);
        let les: BTreeSet<&str> = samples
            .iter()
            .filter(|(n, _, _)| *n == bucket_name)
            .map(|(_, l, _)| l["le"].as_str())
            .collect();
        assert_eq!(
            les.len(),
            def.buckets.len() + 1,
            "{}: buckets {les:?}",
            def.name
        );
    }

    // What the run did shows in the numbers, not just the names.
    let value = |name: &str, label: Option<(&str, &str)>| -> f64 {
        samples
            .iter()
            .filter(|(n, l, _)| {
                n == name && label.is_none_or(|(k, v)| l.get(k).map(String::as_str) == Some(v))
            })
            .map(|(_, _, v)| v.parse::<f64>().unwrap())
            .sum()
    };
    assert_eq!(value(m::TRAINER_STEPS, None), 3.0);
    assert!(value(m::ENGINE_GENERATED_TOKENS, None) > 0.0);
    // Every actor counts what it handled and what it sent on.
    for actor in sluice_actors::telemetry::ACTORS {
        for metric in [m::ACTOR_RECEIVED, m::ACTOR_SENT] {
            assert!(
                value(metric, Some(("actor", actor))) > 0.0,
                "{metric}{{actor={actor}}} stayed 0 through a whole run"
            );
        }
    }
    // The trainer handles one batch per step (and the replay store sent each of them).
    let trainer_batches = value(m::ACTOR_RECEIVED, Some(("actor", "trainer")));
    assert!(trainer_batches >= 3.0, "trainer received {trainer_batches}");
    assert!(value(m::ACTOR_SENT, Some(("actor", "replay"))) >= 3.0);
    for actor in sluice_actors::telemetry::ACTORS {
        for metric in [m::ACTOR_RECEIVED, m::ACTOR_SENT, m::ACTOR_DROPPED] {
            assert!(
                samples
                    .iter()
                    .any(|(n, l, _)| n == metric
                        && l.get("actor").map(String::as_str) == Some(actor)),
                "{metric}{{actor={actor}}} is not exported"
            );
        }
    }
    assert_eq!(
        value(
            m::NODE_UP_INFO,
            Some(("version", env!("CARGO_PKG_VERSION")))
        ),
        1.0
    );
}
