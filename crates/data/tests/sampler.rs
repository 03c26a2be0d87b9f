//! Behaviour of the domain sampler: adaptation toward the target under a slow domain, clamping,
//! reproducibility from the seed, exact checkpoint/restore, dispatch and system prompts.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use sluice_core::DataSample;
use sluice_data::config::DatasetSpec;
use sluice_data::rng::Rng;
use sluice_data::{Dataset, DomainOptions, DomainSampler, SamplerConfig};

fn dataset(spec: &str, rows: usize) -> Dataset {
    let spec: DatasetSpec = spec.parse().unwrap();
    let samples = (0..rows)
        .map(|i| DataSample {
            id: i.to_string(),
            domain: String::new(),
            dataset: String::new(),
            input: serde_json::json!({ "i": i }),
            system_prompt: None,
        })
        .collect();
    Dataset::from_samples(spec, samples)
}

fn three_domains() -> Vec<Dataset> {
    // Row counts deliberately far from the mix: the mix, not the sizes, must decide.
    vec![
        dataset("math::a", 50),
        dataset("code::b", 500),
        dataset("tools::c", 20),
    ]
}

fn mix() -> BTreeMap<String, f64> {
    BTreeMap::from([
        ("math".into(), 0.4),
        ("code".into(), 0.3),
        ("tools".into(), 0.3),
    ])
}

/// A discrete-event pipeline: `slots` rollouts in flight; each domain has a latency (time units,
/// with ±50 % jitter); a finished slot is refilled at once. Returns the completed share per domain
/// after `completions` rollouts.
fn simulate(adaptive: bool, completions: u64) -> BTreeMap<String, f64> {
    let mut config = SamplerConfig::new(11);
    config.adaptive = adaptive;
    let mut sampler = DomainSampler::new(config, three_domains()).unwrap();
    let latency = |d: &str| match d {
        "code" => 40.0,
        _ => 1.0,
    };
    let mut jitter = Rng::new(99);
    let slots = 256;
    let mut heap: BinaryHeap<Reverse<(u64, String)>> = BinaryHeap::new();
    let mut now = 0u64;
    let mut start = |sampler: &mut DomainSampler, now: u64, heap: &mut BinaryHeap<_>| {
        let s = sampler.next_sample(&mix()).unwrap();
        let t = latency(&s.domain) * (0.5 + jitter.next_f64());
        // Time in micro-units keeps the heap ordering exact.
        heap.push(Reverse((now + (t * 1e6) as u64, s.domain)));
    };
    for _ in 0..slots {
        start(&mut sampler, now, &mut heap);
    }
    let mut done = 0;
    while done < completions {
        let Reverse((t, domain)) = heap.pop().unwrap();
        now = t;
        sampler.record_completed(&domain, 1);
        done += 1;
        start(&mut sampler, now, &mut heap);
    }
    sampler
        .mix_report(&mix())
        .into_iter()
        .map(|e| (e.domain, e.actual))
        .collect()
}

#[test]
fn adaptation_brings_a_slow_domain_to_its_target() {
    let adaptive = simulate(true, 4000);
    let fixed = simulate(false, 4000);
    for (domain, target) in mix() {
        let got = adaptive[&domain];
        assert!(
            (got - target).abs() <= 0.03,
            "adaptive: {domain} completed {got:.3}, target {target}: {adaptive:?}"
        );
    }
    // Without adaptation, the slow domain's rollouts pile up in flight and its completed share
    // lags outside the band adaptation keeps.
    println!("adaptive {adaptive:?}\nfixed {fixed:?}");
    assert!(
        fixed["code"] < 0.3 - 0.035,
        "non-adaptive code share {:.3} should lag the 0.30 target: {fixed:?}",
        fixed["code"]
    );
}

#[test]
fn correction_ratio_is_clamped() {
    let mut sampler = DomainSampler::new(SamplerConfig::new(1), three_domains()).unwrap();
    // Before any completion the target is drawn as is.
    let report = sampler.mix_report(&mix());
    assert!((report[0].draw_probability - 0.4).abs() < 1e-12);
    // math massively over-completed, code never, tools exactly once.
    sampler.record_completed("math", 10_000);
    sampler.record_completed("tools", 1);
    let r = sampler.mix_report(&mix());
    let (math, code, tools) = (&r[0], &r[1], &r[2]);
    assert_eq!(math.domain, "math");
    // math: ratio 0.4/0.9999 → 0.4; code: no completion → max 10; tools: 0.3/1e-4 → clamp 10.
    let w = [0.4 * (0.4 / (10_000.0 / 10_001.0)), 0.3 * 10.0, 0.3 * 10.0];
    let total: f64 = w.iter().sum();
    assert!((math.draw_probability - w[0] / total).abs() < 1e-9, "{r:?}");
    assert!((code.draw_probability - w[1] / total).abs() < 1e-9, "{r:?}");
    assert!(
        (tools.draw_probability - w[2] / total).abs() < 1e-9,
        "{r:?}"
    );

    // The lower clamp: a domain far above target keeps at least 0.1 × its target.
    let mut s = DomainSampler::new(SamplerConfig::new(1), three_domains()).unwrap();
    s.record_completed("math", 1);
    s.record_completed("code", 1_000_000);
    s.record_completed("tools", 1_000_000);
    let r = s.mix_report(&mix());
    // code: actual ≈ 0.5, ratio 0.6 (no clamp); math: ratio 0.4/5e-7 → 10.
    let w = [
        0.4 * 10.0,
        0.3 * (0.3 / (1e6 / 2_000_001.0)),
        0.3 * (0.3 / (1e6 / 2_000_001.0)),
    ];
    let total: f64 = w.iter().sum();
    assert!((r[0].draw_probability - w[0] / total).abs() < 1e-9, "{r:?}");

    let mut low = SamplerConfig::new(1);
    low.domains.clear();
    let mut s = DomainSampler::new(low, vec![dataset("a::x", 5), dataset("b::y", 5)]).unwrap();
    let two = BTreeMap::from([("a".into(), 0.01), ("b".into(), 0.99)]);
    s.record_completed("a", 1_000_000);
    s.record_completed("b", 1);
    let r = s.mix_report(&two);
    // a: ratio 0.01/≈1 = 0.01 → clamped to 0.1; b: ratio 0.99/1e-6 → clamped to 10.
    let w = [0.01 * 0.1, 0.99 * 10.0];
    assert!(
        (r[0].draw_probability - w[0] / (w[0] + w[1])).abs() < 1e-12,
        "{r:?}"
    );
}

fn draw_ids(sampler: &mut DomainSampler, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            let s = sampler.next_sample(&mix()).unwrap();
            format!("{}:{}", s.domain, s.id)
        })
        .collect()
}

#[test]
fn same_seed_same_stream_other_seed_other_stream() {
    let mut a = DomainSampler::new(SamplerConfig::new(5), three_domains()).unwrap();
    let mut b = DomainSampler::new(SamplerConfig::new(5), three_domains()).unwrap();
    let mut c = DomainSampler::new(SamplerConfig::new(6), three_domains()).unwrap();
    let (x, y, z) = (
        draw_ids(&mut a, 200),
        draw_ids(&mut b, 200),
        draw_ids(&mut c, 200),
    );
    assert_eq!(x, y);
    assert_ne!(x, z);
}

#[test]
fn every_row_once_per_epoch() {
    let mut s = DomainSampler::new(
        SamplerConfig::new(3),
        vec![dataset("m::a", 7), dataset("m::b", 5)],
    )
    .unwrap();
    let mut first: Vec<String> = (0..12)
        .map(|_| {
            let x = s.next_sample(&BTreeMap::new()).unwrap();
            format!("{}:{}", x.dataset, x.id)
        })
        .collect();
    let second: Vec<String> = (0..12)
        .map(|_| {
            let x = s.next_sample(&BTreeMap::new()).unwrap();
            format!("{}:{}", x.dataset, x.id)
        })
        .collect();
    assert_ne!(first, second, "each epoch is reshuffled");
    first.sort();
    let mut second_sorted = second.clone();
    second_sorted.sort();
    assert_eq!(first, second_sorted);
    first.dedup();
    assert_eq!(first.len(), 12);
    assert_eq!(s.state().rows["m"].epoch, 1);
}

#[test]
fn checkpoint_restores_exactly() {
    let mut a = DomainSampler::new(SamplerConfig::new(9), three_domains()).unwrap();
    // Run into a second epoch of `tools` (20 rows) with completions recorded.
    for (i, id) in draw_ids(&mut a, 150).iter().enumerate() {
        if i % 3 == 0 {
            a.record_completed(id.split(':').next().unwrap(), 2);
        }
    }
    let json = serde_json::to_string(&a.state()).unwrap();
    let mut b = DomainSampler::new(SamplerConfig::new(9), three_domains()).unwrap();
    b.restore(serde_json::from_str(&json).unwrap()).unwrap();
    assert_eq!(a.state(), b.state());
    assert_eq!(a.mix_report(&mix()), b.mix_report(&mix()));
    assert_eq!(draw_ids(&mut a, 300), draw_ids(&mut b, 300));

    // A state with a cursor past its rows (an edited checkpoint) is refused, changing nothing.
    let mut bad = a.state();
    bad.rows.get_mut("math").unwrap().cursor = 51;
    let before = b.state();
    let err = b.restore(bad).unwrap_err();
    assert_eq!(err.kind(), "sampler_state_mismatch");
    assert!(err.to_string().contains("domain `math`"), "{err}");
    assert_eq!(b.state(), before);
}

/// A resume after the datasets changed: a domain whose data changed (row count, contents, or
/// dataset list) starts afresh; unchanged domains keep their positions; an added domain starts
/// afresh and a removed one is dropped; a state written before fingerprints is compared by
/// row count alone. Before, a changed row count refused the resume, a changed file of the same
/// size was resumed at the old file's position, and a domain added or removed refused it.
#[test]
fn a_restore_onto_changed_datasets_starts_only_the_changed_domains_afresh() {
    let mut a = DomainSampler::new(SamplerConfig::new(9), three_domains()).unwrap();
    draw_ids(&mut a, 150);
    a.record_completed("code", 5);
    let state = a.state();
    type State = sluice_data::SamplerState<BTreeMap<String, sluice_data::DomainCursor>>;
    let at = |s: &State, d: &str| {
        let c: &sluice_data::DomainCursor = &s.rows[d];
        (c.epoch, c.cursor)
    };
    assert!(at(&state, "math") != (0, 0) && at(&state, "code") != (0, 0));

    // `math` rewritten with as many rows (other contents), `code` as it was, `tools` removed,
    // `chat` added.
    let mut math = dataset("math::a", 50);
    math = Dataset::from_samples(
        math.spec().clone(),
        math.samples()
            .iter()
            .map(|s| DataSample {
                input: serde_json::json!({ "i": s.id, "edited": true }),
                ..s.clone()
            })
            .collect(),
    );
    let changed = vec![math, dataset("code::b", 500), dataset("chat::d", 7)];
    let mut b = DomainSampler::new(SamplerConfig::new(9), changed.clone()).unwrap();
    b.restore(serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap())
        .unwrap();
    let now = b.state();
    assert_eq!(at(&now, "math"), (0, 0), "changed contents: afresh");
    assert_eq!(at(&now, "code"), at(&state, "code"), "unchanged: kept");
    assert_eq!(at(&now, "chat"), (0, 0), "added: afresh");
    assert!(!now.rows.contains_key("tools"), "removed: dropped");
    assert_eq!(
        now.domains["code"], state.domains["code"],
        "mix counts kept"
    );
    assert_eq!(now.domains["chat"], Default::default());
    assert_ne!(now.rows["math"].fingerprint, state.rows["math"].fingerprint);

    // Another row count, or another dataset list, in a domain: afresh.
    let mut c = DomainSampler::new(
        SamplerConfig::new(9),
        vec![
            dataset("math::a", 51),
            dataset("code::b", 400),
            dataset("code::e", 100),
            dataset("tools::c", 20),
        ],
    )
    .unwrap();
    c.restore(state.clone()).unwrap();
    let now = c.state();
    assert_eq!(at(&now, "math"), (0, 0));
    assert_eq!(at(&now, "code"), (0, 0));
    assert_eq!(at(&now, "tools"), at(&state, "tools"));

    // A state written before fingerprints (no `datasets`, no `fingerprint`): unchanged row
    // counts keep their positions, whatever the contents; a changed count starts afresh.
    let mut old: serde_json::Value = serde_json::to_value(&state).unwrap();
    for cursor in old["rows"].as_object_mut().unwrap().values_mut() {
        let cursor = cursor.as_object_mut().unwrap();
        cursor.remove("datasets");
        cursor.remove("fingerprint");
    }
    let mut d = DomainSampler::new(SamplerConfig::new(9), changed).unwrap();
    d.restore(serde_json::from_value(old).unwrap()).unwrap();
    let now = d.state();
    assert_eq!(
        at(&now, "math"),
        at(&state, "math"),
        "old state: treated as unchanged"
    );
    assert_eq!(at(&now, "code"), at(&state, "code"));
    assert!(
        now.rows["math"].fingerprint.is_some(),
        "the next state carries one"
    );
}

#[test]
fn system_prompts_tasks_and_zero_weights() {
    let mut config = SamplerConfig::new(1);
    config.domains.insert(
        "code".into(),
        DomainOptions {
            system_prompt: Some("You write Rust.".into()),
            task: Some("sandbox".into()),
        },
    );
    let mut s = DomainSampler::new(config, three_domains()).unwrap();
    let only_code = BTreeMap::from([("code".into(), 1.0), ("math".into(), 0.0)]);
    for _ in 0..20 {
        let x = s.next_sample(&only_code).unwrap();
        assert_eq!(x.domain, "code", "zero and missing weights are never drawn");
        assert_eq!(x.system_prompt.as_deref(), Some("You write Rust."));
        assert_eq!(s.task_for(&x), "sandbox");
    }
    let m = s
        .next_sample(&BTreeMap::from([("math".into(), 1.0)]))
        .unwrap();
    assert_eq!(m.system_prompt, None);
    assert_eq!(s.task_for(&m), "a");
    assert!(
        s.next_sample(&BTreeMap::from([("nope".into(), 1.0)]))
            .is_none()
    );

    let mut bad = SamplerConfig::new(1);
    bad.domains.insert("chess".into(), DomainOptions::default());
    let err = DomainSampler::new(bad, three_domains()).unwrap_err();
    assert!(err.to_string().contains("`chess`"), "{err}");
}

#[test]
fn datasets_that_are_all_empty_are_named() {
    let err = DomainSampler::new(
        SamplerConfig::new(1),
        vec![dataset("math::a", 0), dataset("code::b", 0)],
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "sampler: every dataset is empty: `math::a` (no rows), `code::b` (no rows)"
    );
}

#[test]
fn empty_mix_follows_row_counts() {
    let s = DomainSampler::new(SamplerConfig::new(1), three_domains()).unwrap();
    let r = s.mix_report(&BTreeMap::new());
    assert!((r[1].target - 500.0 / 570.0).abs() < 1e-12);
}

#[test]
fn live_domain_mix_knob_steers_the_next_draws() {
    use sluice_core::{KnobPatch, Knobs, KnobsHandle, WeightUpdateMode};
    let knobs = Knobs {
        staleness_threshold: 0.0,
        max_version_lag: 1,
        admission: Default::default(),
        enable_partial_rollout: true,
        tail_batch_candidate_steps: 0,
        tail_batch_trigger_size: 1,
        weight_update_mode: WeightUpdateMode::AbortResume,
        domain_mix: mix(),
        max_concurrent_rollouts: 8,
        paused: false,
    };
    let domains = vec!["math".to_owned(), "code".to_owned(), "tools".to_owned()];
    let handle = KnobsHandle::new(knobs, 1, domains).unwrap();
    let mut s = DomainSampler::new(SamplerConfig::new(4), three_domains()).unwrap();
    let count = |s: &mut DomainSampler, d: &str| {
        (0..300)
            .filter(|_| s.next_from_knobs(&handle).unwrap().domain == d)
            .count()
    };
    assert!(count(&mut s, "tools") > 50, "tools is 30 % of the mix");
    let patch = KnobPatch::from_assignments(&["domain_mix.tools=0"]).unwrap();
    handle.update(&patch).unwrap();
    assert_eq!(
        count(&mut s, "tools"),
        0,
        "a domain turned off is no longer drawn"
    );
}

#[test]
fn settings_come_from_the_data_config() {
    // The `[data]` section, its keys without the header.
    let text = r#"
        datasets = ["math::a", "code::b", "tools::c"]
        adaptive_mix = false
        [domains.code]
        system_prompt = "You write Rust."
        task = "sandbox"
    "#;
    let raw: sluice_data::config::RawData = toml::from_str(text).unwrap();
    let overridden = std::collections::BTreeSet::new();
    let ctx = sluice_core::config::check::Ctx {
        file: "t.toml",
        overridden: &overridden,
        env: &|_| None,
    };
    let data = sluice_data::config::validate_data(raw, &ctx).unwrap();
    let sc = SamplerConfig::from_data_config(&data, 5);
    assert!(!sc.adaptive);
    assert_eq!((sc.min_ratio, sc.max_ratio, sc.seed), (0.1, 10.0, 5));
    assert_eq!(sc.domains["code"].task.as_deref(), Some("sandbox"));
    let mut s = DomainSampler::new(sc, three_domains()).unwrap();
    s.record_completed("math", 100);
    let r = s.mix_report(&mix());
    assert!(
        (r[0].draw_probability - 0.4).abs() < 1e-12,
        "no adaptation: {r:?}"
    );
}
