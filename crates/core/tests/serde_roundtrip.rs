//! Every core type survives JSON (the admin API, logs) and TOML where relevant, unchanged: these
//! values are persisted and sent between nodes.

use std::collections::BTreeMap;
use std::fmt::Debug;

use serde::{Serialize, de::DeserializeOwned};
use sluice_core::message::{FunctionCall, FunctionSpec};
use sluice_core::*;

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) {
    let json = serde_json::to_string(value).unwrap();
    let back: T = serde_json::from_str(&json).unwrap();
    assert_eq!(&back, value, "json: {json}");
}

fn group_id() -> GroupId {
    GroupIdGenerator::new(RunId::from_name("serde"), NodeId(2), 41).next_id()
}

fn turn() -> RolloutTurn {
    let mut t = RolloutTurn::new(vec![1, 2, 3]);
    t.prompt_messages = vec![Message::system("be brief"), Message::user("2+2?")];
    t.append_tokens(
        &[7, 8],
        &[-0.5, -1.25],
        &[PolicyVersion(3), PolicyVersion(4)],
    )
    .unwrap();
    t.completion_message = Some(Message {
        reasoning_content: Some("add".into()),
        tool_calls: vec![ToolCall {
            id: "call_0".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "calc".into(),
                arguments: r#"{"expr":"2+2"}"#.into(),
            },
        }],
        ..Message::assistant("4")
    });
    t.env_messages = vec![Message::tool("call_0", "4")];
    t.env_reward = Some(0.5);
    t.situation = Some("search".into());
    t
}

#[test]
fn ids_and_versions() {
    let g = group_id();
    round_trip(&g);
    round_trip(&g.run);
    round_trip(&NodeId(9));
    round_trip(&g.rollout(3));
    round_trip(&g.rollout(3).request(1, 2));
    round_trip(&PolicyVersion(17));
    // Ids are strings on the wire, so they can be map keys and be pasted into the admin API.
    assert_eq!(
        serde_json::to_value(g).unwrap(),
        serde_json::Value::String(g.to_string())
    );
}

#[test]
fn messages_and_tools() {
    round_trip(&Message::user("hi"));
    round_trip(&turn().completion_message.unwrap());
    round_trip(&ToolSpec {
        kind: "function".into(),
        function: FunctionSpec {
            name: "calc".into(),
            description: "evaluates arithmetic".into(),
            parameters: serde_json::json!({"type": "object", "properties": {"expr": {"type": "string"}}}),
        },
    });
    for role in [Role::System, Role::User, Role::Assistant, Role::Tool] {
        round_trip(&role);
    }
}

#[test]
fn rollouts_and_groups() {
    let sample = DataSample {
        id: "row-12".into(),
        domain: "math".into(),
        dataset: "arithmetic@train".into(),
        input: serde_json::json!({"question": "2+2", "answer": 4}),
        system_prompt: Some("Answer with a number.".into()),
    };
    round_trip(&sample);
    round_trip(&turn());
    round_trip(&RolloutTurn::new(vec![]));
    let mut group = RolloutGroup::new(group_id(), sample, 2, PolicyVersion(3));
    group.rollouts[0].turns.push(turn());
    group.rollouts[0].status = RolloutStatus::Completed;
    group.rollouts[0].reward = 1.0;
    group.rollouts[0].reward_components = BTreeMap::from([("exact".into(), 1.0)]);
    group.rollouts[1].status = RolloutStatus::Error("env_panic".into());
    group.rollouts[1].abort_count = 2;
    round_trip(&group);
    for status in [
        RolloutStatus::Ongoing,
        RolloutStatus::Completed,
        RolloutStatus::Truncated,
        RolloutStatus::PromptTooLong,
        RolloutStatus::Aborted,
        RolloutStatus::Expired,
        RolloutStatus::Timeout,
        RolloutStatus::Error("timeout_reward".into()),
    ] {
        round_trip(&status);
    }
}

#[test]
fn knobs_and_patches() {
    let knobs = Knobs {
        staleness_threshold: 0.2,
        max_version_lag: 2,
        admission: Default::default(),
        enable_partial_rollout: false,
        tail_batch_candidate_steps: 1,
        tail_batch_trigger_size: 8,
        weight_update_mode: WeightUpdateMode::InFlight,
        domain_mix: BTreeMap::from([("math".into(), 0.4)]),
        max_concurrent_rollouts: 64,
        paused: true,
    };
    round_trip(&knobs);
    round_trip(&KnobPatch::from_assignments(&["paused=false", "domain_mix.math=2"]).unwrap());
    round_trip(&KnobPatch::default());
    for mode in WeightUpdateMode::ALL {
        round_trip(&mode);
    }
}
