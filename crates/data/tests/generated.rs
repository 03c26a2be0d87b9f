//! The sampler over rows made on demand ([`GeneratorRows`]): synthetic rows per domain, the same
//! adaptive weights as over datasets, and exact checkpoint/restore of counters and generators.

use std::collections::BTreeMap;

use sluice_core::DataSample;
use sluice_data::{DomainOptions, GeneratorRows, MixSampler, SamplerConfig};

fn domains() -> Vec<String> {
    ["math", "code", "tools", "code"]
        .map(String::from)
        .into_iter()
        .collect()
}

fn mix() -> BTreeMap<String, f64> {
    BTreeMap::from([
        ("math".into(), 4.0),
        ("code".into(), 3.0),
        ("tools".into(), 3.0),
    ])
}

fn draws(s: &mut MixSampler<GeneratorRows>, n: usize) -> Vec<String> {
    (0..n).map(|_| s.next_sample(&mix()).unwrap().id).collect()
}

#[test]
fn synthetic_rows_are_numbered_per_domain() {
    let rows = GeneratorRows::synthetic(domains());
    let mut s = MixSampler::with_rows(SamplerConfig::new(3), rows).unwrap();
    assert_eq!(
        s.domain_names(),
        ["math", "code", "tools"],
        "duplicates dropped"
    );
    let mut next: BTreeMap<String, u64> = BTreeMap::new();
    for _ in 0..200 {
        let x = s.next_sample(&mix()).unwrap();
        let n = next.entry(x.domain.clone()).or_default();
        assert_eq!(x.id, format!("{}-{n}", x.domain));
        assert_eq!(x.dataset, "synthetic");
        assert_eq!(x.input["n"], *n);
        *n += 1;
    }
    let report = s.mix_report(&mix());
    let sampled: Vec<u64> = report.iter().map(|e| e.sampled).collect();
    assert_eq!(sampled, [next["math"], next["code"], next["tools"]]);
    // An empty mix weighs every generated domain the same.
    let even = s.mix_report(&BTreeMap::new());
    assert!(even.iter().all(|e| (e.target - 1.0 / 3.0).abs() < 1e-12));
}

#[test]
fn a_custom_generator_gets_the_domain_options() {
    let rows = GeneratorRows::new(
        ["a".to_owned(), "b".to_owned()],
        Box::new(|domain, n| DataSample {
            id: n.to_string(),
            domain: String::from("ignored: the row source sets it"),
            dataset: format!("{domain}_gen"),
            input: serde_json::json!(n * 2),
            system_prompt: None,
        }),
    );
    let mut config = SamplerConfig::new(1);
    config.domains.insert(
        "b".into(),
        DomainOptions {
            system_prompt: Some("Be brief.".into()),
            task: Some("sum_digits".into()),
        },
    );
    let mut s = MixSampler::with_rows(config, rows).unwrap();
    let x = s.next_sample(&BTreeMap::from([("b".into(), 1.0)])).unwrap();
    assert_eq!(
        (x.domain.as_str(), x.input.clone()),
        ("b", serde_json::json!(0))
    );
    assert_eq!(x.system_prompt.as_deref(), Some("Be brief."));
    assert_eq!(s.task_for(&x), "sum_digits");
    let y = s.next_sample(&BTreeMap::from([("a".into(), 1.0)])).unwrap();
    assert_eq!(s.task_for(&y), "a_gen");
    assert_eq!(y.system_prompt, None);
}

#[test]
fn completions_steer_generated_domains_within_the_clamp() {
    let mut s =
        MixSampler::with_rows(SamplerConfig::new(2), GeneratorRows::synthetic(domains())).unwrap();
    s.record_completed("math", 900);
    s.record_completed("tools", 100);
    s.record_completed("nope", 5);
    let r = s.mix_report(&mix());
    // math 0.4/0.9 → ×0.444; code never completed → ×10; tools 0.3/0.1 → ×3.
    let w = [0.4 * (0.4 / 0.9), 0.3 * 10.0, 0.3 * 3.0];
    let total: f64 = w.iter().sum();
    for (e, w) in r.iter().zip(w) {
        assert!((e.draw_probability - w / total).abs() < 1e-12, "{r:?}");
    }
    let mut fixed = SamplerConfig::new(2);
    fixed.adaptive = false;
    let mut f = MixSampler::with_rows(fixed, GeneratorRows::synthetic(domains())).unwrap();
    assert!(!f.is_adaptive());
    f.record_completed("math", 900);
    assert!((f.mix_report(&mix())[0].draw_probability - 0.4).abs() < 1e-12);
}

#[test]
fn checkpoint_restores_counters_rng_and_generators() {
    let mut a =
        MixSampler::with_rows(SamplerConfig::new(8), GeneratorRows::synthetic(domains())).unwrap();
    draws(&mut a, 120);
    a.record_completed("code", 40);
    a.record_completed("math", 7);
    let json = serde_json::to_string(&a.state()).unwrap();
    let mut b =
        MixSampler::with_rows(SamplerConfig::new(8), GeneratorRows::synthetic(domains())).unwrap();
    b.restore(serde_json::from_str(&json).unwrap()).unwrap();
    assert_eq!(a.state(), b.state());
    assert_eq!(a.mix_report(&mix()), b.mix_report(&mix()));
    assert_eq!(draws(&mut a, 300), draws(&mut b, 300));

    // Other domains: those in both carry on, an added one starts at its first row, a removed
    // one is dropped.
    let mut other = MixSampler::with_rows(
        SamplerConfig::new(8),
        GeneratorRows::synthetic(["math".to_owned(), "chat".to_owned()]),
    )
    .unwrap();
    other.restore(a.state()).unwrap();
    let (then, now) = (a.state(), other.state());
    assert_eq!(now.rows["math"], then.rows["math"]);
    assert_eq!(now.rows["chat"], 0);
    assert!(!now.rows.contains_key("code"));
    assert_eq!(now.domains["math"], then.domains["math"]);
}

#[test]
fn no_domain_is_refused() {
    let err = MixSampler::with_rows(SamplerConfig::new(0), GeneratorRows::synthetic(Vec::new()))
        .unwrap_err();
    assert_eq!(err.kind(), "sampler_config");
}
