//! Invariants of the adaptive weights for arbitrary targets and completion histories: the draw
//! probabilities are a distribution, zero exactly where the target is zero, and the correction
//! never moves a domain's probability/target ratio beyond the clamp (spread ≤ 10 / 0.1 = 100).

use std::collections::BTreeMap;

use proptest::prelude::*;
use sluice_core::DataSample;
use sluice_data::config::DatasetSpec;
use sluice_data::{Dataset, DomainSampler, SamplerConfig};

fn dataset(domain: &str) -> Dataset {
    let spec: DatasetSpec = format!("{domain}::x").parse().unwrap();
    let row = DataSample {
        id: "0".into(),
        domain: String::new(),
        dataset: String::new(),
        input: serde_json::Value::Null,
        system_prompt: None,
    };
    Dataset::from_samples(spec, vec![row])
}

proptest! {
    #[test]
    fn draw_probabilities_respect_targets_and_clamp(
        weights in prop::collection::vec(prop_oneof![Just(0.0), 0.01f64..5.0], 4),
        completed in prop::collection::vec(0u64..10_000, 4),
    ) {
        prop_assume!(weights.iter().any(|&w| w > 0.0));
        let names = ["a", "b", "c", "d"];
        let mut s = DomainSampler::new(
            SamplerConfig::new(1),
            names.iter().map(|n| dataset(n)).collect(),
        )
        .unwrap();
        for (n, c) in names.iter().zip(&completed) {
            s.record_completed(n, *c);
        }
        let mix: BTreeMap<String, f64> =
            names.iter().zip(&weights).map(|(n, w)| (n.to_string(), *w)).collect();
        let report = s.mix_report(&mix);
        let total: f64 = report.iter().map(|e| e.draw_probability).sum();
        prop_assert!((total - 1.0).abs() < 1e-9);
        let ratios: Vec<f64> = report
            .iter()
            .filter(|e| e.target > 0.0)
            .map(|e| e.draw_probability / e.target)
            .collect();
        for e in &report {
            prop_assert_eq!(e.target == 0.0, e.draw_probability == 0.0, "{:?}", e);
        }
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        prop_assert!(hi / lo <= 100.0 + 1e-9, "spread {} in {:?}", hi / lo, report);
        // Every draw lands on a domain with a positive target.
        let x = s.next_sample(&mix).unwrap();
        prop_assert!(mix[&x.domain] > 0.0);
    }
}
