//! Bad lines and the domain-mix gauges reach the metrics recorder under the catalog's names.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use sluice_core::metrics::{DATA_BAD_LINES, DOMAIN_MIX_ROLLOUTS, DOMAIN_MIX_TARGET};
use sluice_data::config::BadLinePolicy;
use sluice_data::{Dataset, DomainSampler, SamplerConfig};

/// Keeps every counter/gauge as an atomic, keyed by `name{label=value,…}`.
#[derive(Default)]
struct TestRecorder {
    cells: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
}

impl TestRecorder {
    fn cell(&self, key: &Key) -> Arc<AtomicU64> {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        self.cells.lock().unwrap().entry(name).or_default().clone()
    }
    fn counter(&self, name: &str) -> u64 {
        self.cells
            .lock()
            .unwrap()
            .get(name)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
    fn gauge(&self, name: &str) -> f64 {
        f64::from_bits(self.counter(name))
    }
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.cell(key))
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[test]
fn bad_lines_are_counted_per_dataset_and_file_loads_from_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("math/toy")).unwrap();
    std::fs::write(
        dir.path().join("math/toy/train.jsonl"),
        "{\"input\": 1}\n{oops\n\n{\"input\": 2}\n42\n",
    )
    .unwrap();
    let rec = TestRecorder::default();
    let spec = "math::toy@train".parse().unwrap();
    let ds = metrics::with_local_recorder(&rec, || {
        Dataset::load(dir.path(), &spec, BadLinePolicy::Skip).unwrap()
    });
    assert_eq!(ds.len(), 2);
    assert_eq!(
        ds.bad_lines().iter().map(|b| b.line).collect::<Vec<_>>(),
        [2, 5]
    );
    assert_eq!(
        rec.counter(&format!("{DATA_BAD_LINES}{{dataset=math::toy@train}}")),
        2
    );

    let err = metrics::with_local_recorder(&rec, || {
        Dataset::load(dir.path(), &spec, BadLinePolicy::Fail).unwrap_err()
    });
    assert!(err.to_string().contains("train.jsonl:2:"), "{err}");
    assert_eq!(
        rec.counter(&format!("{DATA_BAD_LINES}{{dataset=math::toy@train}}")),
        3,
        "the fatal line is counted too"
    );

    let mut sampler = DomainSampler::new(SamplerConfig::new(0), vec![ds]).unwrap();
    sampler.record_completed("math", 5);
    let mix = BTreeMap::from([("math".to_owned(), 2.0)]);
    metrics::with_local_recorder(&rec, || sampler.publish_metrics(&mix));
    assert_eq!(
        rec.counter(&format!("{DOMAIN_MIX_ROLLOUTS}{{domain=math}}")),
        5
    );
    assert_eq!(
        rec.gauge(&format!("{DOMAIN_MIX_TARGET}{{domain=math}}")),
        1.0
    );
}
