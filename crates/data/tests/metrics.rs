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
    // A second reader of the same file (the warm-up's training problems) reports nothing again.
    let again = metrics::with_local_recorder(&rec, || {
        Dataset::load_again(
            dir.path(),
            &spec,
            BadLinePolicy::Skip,
            &sluice_data::ReadLimits::default(),
        )
        .unwrap()
    });
    assert_eq!(again.len(), 2);
    assert_eq!(
        rec.counter(&format!("{DATA_BAD_LINES}{{dataset=math::toy@train}}")),
        3,
        "counted once per file"
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

/// Runs `f` on a thread and waits at most 10 s for it: a read that blocks (a FIFO) fails the
/// test instead of hanging it.
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(10))
        .expect("the load returned (a FIFO once blocked it forever)")
}

/// Lines over `data.max_line_bytes` and lines that are not UTF-8 are bad lines of their own,
/// named with file and line, skipped or fatal per `on_bad_line` (one invalid byte once rejected
/// the whole file, with no line number, whatever the policy).
#[test]
fn long_and_non_utf8_lines_are_bad_lines_with_their_numbers() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("math")).unwrap();
    let path = dir.path().join("math/toy.jsonl");
    let mut text = b"{\"input\": 1}\n{\"input\": \"caf\xe9\"}\n".to_vec();
    text.extend_from_slice(format!("{{\"input\": \"{}\"}}\n", "x".repeat(100)).as_bytes());
    text.extend_from_slice(b"{\"input\": 2}\r\n");
    std::fs::write(&path, &text).unwrap();
    let spec = "math::toy".parse().unwrap();
    let limits = sluice_data::ReadLimits {
        max_line_bytes: 64,
        ..Default::default()
    };
    let ds = Dataset::load_limited(dir.path(), &spec, BadLinePolicy::Skip, &limits).unwrap();
    assert_eq!(ds.len(), 2);
    let bad: Vec<(usize, &str)> = ds
        .bad_lines()
        .iter()
        .map(|b| (b.line, b.reason.as_str()))
        .collect();
    assert_eq!(
        bad,
        [
            (2, "not UTF-8 text (invalid byte at column 15)"),
            (3, "line is 113 bytes, longer than data.max_line_bytes = 64"),
        ]
    );
    let err = Dataset::load_limited(dir.path(), &spec, BadLinePolicy::Fail, &limits).unwrap_err();
    assert!(
        err.to_string()
            .ends_with("toy.jsonl:2: not UTF-8 text (invalid byte at column 15)"),
        "{err}"
    );

    // The default limit: a 20 MB line is a bad line, the rows around it load.
    let mut big = b"{\"input\": 1}\n{\"input\": \"".to_vec();
    big.resize(big.len() + (20 << 20), b'x');
    big.extend_from_slice(b"\"}\n{\"input\": 2}\n");
    std::fs::write(&path, &big).unwrap();
    let ds = Dataset::load(dir.path(), &spec, BadLinePolicy::Skip).unwrap();
    assert_eq!(ds.len(), 2);
    assert_eq!(ds.bad_lines()[0].line, 2);
    assert!(
        ds.bad_lines()[0]
            .reason
            .contains("longer than data.max_line_bytes = 16777216"),
        "{:?}",
        ds.bad_lines()
    );
}

/// A dataset that is a device or a FIFO is refused by name without being read; one over
/// `data.max_file_bytes` is refused naming the cap.
#[cfg(unix)]
#[test]
fn special_and_oversized_dataset_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("math")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("math/zero.jsonl")).unwrap();
    let status = std::process::Command::new("mkfifo")
        .arg(dir.path().join("math/fifo.jsonl"))
        .status()
        .unwrap();
    assert!(status.success());
    for (name, what) in [("zero", "character device"), ("fifo", "FIFO")] {
        let root = dir.path().to_owned();
        let err = within_10s(move || {
            let spec = format!("math::{name}").parse().unwrap();
            Dataset::load(&root, &spec, BadLinePolicy::Skip).unwrap_err()
        });
        assert_eq!(err.kind(), "data_file");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("{name}.jsonl: is a {what}, not a regular file")),
            "{msg}"
        );
    }
    std::fs::write(
        dir.path().join("math/big.jsonl"),
        "{\"input\": 1}\n".repeat(10),
    )
    .unwrap();
    let limits = sluice_data::ReadLimits {
        max_file_bytes: 100,
        ..Default::default()
    };
    let spec = "math::big".parse().unwrap();
    let err = Dataset::load_limited(dir.path(), &spec, BadLinePolicy::Skip, &limits).unwrap_err();
    assert!(
        err.to_string().ends_with(
            "big.jsonl: larger than the 100 bytes limit for dataset files (data.max_file_bytes)"
        ),
        "{err}"
    );
}
