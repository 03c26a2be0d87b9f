//! EnvSessions: dispatch by task name, lifecycle by rollout id, closing on episode end, caps.

mod common;

use std::sync::Arc;

use common::{renderer, rollout, sample};
use sluice_core::RolloutStatus;
use sluice_env::{ByteRenderer, EnvSessions, Next, TaskRegistry, TokenEnvLimits, TurnFinish};

fn sessions(max: usize) -> EnvSessions {
    EnvSessions::new(
        Arc::new(TaskRegistry::builtin()),
        renderer(),
        TokenEnvLimits::default(),
        max,
    )
}

fn reply(text: &str) -> Vec<u32> {
    ByteRenderer::encode(&format!("{text}{}", ByteRenderer::END))
}

#[tokio::test]
async fn sessions_live_from_start_to_done() {
    let s = sessions(8);
    let walk = sample(serde_json::json!({"start": 0, "target": 1, "max_steps": 3}));
    let (a, b) = (rollout(0).id, rollout(1).id);
    assert!(matches!(
        s.start(a, &walk, "episodic").await,
        Next::Generate(_)
    ));
    assert!(matches!(
        s.start(b, &walk, "episodic").await,
        Next::Generate(_)
    ));
    assert_eq!(s.open(), 2);
    let inc = reply("<|action_start|>inc()<|action_end|>");
    let done = reply("<|action_start|>done()<|action_end|>");
    let out = s.step(a, &inc, TurnFinish::Stop).await;
    assert_eq!(out.situation.as_deref(), Some("move"));
    assert!(matches!(out.next, Next::Generate(_)));
    let out = s.step(a, &done, TurnFinish::Stop).await;
    assert_eq!(out.next, Next::Done(RolloutStatus::Completed));
    assert_eq!(out.env_reward, Some(1.0));
    assert_eq!(s.open(), 1, "a finished session is closed and forgotten");
    let out = s.step(a, &done, TurnFinish::Stop).await;
    assert_eq!(
        out.next,
        Next::Done(RolloutStatus::Error("env_protocol".into()))
    );
    s.abandon(b).await;
    assert_eq!(s.open(), 0);
}

#[tokio::test]
async fn failures_to_start_are_statuses() {
    let s = sessions(1);
    let id = rollout(0).id;
    let arith = sample(sluice_env::tasks::arithmetic::problem_input(1, '+', 2));
    assert_eq!(
        s.start(id, &arith, "chess").await,
        Next::Done(RolloutStatus::Error("unknown_task".into()))
    );
    assert_eq!(
        s.start(id, &sample(serde_json::json!({})), "arithmetic")
            .await,
        Next::Done(RolloutStatus::Error("env_bad_input".into()))
    );
    assert!(matches!(
        s.start(id, &arith, "arithmetic").await,
        Next::Generate(_)
    ));
    assert_eq!(
        s.start(rollout(1).id, &arith, "arithmetic").await,
        Next::Done(RolloutStatus::Error("env_sessions_full".into()))
    );
    let out = s.step(id, &reply("3"), TurnFinish::Stop).await;
    assert_eq!(out.next, Next::Done(RolloutStatus::Completed));
    assert_eq!(s.open(), 0);
}
