//! Property: random JSON bodies against the mutating admin routes never hurt a running node.
//! Bodies are arbitrary `serde_json::Value` trees whose object keys are often real knob names
//! with random values. Every answer is 2xx or 4xx (never 5xx), every answer is JSON, a refused
//! call changes no knob, an accepted patch leaves valid knobs, and the node keeps serving and
//! running: its actors are all alive at the end.

use crate::common;

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use serde_json::{Map, Number, Value};
use sluice_core::Knobs;
use sluice_core::knobs::knob_names;
use sluice_node::client::{Call, send};
use sluice_node::{Node, NodeOptions};

const TOKEN: &str = "prop-token";

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(knob_names().to_vec()).prop_map(str::to_owned),
        1 => "[a-z_]{1,12}",
        1 => Just("sim".to_owned()),
    ]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (-3i64..70).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e3f64..1e3).prop_map(Value::from),
        prop_oneof![Just(1e300), Just(-1e300), Just(4_294_967_296.0), Just(0.5)]
            .prop_map(|f| Value::Number(Number::from_f64(f).unwrap())),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        prop_oneof![
            Just("in_flight".to_owned()),
            Just("drain".to_owned()),
            Just("abort_resume".to_owned()),
            ".{0,8}",
        ]
        .prop_map(Value::String),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec((key(), inner), 0..5)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A well-typed value for `knob`, often extreme, so accepted patches push the pipeline around.
fn typed_value(knob: &'static str) -> BoxedStrategy<Value> {
    match knob {
        "staleness_threshold" => prop_oneof![
            (0.0f64..4.0).prop_map(Value::from),
            Just(Value::from(1e300)),
            Just(Value::from(-1.0)),
        ]
        .boxed(),
        "max_version_lag" => {
            prop_oneof![(0u64..4).prop_map(Value::from), Just(Value::from(u64::MAX))].boxed()
        }
        "tail_batch_candidate_steps" | "tail_batch_trigger_size" | "max_concurrent_rollouts" => {
            prop_oneof![(0u32..5).prop_map(Value::from), Just(Value::from(u32::MAX))].boxed()
        }
        "enable_partial_rollout" | "paused" => any::<bool>().prop_map(Value::Bool).boxed(),
        "weight_update_mode" => {
            proptest::sample::select(vec!["abort_resume", "in_flight", "drain"])
                .prop_map(Value::from)
                .boxed()
        }
        _ => proptest::collection::btree_map("[a-c]{1,2}", 0.0f64..3.0, 0..3)
            .prop_map(|m| serde_json::to_value(m).unwrap())
            .boxed(),
    }
}

/// A patch of real knobs with type-correct values: mostly accepted, sometimes out of range.
fn typed_patch() -> impl Strategy<Value = Value> {
    proptest::sample::subsequence(knob_names().to_vec(), 1..4)
        .prop_flat_map(|knobs| {
            knobs
                .into_iter()
                .map(|k| (Just(k), typed_value(k)))
                .collect::<Vec<_>>()
        })
        .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()))
}

/// A body: well-typed patches, objects of knob-like keys with random values, or anything.
fn body() -> impl Strategy<Value = Value> {
    prop_oneof![
        2 => typed_patch(),
        2 => proptest::collection::vec((key(), value()), 0..4)
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        1 => value(),
    ]
}

fn route() -> impl Strategy<Value = (&'static str, &'static str)> {
    prop_oneof![
        4 => Just(("PATCH", "/v1/knobs")),
        1 => Just(("POST", "/v1/pause")),
        1 => Just(("POST", "/v1/resume")),
    ]
}

fn get_knobs(base: &str) -> Knobs {
    let call = Call {
        method: "GET",
        path: "/v1/knobs",
        body: b"",
        token: None,
        content_type: None,
    };
    let (code, body) = send(base, &call).expect("GET /v1/knobs");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("knobs JSON")
}

/// How many calls the node accepted and refused.
#[derive(Default)]
struct Tally {
    /// Calls answered 2xx.
    accepted: Cell<u32>,
    /// Calls answered 4xx.
    refused: Cell<u32>,
}

#[test]
fn random_bodies_never_crash_the_node_and_refusals_change_nothing() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let node = runtime.block_on(start_a_long_running_node());
    let base = Arc::new(format!("http://{}", node.admin_addr().unwrap()));

    let mut runner = TestRunner::new(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        // A wedged node makes every shrinking step wait for the client's read timeout.
        max_shrink_time: 60_000,
        ..ProptestConfig::default()
    });
    let tally = Tally::default();
    let outcome = runner.run(&(route(), body()), |(route, body)| {
        check_one_call(&base, route, &body, &tally)
    });
    // Let the pipeline run a moment on whatever knobs the last case left, then check that no
    // actor died along the way.
    std::thread::sleep(Duration::from_millis(300));
    let failure = node.failure();
    let status = runtime.block_on(node.status());
    runtime.block_on(node.shutdown());
    outcome.unwrap();
    assert_eq!(failure, None, "an actor died");
    let status = status.expect("every actor answers");
    assert_eq!(
        status.trainer.lag_violations, 0,
        "trained tokens older than η"
    );
    assert_eq!(
        status.trainer.duplicate_groups, 0,
        "a group was trained twice"
    );
    let (accepted, refused) = (tally.accepted.get(), tally.refused.get());
    assert!(
        accepted > 0 && refused > 0,
        "accepted {accepted}, refused {refused}"
    );
}

/// A node that runs for good (a million steps), serving the admin API with [`TOKEN`].
async fn start_a_long_running_node() -> Node {
    let mut config = common::config("", "time_scale = 1.0");
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.token = Some(sluice_config::Secret::new(TOKEN));
    config.run.max_steps = std::num::NonZeroU64::new(1_000_000).unwrap();
    let options = NodeOptions {
        serve_admin: true,
        ..NodeOptions::default()
    };
    Node::start(&config, options).await.unwrap()
}

/// One case: `body` sent to `route` with the token is answered 2xx or 4xx, in JSON; a refusal
/// changes no knob and says why, an acceptance leaves valid knobs and returns them; the node
/// still answers `/v1/status`.
fn check_one_call(
    base: &str,
    (method, path): (&'static str, &'static str),
    body: &Value,
    tally: &Tally,
) -> Result<(), TestCaseError> {
    let before = get_knobs(base);
    let bytes = serde_json::to_vec(body).unwrap();
    let call = Call {
        method,
        path,
        body: &bytes,
        token: Some(TOKEN),
        content_type: Some("application/json"),
    };
    let (code, answer) =
        send(base, &call).map_err(|e| TestCaseError::fail(format!("no answer: {e}")))?;
    let json: Value = serde_json::from_str(&answer)
        .map_err(|e| TestCaseError::fail(format!("{code} answer is not JSON ({e}): {answer}")))?;
    prop_assert!(
        (200..300).contains(&code) || (400..500).contains(&code),
        "{method} {path} {body} answered {code}: {answer}"
    );
    let after = get_knobs(base);
    if code >= 400 {
        tally.refused.set(tally.refused.get() + 1);
        prop_assert_eq!(
            &before,
            &after,
            "refused {} {} changed the knobs",
            method,
            body
        );
        prop_assert!(json["error"]["message"].is_string(), "{}", answer);
    } else {
        tally.accepted.set(tally.accepted.get() + 1);
        prop_assert!(
            method == "POST" || body.is_object(),
            "PATCH accepted a body that is not an object: {}",
            body
        );
        prop_assert!(
            after.validate(&[]).is_ok(),
            "accepted knobs are invalid: {after:?}"
        );
        prop_assert_eq!(&json["knobs"], &serde_json::to_value(&after).unwrap());
    }
    let status = Call {
        method: "GET",
        path: "/v1/status",
        body: b"",
        token: None,
        content_type: None,
    };
    let (code, s) = send(base, &status).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(code, 200, "status after {} {}: {}", method, body, s);
    Ok(())
}
