//! Rubric: weight normalization, overrides, components, concurrency, and containment of
//! panicking / hanging / failing reward functions; (`rubric/judge.rs`) the `judge` function
//! against a stub OpenAI-compatible server; (`rubric/reward_model.rs`) the `reward_model`
//! function over a scorer of the test's.

mod common;
#[path = "rubric/judge.rs"]
mod judge;
#[path = "rubric/reward_model.rs"]
mod reward_model;

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

/// The math answer of a reply, one row per edge: where it is taken from, and how its number is
/// read.
#[test]
fn math_answer_extraction_edges() {
    use sluice_env::answer::math_answer;
    let cases: &[(&str, Option<f64>)] = &[
        ("so 20 + 9 = 29", Some(29.0)),
        ("It costs $1,234.", Some(1234.0)),
        ("The total is 1,234,567 apples", Some(1_234_567.0)),
        ("temperature dropped to -3 degrees", Some(-3.0)),
        ("x is −4", Some(-4.0)),
        ("5-3 leaves 2", Some(2.0)),
        ("it is 3.50", Some(3.5)),
        ("we get 7. Done.", Some(7.0)),
        // `####`: the first number after the last one, whatever came before or after.
        ("#### 5\nthen 6\n#### 8 apples\nbye 9", Some(8.0)),
        ("#### $1,000", Some(1000.0)),
        ("#### none\n12", None),
        // `\boxed{}` wins over `####` and stray numbers; braces nest; the last one counts.
        (r"\boxed{3} no wait \boxed{4} #### 5", Some(4.0)),
        (r"\boxed{\text{{12}} apples}", Some(12.0)),
        (r"\boxed{\$1{,}200}", Some(1200.0)),
        (r"\boxed{x}", None),
        (r"\boxed{7} and \boxed{8", Some(7.0)),
        ("no number at all", None),
        ("", None),
        ("答案是 72。", Some(72.0)),
        ("١٢ and ７２ are not ASCII digits", None),
    ];
    for (text, want) in cases {
        assert_eq!(math_answer(text), *want, "{text:?}");
    }
}

#[test]
fn math_answers_compare_as_numbers_with_the_reference() {
    use sluice_env::answer::{math_answer_matches, parse_number, reference_answer};
    let gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72";
    assert_eq!(reference_answer(gsm8k), "72");
    assert!(math_answer_matches("She sold 72 clips.", gsm8k));
    assert!(math_answer_matches("#### 72.0", gsm8k));
    assert!(!math_answer_matches(
        "She sold 48 + 24 = 96... no, 71",
        gsm8k
    ));
    assert!(math_answer_matches("3.50", "3.5"));
    assert!(math_answer_matches("-3", "#### -3"));
    assert!(math_answer_matches("$1,234.00", "1234"));
    assert!(math_answer_matches("0.30000000000000004", "0.3"));
    assert!(!math_answer_matches("0.31", "0.3"));
    assert!(!math_answer_matches("no number", "5"));
    // A reference without a number: the reply's final answer must equal it as text.
    assert!(math_answer_matches("#### Paris", "Paris"));
    assert!(!math_answer_matches("#### paris", "Paris"));
    assert_eq!(parse_number(" $-1,234.5. "), Some(-1234.5));
    assert_eq!(parse_number("3 apples"), None);
    assert_eq!(parse_number("1,23"), None);
}

#[tokio::test]
async fn numeric_references_are_written_out_without_an_exponent() {
    use sluice_env::answer::number_text;
    let text = |v: serde_json::Value| number_text(v.as_number().unwrap());
    assert_eq!(text(serde_json::json!(0.000001)), "0.000001");
    assert_eq!(text(serde_json::json!(2.5e20)), "250000000000000000000");
    assert_eq!(text(serde_json::json!(72)), "72");
    assert_eq!(text(serde_json::json!(-3.5)), "-3.5");
    // Scored through a rubric: `1e-6` read as text would make 6 the answer.
    let task = sluice_env::TaskRegistry::builtin()
        .get("word_problems")
        .unwrap();
    let spec = sluice_data::config::DomainRubric {
        weights: [("math_answer".to_owned(), 1.0)].into(),
        truncation_reward: None,
        error_reward: None,
        timeout: None,
        regex: None,
        judge: None,
        reward_model: None,
    };
    let rubric = sluice_env::configured::rubric_for(&task, &spec).unwrap();
    let s = sample(serde_json::json!({"answer": 0.000001}));
    for (reply, want) in [("#### 0.000001", 1.0), ("#### 6", 0.0)] {
        let score = rubric
            .score(&s, &finished(reply, RolloutStatus::Completed))
            .await;
        assert_eq!(score.components["math_answer"], want, "{reply}");
    }
}

proptest::proptest! {
    /// Any integer, written plainly, with thousands separators, a `$`, a trailing `.` or as a
    /// decimal with trailing zeros, inside text or after `####` or boxed, reads back as itself.
    #[test]
    fn numbers_read_back_however_written(n in -10_000_000i64..10_000_000, style in 0usize..6) {
        let plain = n.to_string();
        let grouped = {
            let digits = n.unsigned_abs().to_string();
            let mut out = String::new();
            for (i, c) in digits.chars().enumerate() {
                if i > 0 && (digits.len() - i) % 3 == 0 {
                    out.push(',');
                }
                out.push(c);
            }
            if n < 0 { format!("-{out}") } else { out }
        };
        let text = match style {
            0 => format!("the answer is {plain}"),
            1 => format!("so we have {grouped} in total."),
            2 => format!("costs ${grouped}."),
            3 => format!("{plain}.00"),
            4 => format!("steps 1 2 3\n#### {grouped}\nthanks 4"),
            _ => format!(r"\boxed{{{grouped}}} 99"),
        };
        proptest::prop_assert_eq!(sluice_env::answer::math_answer(&text), Some(n as f64), "{}", text);
        let reference = format!("x\n#### {plain}");
        proptest::prop_assert!(sluice_env::answer::math_answer_matches(&text, &reference), "{}", text);
    }
}

/// The generic answer functions a config can weight on any task: `math_answer`, `exact_match`,
/// `format`, and `regex` with and without a capture group.
#[tokio::test]
async fn generic_answer_functions_score_replies_against_the_reference() {
    use sluice_data::config::DomainRubric;
    use sluice_env::configured::rubric_for;
    let task = sluice_env::TaskRegistry::builtin()
        .get("word_problems")
        .unwrap();
    let spec = |weights: &[&str], regex: Option<&str>| DomainRubric {
        weights: weights.iter().map(|w| (w.to_string(), 1.0)).collect(),
        truncation_reward: None,
        error_reward: None,
        timeout: None,
        regex: regex.map(str::to_owned),
        judge: None,
        reward_model: None,
    };
    let gsm = sample(serde_json::json!({"answer": "48 + 24 = 72\n#### 72"}));
    let score = |rubric: &Rubric, text: &str| {
        let r = finished(text, RolloutStatus::Completed);
        let rubric = rubric.clone();
        let s = gsm.clone();
        async move { rubric.score(&s, &r).await.components }
    };
    let all = rubric_for(&task, &spec(&["math_answer", "exact_match"], None)).unwrap();
    let c = score(&all, "48 + 24 = 72 clips.\n#### 72").await;
    assert_eq!((c["math_answer"], c["exact_match"]), (1.0, 1.0));
    let c = score(&all, "It is 72 clips.").await;
    assert_eq!(
        (c["math_answer"], c["exact_match"]),
        (1.0, 0.0),
        "exact_match takes the whole reply without a marker"
    );
    let c = score(&all, "#### 72.0").await;
    assert_eq!((c["math_answer"], c["exact_match"]), (1.0, 0.0));

    let captured = rubric_for(&task, &spec(&["regex"], Some(r"(?i)answer:\s*(\S+)"))).unwrap();
    assert_eq!(score(&captured, "Answer: 72").await["regex"], 1.0);
    assert_eq!(
        score(&captured, "answer: 70, no, answer: 72.00").await["regex"],
        1.0,
        "the last match, as numbers"
    );
    assert_eq!(score(&captured, "Answer: 71").await["regex"], 0.0);
    assert_eq!(score(&captured, "72").await["regex"], 0.0, "no match");
    let plain = rubric_for(&task, &spec(&["regex"], Some(r"^\d+$"))).unwrap();
    assert_eq!(
        score(&plain, "5").await["regex"],
        1.0,
        "no group: a match is enough"
    );
    assert_eq!(score(&plain, "five").await["regex"], 0.0);

    // `regex` without a pattern is refused naming the key; unknown names list the generic ones.
    let err = rubric_for(&task, &spec(&["regex"], None)).unwrap_err();
    assert!(
        err.starts_with("weights.regex:") && err.contains("pattern"),
        "{err}"
    );
    let err = rubric_for(&task, &spec(&["bogus"], None)).unwrap_err();
    assert!(err.contains("math_answer, exact_match, regex"), "{err}");

    // On a task without its own `format`, the generic one checks the `####` marker.
    let calc = sluice_env::TaskRegistry::builtin().get("episodic").unwrap();
    let fmt = rubric_for(&calc, &spec(&["format"], None)).unwrap();
    assert_eq!(score(&fmt, "so\n#### 72").await["format"], 1.0);
    assert_eq!(score(&fmt, "#### seventy-two").await["format"], 0.0);
    assert_eq!(score(&fmt, "72").await["format"], 0.0);

    // A sample without its reference fails the rollout instead of scoring 0 silently.
    let r = finished("#### 72", RolloutStatus::Completed);
    let s = sample(serde_json::json!({"question": "?"}));
    let scored = all.score(&s, &r).await;
    assert!(scored.failed.is_some(), "{scored:?}");
}

/// Evaluations read accuracy from a generic answer check when the rubric has no `correct`.
#[tokio::test]
async fn evaluation_accuracy_falls_back_to_the_answer_check() {
    use sluice_data::config::DomainRubric;
    use sluice_env::EvalReport;
    use sluice_env::configured::rubric_for;
    let task = sluice_env::TaskRegistry::builtin()
        .get("word_problems")
        .unwrap();
    let spec = DomainRubric {
        weights: [("math_answer".to_owned(), 1.0), ("format".to_owned(), 0.1)].into(),
        truncation_reward: None,
        error_reward: None,
        timeout: None,
        regex: None,
        judge: None,
        reward_model: None,
    };
    let rubric = rubric_for(&task, &spec).unwrap();
    let s = sample(serde_json::json!({"question": "?", "answer": 4}));
    let mut rollouts = Vec::new();
    for text in ["#### 4", "#### 5", "4", "x"] {
        let mut r = finished(text, RolloutStatus::Completed);
        rubric.score(&s, &r).await.apply_to(&mut r);
        rollouts.push(r);
    }
    let report = EvalReport::from_rollouts(&rubric, &rollouts);
    assert_eq!(report.accuracy, 0.5);
}

/// pass@k takes each problem's best reply, mean@k every reply: three problems with k = 2 and
/// `correct` scores (1, 0), (0, 0), (1, 1) give pass@2 = 2/3 and mean@2 = 1/2; a count that is
/// not whole groups of k gives none; a rubric that checks no answer is scored by the reward.
#[test]
fn pass_at_k_is_the_best_of_each_problems_k_replies() {
    use sluice_env::{SampledScores, TaskRegistry};
    let task = TaskRegistry::builtin().get("arithmetic").unwrap();
    let scored = |correct: f64| {
        let mut r = rollout(0);
        r.reward_components.insert("correct".into(), correct);
        r
    };
    let rollouts: Vec<_> = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        .into_iter()
        .map(scored)
        .collect();
    let s = SampledScores::from_rollouts(task.rubric(), &rollouts, 2).unwrap();
    assert_eq!(s.k, 2);
    assert!((s.pass_at_k - 2.0 / 3.0).abs() < 1e-12, "{s:?}");
    assert!((s.mean_at_k - 0.5).abs() < 1e-12, "{s:?}");
    // k = 3 over the same six replies: problems (1, 0, 0) and (0, 1, 1).
    let s = SampledScores::from_rollouts(task.rubric(), &rollouts, 3).unwrap();
    assert!((s.pass_at_k - 1.0).abs() < 1e-12, "{s:?}");
    assert!(SampledScores::from_rollouts(task.rubric(), &rollouts, 4).is_none());
    assert!(SampledScores::from_rollouts(task.rubric(), &rollouts, 0).is_none());
    let no_answers = Rubric::new(vec![RewardFn::env_reward(1.0)], RubricConfig::default()).unwrap();
    let rewarded: Vec<_> = [0.5, 0.0, 0.25, 1.0]
        .into_iter()
        .map(|reward| {
            let mut r = rollout(0);
            r.reward = reward;
            r
        })
        .collect();
    let s = SampledScores::from_rollouts(&no_answers, &rewarded, 2).unwrap();
    assert!((s.pass_at_k - 0.75).abs() < 1e-12, "{s:?}");
    assert!((s.mean_at_k - 0.4375).abs() < 1e-12, "{s:?}");
    let report = sluice_env::EvalReport::from_rollouts(&no_answers, &rewarded);
    assert_eq!(report.accuracy, 0.4375);
}
