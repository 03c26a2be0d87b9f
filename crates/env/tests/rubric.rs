//! Rubric: weight normalization, overrides, components, concurrency, and containment of
//! panicking / hanging / failing reward functions.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{rollout, sample};
use sluice_core::{
    GroupId, Message, NodeId, PolicyVersion, RolloutGroup, RolloutStatus, RolloutTurn, RunId,
};
use sluice_env::{RewardFn, Rubric, RubricConfig, ScoreInput};

fn finished(text: &str, status: RolloutStatus) -> sluice_core::Rollout {
    let mut r = rollout(0);
    let mut t = RolloutTurn::new(vec![1]);
    t.completion_message = Some(Message::assistant(text));
    t.env_reward = Some(0.5);
    r.turns.push(t);
    r.status = status;
    r
}

fn says_yes(i: &ScoreInput) -> f64 {
    f64::from(u8::from(i.final_text() == Some("yes")))
}

#[tokio::test]
async fn weights_are_normalized_and_components_kept() {
    let rubric = Rubric::new(
        vec![
            RewardFn::new("yes", 3.0, says_yes),
            RewardFn::new("len", 1.0, |i| {
                i.final_text().map_or(0.0, |t| t.len() as f64)
            }),
        ],
        RubricConfig::default(),
    )
    .unwrap();
    assert_eq!(rubric.weights(), vec![("yes", 0.75), ("len", 0.25)]);
    let s = rubric
        .score(
            &sample(serde_json::json!({})),
            &finished("yes", RolloutStatus::Completed),
        )
        .await;
    assert!((s.reward - (0.75 * 1.0 + 0.25 * 3.0)).abs() < 1e-12);
    assert_eq!(s.components["yes"], 1.0);
    assert_eq!(s.components["len"], 3.0);
    assert_eq!(
        s.components["env"], 0.5,
        "env rewards are kept as a component"
    );
    assert_eq!(s.failed, None);
}

#[tokio::test]
async fn env_rewards_count_only_through_a_function() {
    let rubric = Rubric::new(
        vec![
            RewardFn::new("yes", 1.0, says_yes),
            RewardFn::env_reward(1.0),
        ],
        RubricConfig::default(),
    )
    .unwrap();
    let s = rubric
        .score(
            &sample(serde_json::json!({})),
            &finished("no", RolloutStatus::Completed),
        )
        .await;
    assert!((s.reward - 0.25).abs() < 1e-12, "0.5 × 0 + 0.5 × 0.5");
}

#[tokio::test]
async fn overrides_apply_only_when_set() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let fns = vec![RewardFn::new("yes", 1.0, move |i| {
        c.fetch_add(1, Ordering::SeqCst);
        says_yes(i)
    })];
    let with = Rubric::new(
        fns.clone(),
        RubricConfig {
            truncation_reward: Some(-1.0),
            error_reward: Some(-2.0),
            ..RubricConfig::default()
        },
    )
    .unwrap();
    let without = Rubric::new(fns, RubricConfig::default()).unwrap();
    let s = sample(serde_json::json!({}));
    assert_eq!(
        with.score(&s, &finished("yes", RolloutStatus::Truncated))
            .await
            .reward,
        -1.0
    );
    for status in [
        RolloutStatus::Error("env_panic".into()),
        RolloutStatus::Timeout,
        RolloutStatus::PromptTooLong,
        RolloutStatus::Expired,
    ] {
        assert_eq!(with.score(&s, &finished("yes", status)).await.reward, -2.0);
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "overrides skip the functions"
    );
    // Unset: the functions score the partial output.
    assert_eq!(
        without
            .score(&s, &finished("yes", RolloutStatus::Truncated))
            .await
            .reward,
        1.0
    );
    assert_eq!(
        without
            .score(&s, &finished("yes", RolloutStatus::Timeout))
            .await
            .reward,
        1.0
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn failing_functions_fail_their_rollout_only() {
    let rubric = Rubric::new(
        vec![
            RewardFn::new("yes", 1.0, says_yes),
            // Inline (no blocking pool): its panic is contained all the same.
            RewardFn::inline("picky", 1.0, |i| {
                if i.final_text() == Some("boom") {
                    panic!("picky exploded")
                }
                1.0
            }),
            RewardFn::fallible("strict", 1.0, |i| {
                if i.final_text() == Some("refuse") {
                    Err("cannot grade".into())
                } else {
                    Ok(1.0)
                }
            }),
            RewardFn::new("nan", 1.0, |i| {
                if i.final_text() == Some("nan") {
                    f64::NAN
                } else {
                    0.0
                }
            }),
        ],
        RubricConfig {
            error_reward: Some(-1.0),
            timeout_s: Some(5.0),
            ..RubricConfig::default()
        },
    )
    .unwrap();
    let mut g = RolloutGroup::new(
        GroupId {
            run: RunId::from_name("t"),
            node: NodeId(0),
            counter: 0,
        },
        sample(serde_json::json!({})),
        4,
        PolicyVersion(0),
    );
    for (r, text) in g.rollouts.iter_mut().zip(["yes", "boom", "refuse", "nan"]) {
        let f = finished(text, RolloutStatus::Completed);
        r.turns = f.turns;
        r.status = f.status;
    }
    rubric.score_group(&mut g).await;
    let r = &g.rollouts;
    assert_eq!(r[0].status, RolloutStatus::Completed);
    assert!((r[0].reward - 0.75).abs() < 1e-12);
    assert_eq!(r[1].status, RolloutStatus::Error("env_panic".into()));
    assert_eq!(r[1].reward, -1.0);
    assert_eq!(r[2].status, RolloutStatus::Error("env_failed".into()));
    assert_eq!(
        r[3].status,
        RolloutStatus::Error("env_failed".into()),
        "NaN is refused"
    );
    assert_eq!(
        r[1].reward_components["yes"], 0.0,
        "successful components survive"
    );
}

#[tokio::test]
async fn hanging_async_function_times_out_and_functions_run_concurrently() {
    // Every (rollout, function) pair of "a" and "b" waits on one barrier of 8 parties: it only
    // opens if all 8 calls are in flight at once. Run one after another, they would all time out.
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let gated = |name: &'static str| {
        let barrier = barrier.clone();
        RewardFn::new_async(name, 1.0, move |_i| {
            let barrier = barrier.clone();
            async move {
                barrier.wait().await;
                Ok(1.0)
            }
        })
    };
    let hang = RewardFn::new_async("hang", 1.0, |i: Arc<ScoreInput>| async move {
        if i.final_text() == Some("hang") {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        Ok(0.0)
    });
    let rubric = Rubric::new(
        vec![gated("a"), gated("b"), hang],
        RubricConfig {
            timeout_s: Some(2.0),
            ..RubricConfig::default()
        },
    )
    .unwrap();
    let mut g = RolloutGroup::new(
        GroupId {
            run: RunId::from_name("t"),
            node: NodeId(0),
            counter: 0,
        },
        sample(serde_json::json!({})),
        4,
        PolicyVersion(0),
    );
    for (i, r) in g.rollouts.iter_mut().enumerate() {
        let f = finished(if i == 3 { "hang" } else { "ok" }, RolloutStatus::Completed);
        r.turns = f.turns;
        r.status = f.status;
    }
    rubric.score_group(&mut g).await;
    for r in &g.rollouts[..3] {
        assert_eq!(r.status, RolloutStatus::Completed, "{r:?}");
        assert!((r.reward - 2.0 / 3.0).abs() < 1e-12);
    }
    assert_eq!(g.rollouts[3].status, RolloutStatus::Timeout);
    assert_eq!(g.rollouts[3].reward, 0.0);
    assert_eq!(g.rollouts[3].reward_components["a"], 1.0);
}

#[test]
fn invalid_rubrics_are_refused() {
    let f = || RewardFn::new("a", 1.0, |_| 0.0);
    assert!(Rubric::new(vec![], RubricConfig::default()).is_err());
    assert!(Rubric::new(vec![f(), f()], RubricConfig::default()).is_err());
    assert!(
        Rubric::new(
            vec![RewardFn::new("a", -1.0, |_| 0.0)],
            RubricConfig::default()
        )
        .is_err()
    );
    assert!(
        Rubric::new(
            vec![RewardFn::new("a", 0.0, |_| 0.0)],
            RubricConfig::default()
        )
        .is_err()
    );
    let bad_timeout = RubricConfig {
        timeout_s: Some(0.0),
        ..RubricConfig::default()
    };
    assert!(Rubric::new(vec![f()], bad_timeout).is_err());
}
