//! Metrics plumbing: installing the Prometheus recorder once per process (every catalog name
//! described with help text and unit, histograms with the catalog's buckets, every name seeded so a
//! scrape shows it from the start), the periodic task that exports gauges sampled from the actors
//! (engine busy ratio, throughput, knobs) and runs the exporter's upkeep, and the typed helpers
//! actors report through ([`ActorCounters`], one per actor of [`ACTORS`]; a training step's own
//! metrics go out through [`sluice_actors::trainer::export_step_metrics`]).
//!
//! Seeding: a series is registered at zero for every label value known up front (actor names,
//! rollout statuses, finish reasons, buckets, the state machine's bucket transitions, weight-update
//! modes, knob names) and, when a node starts ([`seed_node`]), for its replicas, domains and
//! datasets. A series without labels is never seeded for a labeled name: it would sit beside the
//! labeled ones as a bogus `0` in every sum and average. The names whose label values only
//! appear with events show from their first one: `sluice_actor_errors_total{actor, kind}` from its
//! first error, a head's `sluice_node_member_*{node}` when a node joins.
//!
//! Per-replica token counts would start again at 0 when a replica is rebuilt: the node wraps its
//! backend factory with [`carry_token_counts`] so each replica slot counts on, and
//! [`ReplicaTally`] exports new highs as increments, so the counter never goes backwards, never
//! stalls, and loses nothing a crashed incarnation generated.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use metrics::Unit;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sluice_core::knobs::KnobsHandle;
use sluice_core::metrics::{self as m, MetricDef, MetricKind};
use sluice_core::{AdmissionMode, RolloutStatus, WeightUpdateMode};
use sluice_engine::FinishReason;
use sluice_replay::Bucket;

pub use sluice_actors::counters::{ACTORS, ActorCounters};
use sluice_actors::engine::EngineHandle;

mod replicas;
pub use replicas::{ReplicaDelta, ReplicaTally, carry_token_counts};

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// How often the exporter's upkeep (histogram compaction) runs.
const UPKEEP_PERIOD: Duration = Duration::from_secs(5);

/// Kinds of environment failure (`sluice_env_failures_total{kind}`) known up front.
const ENV_FAILURE_KINDS: [&str; 3] = ["panic", "timeout", "error"];

/// Installs the Prometheus recorder (first call in the process) with the catalog's histogram
/// buckets, help text and units, and seeds every catalog name; later calls return the same handle.
/// `None` if another recorder was installed first.
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let mut builder = PrometheusBuilder::new();
            for def in m::CATALOG.iter().filter(|d| !d.buckets.is_empty()) {
                builder = builder
                    .set_buckets_for_metric(Matcher::Full(def.name.to_owned()), def.buckets)
                    .ok()?;
            }
            let handle = builder.install_recorder().ok()?;
            describe_catalog();
            seed_catalog();
            metrics::gauge!(m::NODE_UP_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            Some(handle)
        })
        .clone()
}

/// The unit a catalog name ends in, as the `metrics` crate spells it (`None` for units it has no
/// word for, such as ratios and versions; the name still carries them).
pub fn unit_of(def: &MetricDef) -> Option<Unit> {
    let stem = def.name.strip_suffix("_total").unwrap_or(def.name);
    let unit = m::UNITS
        .iter()
        .filter(|u| stem.ends_with(&format!("_{u}")))
        .max_by_key(|u| u.len())?;
    match *unit {
        "seconds" => Some(Unit::Seconds),
        "bytes" => Some(Unit::Bytes),
        "tokens_per_second" => Some(Unit::CountPerSecond),
        "ratio" | "version" | "versions" | "value" | "reward" | "nats" | "info" => None,
        _ => Some(Unit::Count),
    }
}

/// Registers help text and unit of every catalog entry with the installed recorder.
fn describe_catalog() {
    for def in m::CATALOG {
        let (name, help) = (def.name, def.help);
        match (def.kind, unit_of(def)) {
            (MetricKind::Counter, Some(u)) => metrics::describe_counter!(name, u, help),
            (MetricKind::Counter, None) => metrics::describe_counter!(name, help),
            (MetricKind::Gauge, Some(u)) => metrics::describe_gauge!(name, u, help),
            (MetricKind::Gauge, None) => metrics::describe_gauge!(name, help),
            (MetricKind::Histogram, Some(u)) => metrics::describe_histogram!(name, u, help),
            (MetricKind::Histogram, None) => metrics::describe_histogram!(name, help),
        }
    }
}

/// The label values known before anything happens, for a label of the metric `name`.
fn static_values(name: &str, label: &str) -> Option<Vec<&'static str>> {
    let values = match label {
        "mode" if name == m::NODE_ADMISSION_MODE_INFO => {
            AdmissionMode::ALL.iter().map(|a| a.as_str()).collect()
        }
        "actor" => ACTORS.to_vec(),
        "bucket" => Bucket::ALL.iter().map(|b| b.as_label()).collect(),
        "mode" => WeightUpdateMode::ALL.iter().map(|w| w.as_str()).collect(),
        "knob" => sluice_core::knobs::gauge_names().to_vec(),
        "reason" => [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Abort,
            FinishReason::Error(String::new()),
        ]
        .iter()
        .map(FinishReason::as_label)
        .collect(),
        // How the rollouts of a group that finished generating end: a weight update's abort and
        // an expiry are a group's moves in the store (`sluice_replay_transitions_total{to}`).
        "status" => [
            RolloutStatus::Completed,
            RolloutStatus::Truncated,
            RolloutStatus::PromptTooLong,
            RolloutStatus::Timeout,
            RolloutStatus::Error(String::new()),
        ]
        .iter()
        .map(RolloutStatus::as_label)
        .collect(),
        "kind" => ENV_FAILURE_KINDS.to_vec(),
        "outcome" => sluice_env::judge::OUTCOMES.to_vec(),
        "from" | "to" => Bucket::ALL.iter().map(|b| b.as_label()).collect(),
        "version" => vec![env!("CARGO_PKG_VERSION")],
        "role" => vec!["engine", "env"],
        _ => return None,
    };
    Some(values)
}

/// Registers one series of `def` (value untouched: zero when new).
fn register(def: &MetricDef, labels: Vec<(&'static str, String)>) {
    let labels: Vec<metrics::Label> = labels
        .into_iter()
        .map(|(k, v)| metrics::Label::new(k, v))
        .collect();
    match def.kind {
        MetricKind::Counter => drop(metrics::counter!(def.name, labels)),
        MetricKind::Gauge => drop(metrics::gauge!(def.name, labels)),
        MetricKind::Histogram => drop(metrics::histogram!(def.name, labels)),
    }
}

/// The bucket transitions the replay store's state machine allows, as (from, to) labels.
fn transitions() -> Vec<(&'static str, &'static str)> {
    let mut pairs = Vec::new();
    for from in Bucket::ALL {
        for to in Bucket::ALL {
            if from.can_move_to(to) {
                pairs.push((from.as_label(), to.as_label()));
            }
        }
    }
    pairs
}

/// Seeds every catalog name whose label values are known up front: names without labels, one
/// series per static label value, and the legal `{from, to}` transitions. Names labeled by
/// replica, domain or dataset wait for [`seed_node`]; `sluice_rollout_reward_component_mean_reward`
/// appears with the first scored group (its component names come from rubrics and envs).
fn seed_catalog() {
    for def in m::CATALOG {
        match def.labels {
            [] => register(def, Vec::new()),
            ["from", "to"] => {
                for (from, to) in transitions() {
                    register(def, vec![("from", from.to_owned()), ("to", to.to_owned())]);
                }
            }
            [label] => {
                for v in static_values(def.name, label).unwrap_or_default() {
                    register(def, vec![(*label, v.to_owned())]);
                }
            }
            _ => {}
        }
    }
}

/// Seeds the series whose label values come from the running node: one per engine replica,
/// configured domain and dataset, and each (domain, final status) pair. Call it before
/// `/metrics` is served; seeding is idempotent.
pub fn seed_node(replicas: usize, domains: &[String], datasets: &[String]) {
    for def in m::CATALOG {
        if def.labels == ["domain", "status"] {
            // Finish reasons per domain: both value sets are known now.
            for domain in domains {
                for status in static_values(def.name, "status").unwrap_or_default() {
                    register(
                        def,
                        vec![("domain", domain.clone()), ("status", status.to_owned())],
                    );
                }
            }
            continue;
        }
        let values: Vec<String> = match def.labels {
            ["replica"] => (0..replicas).map(|r| r.to_string()).collect(),
            ["domain"] => domains.to_vec(),
            ["dataset"] => datasets.to_vec(),
            _ => continue,
        };
        for v in values {
            register(def, vec![(def.labels[0], v)]);
        }
    }
}

/// Samples the engine and the knobs every `period`, exports gauges, and runs the exporter's
/// upkeep every few seconds. Runs until aborted.
pub async fn run(
    engine: EngineHandle,
    knobs: KnobsHandle,
    handle: Option<PrometheusHandle>,
    period: Duration,
) {
    let mut tally = ReplicaTally::default();
    let mut last_upkeep = Instant::now();
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        if let Ok(stats) = engine.stats().await {
            let deltas = tally.update(&stats);
            for (i, (s, d)) in stats.iter().zip(deltas).enumerate() {
                let replica = i.to_string();
                if d.wall_seconds > 0.0 {
                    metrics::gauge!(m::ENGINE_BUSY_RATIO, "replica" => replica.clone())
                        .set((d.busy_seconds / d.wall_seconds).clamp(0.0, 1.0));
                    let tps = d.tokens as f64 / d.wall_seconds;
                    metrics::gauge!(m::ENGINE_DECODE_TOKENS_PER_SECOND, "replica" => replica.clone()).set(tps);
                }
                metrics::gauge!(m::ENGINE_RUNNING_SEQUENCES, "replica" => replica.clone())
                    .set(s.running as f64);
                metrics::gauge!(m::ENGINE_WAITING_REQUESTS, "replica" => replica.clone())
                    .set(s.waiting as f64);
                if let Some(kv) = &s.kv_cache {
                    export_kv_cache(kv, &replica);
                }
                metrics::counter!(m::ENGINE_GENERATED_TOKENS, "replica" => replica)
                    .increment(d.tokens);
            }
        }
        export_knobs(&knobs);
        if let Some(h) = &handle
            && last_upkeep.elapsed() > UPKEEP_PERIOD
        {
            h.run_upkeep();
            last_upkeep = Instant::now();
        }
    }
}

/// A native replica's KV cache. Its counters are totals since the replica started: `absolute`
/// keeps the exported counter at its highest value, so it never goes backwards when a replica is
/// rebuilt (it then resumes counting once the new one passes the old total).
fn export_kv_cache(kv: &sluice_engine::KvCacheStats, replica: &str) {
    let r = || replica.to_owned();
    metrics::gauge!(m::ENGINE_KV_CACHE_USED_BLOCKS, "replica" => r()).set(kv.used_blocks as f64);
    metrics::gauge!(m::ENGINE_KV_CACHE_CACHED_BLOCKS, "replica" => r())
        .set(kv.cached_blocks as f64);
    metrics::gauge!(m::ENGINE_KV_CACHE_TOTAL_BLOCKS, "replica" => r()).set(kv.total_blocks as f64);
    metrics::counter!(m::ENGINE_PROMPT_TOKENS, "replica" => r()).absolute(kv.prompt_tokens);
    metrics::counter!(m::ENGINE_PREFIX_CACHE_HIT_TOKENS, "replica" => r())
        .absolute(kv.prefix_hit_tokens);
    if kv.prompt_tokens > 0 {
        metrics::gauge!(m::ENGINE_PREFIX_CACHE_HIT_RATIO, "replica" => r())
            .set(kv.prefix_hit_tokens as f64 / kv.prompt_tokens as f64);
    }
    metrics::counter!(m::ENGINE_PREEMPTED_SEQUENCES, "replica" => r())
        .absolute(kv.preempted_sequences);
}

/// Exports every knob as a gauge.
pub fn export_knobs(knobs: &KnobsHandle) {
    let k = knobs.current();
    for (name, v) in k.gauge_values() {
        metrics::gauge!(m::NODE_KNOB_VALUE, "knob" => name).set(v);
    }
    for mode in WeightUpdateMode::ALL {
        let on = if mode == k.weight_update_mode {
            1.0
        } else {
            0.0
        };
        metrics::gauge!(m::NODE_WEIGHT_UPDATE_MODE_INFO, "mode" => mode.as_str()).set(on);
    }
    for mode in AdmissionMode::ALL {
        let on = f64::from(u8::from(mode == k.admission));
        metrics::gauge!(m::NODE_ADMISSION_MODE_INFO, "mode" => mode.as_str()).set(on);
    }
    for (domain, share) in k.domain_shares() {
        metrics::gauge!(m::DOMAIN_MIX_TARGET, "domain" => domain).set(share);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_catalog_name_gets_a_unit_or_a_documented_none() {
        let seconds = m::find(m::TRAINER_STEP_SECONDS).unwrap();
        assert_eq!(unit_of(seconds), Some(Unit::Seconds));
        let tps = m::find(m::ENGINE_DECODE_TOKENS_PER_SECOND).unwrap();
        assert_eq!(unit_of(tps), Some(Unit::CountPerSecond));
        let tokens = m::find(m::ENGINE_GENERATED_TOKENS).unwrap();
        assert_eq!(unit_of(tokens), Some(Unit::Count));
        assert_eq!(unit_of(m::find(m::ENGINE_BUSY_RATIO).unwrap()), None);
    }

    #[test]
    fn transitions_are_the_state_machines() {
        let t = transitions();
        assert!(t.contains(&("completed", "consumed")));
        assert!(!t.contains(&("consumed", "completed")));
        assert!(t.contains(&("aborted", "cleared")));
        assert!(!t.contains(&("in_flight", "cleared")));
        assert_eq!(t.len(), 14);
    }

    #[test]
    fn static_label_values_cover_the_knob_gauges() {
        let k = sluice_core::Knobs {
            staleness_threshold: 0.0,
            max_version_lag: 1,
            admission: Default::default(),
            enable_partial_rollout: true,
            tail_batch_candidate_steps: 0,
            tail_batch_trigger_size: 1,
            weight_update_mode: WeightUpdateMode::Drain,
            domain_mix: std::collections::BTreeMap::new(),
            max_concurrent_rollouts: 1,
            paused: false,
        };
        let names: Vec<&str> = k.gauge_values().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, sluice_core::knobs::gauge_names());
        for def in m::CATALOG {
            for label in def.labels {
                assert!(
                    static_values(def.name, label).is_some()
                        || [
                            "replica",
                            "domain",
                            "dataset",
                            "from",
                            "to",
                            "component",
                            "node",
                            "situation"
                        ]
                        .contains(label),
                    "{}: label `{label}` has no seeding rule",
                    def.name
                );
            }
        }
    }
}
