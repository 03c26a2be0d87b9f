//! `/metrics` scraped over HTTP from a running simulated pipeline whose engine replicas crash and
//! are rebuilt: every catalog name is present with `# HELP` and `# TYPE` of its kind, follows the
//! naming convention and Prometheus' suffix rules, carries only its declared labels, never has an
//! unlabeled series beside labeled ones, histograms have exactly the catalog's buckets, nothing
//! outside the catalog is exported, and counters never go backwards between scrapes (the
//! per-replica token counter across replica rebuilds included). When `promtool` is on `PATH`, it
//! checks the scrape too. Its own test binary: the Prometheus recorder is global to the process.

#[path = "node/common/mod.rs"]
mod common;
#[path = "metrics_scrape/text.rs"]
mod text;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use sluice_core::metrics::{self as m, MetricKind};

use sluice_node::client::request;
use sluice_node::{Node, NodeOptions};
use text::{Exposition, Sample, monotone_series, owner, parse_exposition, promtool};

/// One `GET /metrics` of the node at `base`: status and body.
fn scrape(base: &str) -> (u16, String) {
    request(base, "GET", "/metrics", None, None).unwrap()
}

/// Names whose label values only exist once something happened: an error (`kind`), a group with
/// reward components scored (`component`; the simulated task has none), an engine or env node
/// joined a head (`node`; this node is not one), a step trained texts of a situation
/// (`situation`).
const DYNAMIC: [&str; 7] = [
    m::ACTOR_ERRORS,
    m::ROLLOUT_REWARD_COMPONENT_MEAN_REWARD,
    m::NODE_MEMBER_UP,
    m::NODE_MEMBER_WEIGHT_VERSION,
    m::TRAINER_SITUATION_SEQUENCES,
    m::TRAINER_SITUATION_ADVANTAGE_MEAN_VALUE,
    m::TRAINER_SITUATION_ADVANTAGE_ABS_MEAN_VALUE,
];

/// What one run showed: the scrape before anything ran, every scrape in order (the first and the
/// last included), the last one, and the node's final status.
struct Scrapes {
    /// The scrape taken before anything ran.
    first: String,
    /// Every scrape in the order taken, from `first` to `last`.
    texts: Vec<String>,
    /// The scrape taken after the run was done.
    last: String,
    /// The node's status when the run was done.
    status: sluice_node::NodeStatus,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_catalog_metric_is_scraped_with_help_type_and_declared_labels() {
    let scrapes = run_with_crashing_replicas_and_scrape().await;
    check_counters_never_go_backwards(&scrapes.texts);
    check_with_promtool(&scrapes.first, &scrapes.last);
    check_first_scrape_has_every_static_name(&scrapes.first);
    let exposition = parse_exposition(&scrapes.last);
    check_suffix_rules(&exposition.types);
    check_no_unlabeled_series_beside_labeled(&exposition.samples);
    check_every_catalog_name_is_exported(&exposition);
    check_sample_labels_and_buckets(&exposition.samples);
    check_histograms_have_every_bucket(&exposition.samples);
    check_the_run_shows_in_the_numbers(&exposition.samples);
    check_rollout_shapes(&exposition.samples, &scrapes.status);
}

/// Runs six steps of the simulated pipeline whose replicas crash and are rebuilt, scraping
/// `/metrics` before the run, all along it and once it is done.
async fn run_with_crashing_replicas_and_scrape() -> Scrapes {
    let mut config = common::config("", "time_scale = 1.0");
    config.metrics.listen = "127.0.0.1:0".parse().unwrap();
    config.run.max_steps = std::num::NonZeroU64::new(6).unwrap();
    // Replicas crash now and then and are rebuilt: their token tallies start again at 0.
    config.faults.engine_crash_every_requests = 40;
    // A dataset, so the dataset-labeled series are seeded (and the source's domain is `math`).
    config.data.datasets = vec!["math::toy".parse().unwrap()];
    let options = NodeOptions {
        serve_metrics: true,
        ..NodeOptions::default()
    };
    let node = Node::start(&config, options).await.unwrap();
    let base = format!("http://{}", node.metrics_addr().unwrap());
    // The first scrape comes before anything ran: every name is already there.
    let first = {
        let base = base.clone();
        tokio::task::spawn_blocking(move || scrape(&base))
            .await
            .unwrap()
            .1
    };
    // Scrape while the run goes on, to see counters between rebuilds.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scraper = {
        let (base, stop) = (base.clone(), std::sync::Arc::clone(&stop));
        tokio::task::spawn_blocking(move || {
            let mut texts = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                texts.push(scrape(&base).1);
                std::thread::sleep(Duration::from_millis(100));
            }
            texts
        })
    };
    let status = node
        .wait_done(Duration::from_secs(60), |_| {})
        .await
        .unwrap();
    common::check_invariants(&status);
    let restarts: u64 = status.engine_health.iter().map(|h| h.restarts).sum();
    assert!(
        restarts > 0,
        "no replica was rebuilt: {:?}",
        status.engine_health
    );
    // Let the telemetry task tick (engine gauges, knobs).
    tokio::time::sleep(Duration::from_millis(600)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut texts = vec![first.clone()];
    texts.extend(scraper.await.unwrap());
    let (code, text) = {
        let base = base.clone();
        tokio::task::spawn_blocking(move || scrape(&base))
            .await
            .unwrap()
    };
    node.shutdown().await;
    assert_eq!(code, 200);
    texts.push(text.clone());
    Scrapes {
        first,
        texts,
        last: text,
        status,
    }
}

/// Counters (and histogram series) never go backwards from one scrape to the next.
fn check_counters_never_go_backwards(texts: &[String]) {
    for pair in texts.windows(2) {
        let (before, after) = (monotone_series(&pair[0]), monotone_series(&pair[1]));
        for (series, v) in &before {
            let now = after.get(series).copied().unwrap_or(f64::NAN);
            assert!(now >= *v, "{series} went from {v} to {now}");
        }
    }
}

/// What promtool says, when it is installed (the suffix rules are checked in
/// [`check_suffix_rules`] either way).
fn check_with_promtool(first: &str, last: &str) {
    for (when, t) in [("first", first), ("final", last)] {
        match promtool(t) {
            Some((ok, said)) => assert!(ok, "promtool check metrics on the {when} scrape: {said}"),
            None => eprintln!("promtool is not on PATH: skipped `promtool check metrics`"),
        }
    }
}

/// The first scrape already has every name whose label values are known up front (not the
/// reward components: their names come with the first scored group).
fn check_first_scrape_has_every_static_name(first: &str) {
    for def in m::CATALOG.iter().filter(|d| !DYNAMIC.contains(&d.name)) {
        assert!(
            first.contains(&format!("# TYPE {} ", def.name)),
            "{}: not on the first scrape",
            def.name
        );
    }
}

/// Prometheus' suffix rules, per declared type.
fn check_suffix_rules(types: &BTreeMap<String, String>) {
    for (name, kind) in types {
        if kind == "counter" {
            assert!(
                name.ends_with("_total"),
                "counter {name} must end in _total"
            );
        }
        if kind == "counter" || kind == "gauge" {
            for suffix in m::RESERVED_SUFFIXES {
                assert!(
                    !name.ends_with(suffix),
                    "{kind} {name} ends in `{suffix}`, reserved for histograms"
                );
            }
        }
    }
}

/// No series without labels beside labeled ones of the same metric.
fn check_no_unlabeled_series_beside_labeled(samples: &[Sample]) {
    for def in m::CATALOG {
        let series: Vec<usize> = samples
            .iter()
            .filter(|(n, _, _)| owner(n).is_some_and(|d| d.name == def.name))
            .map(|(_, l, _)| l.keys().filter(|k| *k != "le").count())
            .collect();
        if series.iter().any(|&n| n > 0) {
            assert!(
                series.iter().all(|&n| n > 0),
                "{}: an unlabeled series beside labeled ones",
                def.name
            );
        }
    }
}

/// Every catalog name follows the naming convention and, unless its label values have not
/// happened yet, is exported with a HELP line, the TYPE of its kind and at least one sample.
fn check_every_catalog_name_is_exported(exposition: &Exposition) {
    let Exposition {
        help,
        types,
        samples,
    } = exposition;
    for def in m::CATALOG {
        m::check_name(def).unwrap();
        if DYNAMIC.contains(&def.name) && !types.contains_key(def.name) {
            continue;
        }
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
}

/// Every sample belongs to the catalog, has a number for a value, carries only its declared
/// labels, and a bucket's `le` is one of the catalog's buckets.
fn check_sample_labels_and_buckets(samples: &[Sample]) {
    for (name, labels, value) in samples {
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
}

/// Each histogram series has every catalog bucket.
fn check_histograms_have_every_bucket(samples: &[Sample]) {
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
}

/// What the run did shows in the numbers, not just the names: steps, tokens generated against
/// tokens trained, and what every actor received and sent.
fn check_the_run_shows_in_the_numbers(samples: &[Sample]) {
    let value = |name: &str, label: Option<(&str, &str)>| -> f64 {
        samples
            .iter()
            .filter(|(n, l, _)| {
                n == name && label.is_none_or(|(k, v)| l.get(k).map(String::as_str) == Some(v))
            })
            .map(|(_, _, v)| v.parse::<f64>().unwrap())
            .sum()
    };
    assert_eq!(value(m::TRAINER_STEPS, None), 6.0);
    // Every trained token was generated by some replica incarnation: a per-replica counter that
    // restarted (or stalled) with its replica would count fewer.
    let generated = value(m::ENGINE_GENERATED_TOKENS, None);
    let trained = value(m::TRAINER_TRAINED_TOKENS, None);
    assert!(
        trained > 0.0 && generated >= trained,
        "generated {generated} < trained {trained}"
    );
    // Every actor counts what it handled and what it sent on.
    for actor in sluice_node::telemetry::ACTORS {
        for metric in [m::ACTOR_RECEIVED, m::ACTOR_SENT] {
            assert!(
                value(metric, Some(("actor", actor))) > 0.0,
                "{metric}{{actor={actor}}} stayed 0 through a whole run"
            );
        }
    }
    // The trainer handles one batch per step (and the replay store sent each of them).
    let trainer_batches = value(m::ACTOR_RECEIVED, Some(("actor", "trainer")));
    assert!(trainer_batches >= 6.0, "trainer received {trainer_batches}");
    assert!(value(m::ACTOR_SENT, Some(("actor", "replay"))) >= 6.0);
    for actor in sluice_node::telemetry::ACTORS {
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

/// What the rollouts look like, per domain: lengths, turns and finish reasons of every finished
/// rollout, the truncation the config makes likely (lengths uniform in 20..240 against
/// `max_new_tokens = 64`), and group times whose engine and env parts fit inside them.
fn check_rollout_shapes(samples: &[Sample], status: &sluice_node::NodeStatus) {
    let sum = |name: &str, labels: &[(&str, &str)]| -> f64 {
        samples
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, _, v)| v.parse::<f64>().unwrap())
            .sum()
    };
    let math = [("domain", "math")];
    let finished = sum(m::DOMAIN_FINISHED_ROLLOUTS, &math);
    let truncated = sum(
        m::DOMAIN_FINISHED_ROLLOUTS,
        &[("domain", "math"), ("status", "truncated")],
    );
    assert!(
        finished >= status.controller.finished_rollouts as f64 && finished > 0.0,
        "{finished} finished rollouts exported, {} in the status",
        status.controller.finished_rollouts
    );
    assert!(
        truncated / finished > 0.5,
        "{truncated} of {finished} truncated"
    );
    let lengths = sum(&format!("{}_count", m::ROLLOUT_RESPONSE_TOKENS), &math);
    let turns = sum(&format!("{}_count", m::ROLLOUT_EPISODE_TURNS), &math);
    assert!(
        lengths > 0.0 && turns > 0.0,
        "{lengths} lengths, {turns} turn counts"
    );
    let mean_length = sum(&format!("{}_sum", m::ROLLOUT_RESPONSE_TOKENS), &math) / lengths;
    assert!(
        (20.0..=64.0).contains(&mean_length),
        "mean length {mean_length}"
    );
    let shape = &status.controller.shape["math"];
    assert!(
        shape.truncated_ratio > 0.5 && shape.response_tokens_max <= 64,
        "{shape:?}"
    );
    assert_eq!(shape.turns_mean, 1.0, "the simulated task is single-turn");
    let groups = sum(&format!("{}_count", m::ROLLOUT_GROUP_SECONDS), &math);
    let total = sum(&format!("{}_sum", m::ROLLOUT_GROUP_SECONDS), &math);
    let engine = sum(&format!("{}_sum", m::ROLLOUT_GROUP_ENGINE_SECONDS), &math);
    let env = sum(&format!("{}_sum", m::ROLLOUT_GROUP_ENV_SECONDS), &math);
    assert!(
        groups > 0.0 && engine > 0.0,
        "{groups} groups timed, engine {engine} s"
    );
    assert!(
        engine + env <= total,
        "engine {engine} + env {env} > group {total}"
    );
    let bias = status
        .controller
        .length_bias
        .expect("measured at each step");
    assert!(
        (0.0..=1.0).contains(&bias.ks_distance) && bias.bias_ratio > -1.0,
        "{bias:?}"
    );
    assert!(bias.trained_rollouts > 0 && bias.generated_rollouts >= bias.trained_rollouts);
}
