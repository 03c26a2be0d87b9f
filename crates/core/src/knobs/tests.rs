//! Unit tests of the knobs: parsing, validation, patches and the handle.

use super::*;

fn knobs() -> Knobs {
    Knobs {
        staleness_threshold: 0.0,
        max_version_lag: 1,
        admission: Default::default(),
        enable_partial_rollout: true,
        tail_batch_candidate_steps: 0,
        tail_batch_trigger_size: 8,
        weight_update_mode: WeightUpdateMode::AbortResume,
        domain_mix: BTreeMap::from([("math".into(), 1.0), ("code".into(), 1.0)]),
        max_concurrent_rollouts: 64,
        paused: false,
    }
}

fn domains() -> Vec<String> {
    vec!["math".into(), "code".into()]
}

#[test]
fn assignments_parse_and_apply() {
    let patch = KnobPatch::from_assignments(&[
        "staleness_threshold=0.2",
        "weight_update_mode=in_flight",
        "domain_mix.math=3",
        "paused=true",
        "tail_batch_trigger_size=0",
    ])
    .unwrap();
    let next = patch.apply(&knobs(), 16, &domains()).unwrap();
    assert_eq!(next.staleness_threshold, 0.2);
    assert_eq!(next.weight_update_mode, WeightUpdateMode::InFlight);
    assert_eq!(next.domain_mix["math"], 3.0);
    assert_eq!(next.domain_mix["code"], 1.0, "domain_mix merges per domain");
    assert!(next.paused);
    assert_eq!(
        next.tail_batch_trigger_size, 16,
        "0 resolves to the default"
    );
    assert_eq!(next.domain_shares()["math"], 0.75);
    let auto = KnobPatch::from_assignments(&["max_concurrent_rollouts=0"]).unwrap();
    assert_eq!(
        auto.apply(&knobs(), 16, &domains())
            .unwrap()
            .max_concurrent_rollouts,
        0,
        "0 is the config's \"no cap beyond admission\", which follows η"
    );
}

#[test]
fn bad_values_are_refused_with_the_knob_name() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["staleness_threshold=-1"],
            "staleness_threshold: expected a finite number ≥ 0, got -1",
        ),
        (
            &["staleness_threshold=NaN"],
            "staleness_threshold: expected a finite number ≥ 0, got NaN",
        ),
        (
            &["staleness_threshold=1000"],
            "staleness_threshold: expected a number ≤ 100, got 1000",
        ),
        (
            &["max_version_lag=-1"],
            "max_version_lag: expected an integer ≥ 0, got `-1`",
        ),
        (
            &["weight_update_mode=sometimes"],
            "weight_update_mode: expected one of abort_resume, in_flight, drain, got `sometimes`",
        ),
        (
            &["max_concurrent_rollouts=1048577"],
            "max_concurrent_rollouts: expected an integer ≤ 1048576, got 1048577",
        ),
        (
            &["tail_batch_candidate_steps=4000000000"],
            "tail_batch_candidate_steps: expected an integer ≤ 1000000000, got 4000000000",
        ),
        (
            &["tail_batch_trigger_size=1000000001"],
            "tail_batch_trigger_size: expected an integer ≤ 1000000000, got 1000000001",
        ),
        (&["paused=yes"], "paused: expected true or false, got `yes`"),
        (
            &["domain_mix.chess=1"],
            "domain_mix.chess: unknown domain; the sampler serves: math, code",
        ),
        (
            &["domain_mix.math=-2"],
            "domain_mix.math: expected a finite weight in [0, 1e9], got -2",
        ),
        (
            &["domain_mix.math=0", "domain_mix.code=0"],
            "domain_mix: expected at least one weight > 0, all are 0",
        ),
        (
            &["stalenes_threshold=1"],
            "stalenes_threshold: unknown knob; knobs are: staleness_threshold, max_version_lag, admission, enable_partial_rollout, tail_batch_candidate_steps, tail_batch_trigger_size, weight_update_mode, domain_mix, max_concurrent_rollouts, paused",
        ),
        (&["paused"], "paused: expected `knob=value`, found no `=`"),
        (
            &["max_version_lag=2000000"],
            "max_version_lag: expected an integer ≤ 1000000, got 2000000",
        ),
        (
            &["domain_mix.math=1e300"],
            "domain_mix.math: expected a finite weight in [0, 1e9], got 1e300",
        ),
        (
            &["domain_mix={\"math\": 1}"],
            "domain_mix: set one domain per assignment: `domain_mix.<domain>=<weight>` (e.g. `domain_mix.math=0.4`)",
        ),
    ];
    for (input, expected) in cases {
        let err = KnobPatch::from_assignments(input)
            .and_then(|p| p.apply(&knobs(), 8, &domains()))
            .unwrap_err();
        assert_eq!(err.to_string(), *expected, "input {input:?}");
    }
}

#[test]
fn assignments_refuse_numbers_json_cannot_carry() {
    // `sluice knobs set` sends the patch as JSON, where NaN and infinity become `null`: the
    // assignments themselves refuse them, before any call.
    let cases: &[(&str, &str)] = &[
        (
            "staleness_threshold=nan",
            "staleness_threshold: expected a finite number ≥ 0, got NaN",
        ),
        (
            "staleness_threshold=inf",
            "staleness_threshold: expected a finite number ≥ 0, got inf",
        ),
        (
            "staleness_threshold=1e400",
            "staleness_threshold: expected a finite number ≥ 0, got inf",
        ),
        (
            "domain_mix.math=-inf",
            "domain_mix.math: expected a finite weight in [0, 1e9], got -inf",
        ),
    ];
    for (input, expected) in cases {
        let err = KnobPatch::from_assignments(&[input]).unwrap_err();
        assert_eq!(err.to_string(), *expected, "input {input:?}");
    }
}

#[test]
fn domain_mix_names_a_bounded_number_of_domains() {
    let mut k = knobs();
    k.domain_mix = (0..=MAX_DOMAINS).map(|i| (format!("d{i}"), 1.0)).collect();
    let err = k.validate(&[]).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "domain_mix: expected at most {MAX_DOMAINS} domains, got {}",
            MAX_DOMAINS + 1
        )
    );
    k.domain_mix.pop_last();
    assert!(k.validate(&[]).is_ok());
}

#[test]
fn handle_is_atomic_and_visible_to_subscribers() {
    let handle = KnobsHandle::new(knobs(), 8, domains()).unwrap();
    let mut rx = handle.subscribe();
    let bad = KnobPatch {
        max_version_lag: Some(4),
        staleness_threshold: Some(-0.5),
        ..KnobPatch::default()
    };
    assert!(handle.update(&bad).is_err());
    assert_eq!(handle.current(), knobs(), "a refused patch changes nothing");
    assert!(!rx.has_changed().unwrap());

    let good = KnobPatch {
        max_version_lag: Some(4),
        ..KnobPatch::default()
    };
    let changes = handle.update(&good).unwrap();
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0].knob, "max_version_lag");
    assert_eq!(
        (changes[0].old.clone(), changes[0].new.clone()),
        (1.into(), 4.into())
    );
    assert!(rx.has_changed().unwrap());
    assert_eq!(rx.borrow_and_update().max_version_lag, 4);
    assert!(
        handle.update(&good).unwrap().is_empty(),
        "a no-op patch reports no change"
    );
    assert!(!rx.has_changed().unwrap(), "and does not wake subscribers");
}

#[test]
fn patch_json_refuses_unknown_fields() {
    let err = serde_json::from_str::<KnobPatch>(r#"{"max_version_lagg": 2}"#).unwrap_err();
    assert!(
        err.to_string().contains("unknown field `max_version_lagg`"),
        "{err}"
    );
}

#[test]
fn names_and_gauges_come_from_the_struct() {
    // The spellings are an interface (API, CLI, config keys, metric labels): this list is the
    // golden copy the derive must keep producing.
    assert_eq!(
        knob_names(),
        [
            "staleness_threshold",
            "max_version_lag",
            "admission",
            "enable_partial_rollout",
            "tail_batch_candidate_steps",
            "tail_batch_trigger_size",
            "weight_update_mode",
            "domain_mix",
            "max_concurrent_rollouts",
            "paused",
        ]
    );
    assert_eq!(
        gauge_names(),
        [
            "staleness_threshold",
            "max_version_lag",
            "enable_partial_rollout",
            "tail_batch_candidate_steps",
            "tail_batch_trigger_size",
            "max_concurrent_rollouts",
            "paused",
        ]
    );
    let mut k = knobs();
    k.paused = true;
    k.staleness_threshold = 0.5;
    let values = k.gauge_values();
    let names: Vec<&str> = values.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, gauge_names());
    assert!(values.contains(&("paused", 1.0)));
    assert!(values.contains(&("staleness_threshold", 0.5)));
    assert!(values.contains(&("max_concurrent_rollouts", 64.0)));
}

#[test]
fn assignments_cover_every_knob_and_keep_the_last_value() {
    let patch = KnobPatch::from_assignments(&[
        "max_version_lag = 3",
        "admission=eta",
        "enable_partial_rollout=false",
        "tail_batch_candidate_steps=2",
        "max_concurrent_rollouts=9",
        "paused=true",
        "paused=false",
        "domain_mix.code=2",
        "domain_mix.code=0.5",
    ])
    .unwrap();
    assert_eq!(
        patch,
        KnobPatch {
            max_version_lag: Some(3),
            admission: Some(AdmissionMode::Eta),
            enable_partial_rollout: Some(false),
            tail_batch_candidate_steps: Some(2),
            max_concurrent_rollouts: Some(9),
            paused: Some(false),
            domain_mix: Some(BTreeMap::from([("code".into(), 0.5)])),
            ..KnobPatch::default()
        }
    );
    assert!(KnobPatch::from_assignments::<&str>(&[]).unwrap().is_empty());
}

#[test]
fn assignment_values_are_read_by_the_field_type() {
    let cases: &[(&str, &str)] = &[
        (
            "max_concurrent_rollouts=5000000000",
            "max_concurrent_rollouts: expected an integer ≤ 4294967295, got 5000000000",
        ),
        (
            "staleness_threshold=lots",
            "staleness_threshold: expected a number, got `lots`",
        ),
        (
            "admission=sometimes",
            "admission: expected one of demand, eta, got `sometimes`",
        ),
        (
            "domain_mix.math=heavy",
            "domain_mix.math: expected a number, got `heavy`",
        ),
        (
            "domain_mix.=1",
            "domain_mix.: unknown knob; knobs are: staleness_threshold, max_version_lag, admission, enable_partial_rollout, tail_batch_candidate_steps, tail_batch_trigger_size, weight_update_mode, domain_mix, max_concurrent_rollouts, paused",
        ),
    ];
    for (input, expected) in cases {
        let err = KnobPatch::from_assignments(&[*input]).unwrap_err();
        assert_eq!(err.to_string(), *expected, "input {input}");
    }
}

/// A knob tuned at runtime comes back on resume while the config's value is as it was; once
/// the config's value was edited, the config wins; untuned knobs follow the config; knobs a
/// checkpoint does not name are left to the config.
#[test]
fn a_resume_keeps_runtime_knobs_unless_the_config_changed_since() {
    let config = knobs();
    let mut runtime = knobs();
    runtime.staleness_threshold = 0.5;
    runtime.enable_partial_rollout = false;
    runtime.domain_mix.insert("math".into(), 3.0);
    let saved = KnobState::new(&config, &runtime);

    // The same config: every tuned knob comes back.
    let (patch, decisions) = resume_knobs(&saved, &config);
    let next = patch.apply(&config, 8, &domains()).unwrap();
    assert_eq!(next, runtime);
    assert_eq!(decisions.len(), 3, "{decisions:?}");
    assert!(
        decisions
            .iter()
            .all(|d| matches!(d, KnobResumed::Runtime { .. }))
    );

    // The file edited since for one tuned knob and one untuned one.
    let mut edited = knobs();
    edited.staleness_threshold = 0.25;
    edited.max_version_lag = 2;
    let (patch, decisions) = resume_knobs(&saved, &edited);
    let next = patch.apply(&edited, 8, &domains()).unwrap();
    assert_eq!(next.staleness_threshold, 0.25, "the edited config wins");
    assert_eq!(
        next.max_version_lag, 2,
        "an untuned knob follows the config"
    );
    assert!(
        !next.enable_partial_rollout,
        "an unedited tuned knob comes back"
    );
    assert_eq!(next.domain_mix["math"], 3.0);
    let said: Vec<String> = decisions.iter().map(ToString::to_string).collect();
    assert!(
        said.contains(&"staleness_threshold = 0.25: the config's value, edited since (0.0 → 0.25), wins over the value 0.5 set at runtime before the restart".to_owned()),
        "{said:?}"
    );
    assert!(
        said.contains(&"enable_partial_rollout = false: the value set at runtime before the restart (the config's is unchanged)".to_owned()),
        "{said:?}"
    );

    // A checkpoint that names only some knobs (written by another version): the rest stay.
    let mut partial = saved.clone();
    partial.runtime.retain(|k, _| k == "enable_partial_rollout");
    let (patch, _) = resume_knobs(&partial, &config);
    let next = patch.apply(&config, 8, &domains()).unwrap();
    assert_eq!(next.staleness_threshold, 0.0);
    assert!(!next.enable_partial_rollout);
    // A value that no longer reads as its knob is left to the config.
    let mut odd = saved;
    odd.runtime
        .insert("max_version_lag".into(), serde_json::json!("two"));
    let (patch, _) = resume_knobs(&odd, &config);
    assert_eq!(patch.max_version_lag, None);
    assert_eq!(patch.staleness_threshold, Some(0.5));
}
