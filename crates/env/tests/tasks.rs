//! Built-in tasks: data generation (deterministic, disjoint held-out split) and env logic, played
//! through the whole TokenEnv → rubric path with scripted replies.

mod common;

use std::collections::BTreeSet;

use common::{play, sample};
use sluice_core::RolloutStatus;
use sluice_data::config::DatasetSpec;
use sluice_env::{TaskRegistry, TokenEnvLimits};

fn registry() -> TaskRegistry {
    TaskRegistry::builtin()
}

#[test]
fn registry_holds_the_builtins_and_refuses_duplicates() {
    let mut r = registry();
    assert_eq!(
        r.names(),
        [
            "arithmetic",
            "arithmetic_wide",
            "calculator_tool",
            "episodic",
            "python_code",
            "qa",
            "stock_tool",
            "sum_digits",
            "word_problems"
        ]
    );
    let again = sluice_env::tasks::arithmetic::task();
    assert!(r.register(again).is_err());
    let err = r.get("chess").unwrap_err();
    assert_eq!(err.kind(), "unknown_task");
    assert!(
        err.to_string()
            .contains("arithmetic, arithmetic_wide, calculator_tool"),
        "{err}"
    );
}

#[test]
fn generated_data_is_deterministic_and_eval_is_held_out() {
    let r = registry();
    for name in r.names() {
        let task = r.get(&name).unwrap();
        if !task.generates_data() {
            assert_eq!(name, "qa", "reads its rows from files");
            continue;
        }
        let train_spec: DatasetSpec = format!("d::{name}@train").parse().unwrap();
        let eval_spec: DatasetSpec = format!("d::{name}@eval").parse().unwrap();
        let a = task.generate_dataset(&train_spec, 1, 300).unwrap();
        let b = task.generate_dataset(&train_spec, 1, 300).unwrap();
        let c = task.generate_dataset(&train_spec, 2, 300).unwrap();
        assert_eq!(a, b, "{name}: same seed, same data");
        assert_ne!(a, c, "{name}: other seed, other data");
        assert_eq!(a.samples()[0].domain, "d");
        assert_eq!(a.samples()[0].dataset, format!("{name}@train"));
        let eval = task.generate_dataset(&eval_spec, 1, 50).unwrap();
        let train_inputs: BTreeSet<String> =
            a.samples().iter().map(|s| s.input.to_string()).collect();
        for s in eval.samples() {
            assert!(
                !train_inputs.contains(&s.input.to_string()),
                "{name}: {s:?} leaked"
            );
        }
        // Every generated sample makes a working env.
        for s in a.samples().iter().take(20) {
            task.make_env(s).unwrap();
        }
        assert!(
            task.generate_dataset(&format!("d::{name}@dev").parse().unwrap(), 1, 1)
                .is_err()
        );
    }
    let bad = sample(serde_json::json!({"nothing": 1}));
    for name in r.names() {
        let err = r.get(&name).unwrap().make_env(&bad).err().unwrap();
        assert_eq!(err.kind(), "env_bad_input", "{name}");
    }
}

#[tokio::test]
async fn arithmetic_rewards_exact_answers_and_format() {
    let task = registry().get("arithmetic").unwrap();
    let s = sample(sluice_env::tasks::arithmetic::problem_input(7, '+', 5));
    let right = play(&task, &s, &["12"]).await;
    assert_eq!(right.status, RolloutStatus::Completed);
    assert_eq!(right.reward_components["correct"], 1.0);
    assert!((right.reward - 1.0).abs() < 1e-12, "1/1.1 + 0.1/1.1");
    let prompt = &right.turns[0].prompt_messages;
    assert_eq!(
        prompt[0].content.as_deref(),
        Some("Answer with the number only.")
    );
    assert_eq!(prompt[1].content.as_deref(), Some("7+5="));
    let wrong = play(&task, &s, &["13"]).await;
    assert!((wrong.reward - 0.1 / 1.1).abs() < 1e-12, "format only");
    let chatty = play(&task, &s, &["It is 12"]).await;
    assert_eq!(chatty.reward, 0.0);
    let cut = play(&task, &s, &["LEN:1"]).await;
    assert_eq!(cut.status, RolloutStatus::Truncated);
    assert_eq!(cut.reward, 0.0, "truncation_reward = 0");
}

#[tokio::test]
async fn sum_digits_reads_the_answer_tag() {
    let task = registry().get("sum_digits").unwrap();
    let s = sample(serde_json::json!({"number": "48213", "answer": 18}));
    let r = play(&task, &s, &["4+8+2+1+3 = 18. [ANSWER] 18"]).await;
    assert_eq!(r.reward_components["correct"], 1.0);
    assert_eq!(r.reward_components["format"], 1.0);
    let r = play(&task, &s, &["18"]).await;
    assert_eq!(r.reward, 0.0, "no tag, no reward");
    let r = play(&task, &s, &["[ANSWER] 17"]).await;
    assert_eq!(r.reward_components["correct"], 0.0);
    assert_eq!(r.reward_components["format"], 1.0);
}

#[tokio::test]
async fn calculator_tool_executes_calls_and_labels_stages() {
    let task = registry().get("calculator_tool").unwrap();
    let s = sample(serde_json::json!({"expression": "(37 * 12) - 5", "answer": 439}));
    let call = r#"<tool_call>{"name": "calc", "arguments": {"expression": "37 * 12"}}</tool_call>"#;
    let bad = r#"<tool_call>{"name": "search", "arguments": {}}</tool_call>"#;
    let r = play(&task, &s, &[bad, call, "444 - 5 = 439. [ANSWER] 439"]).await;
    assert_eq!(r.status, RolloutStatus::Completed);
    let situations: Vec<_> = r
        .turns
        .iter()
        .map(|t| t.situation.as_deref().unwrap())
        .collect();
    assert_eq!(situations, ["tool_error", "tool_call", "answer"]);
    let reply = &r.turns[1].env_messages[0];
    assert_eq!(reply.role, sluice_core::Role::Tool);
    assert_eq!(reply.content.as_deref(), Some("444"));
    assert_eq!(reply.tool_call_id.as_deref(), Some("call_0"));
    assert!(
        r.turns[0].env_messages[0]
            .content
            .as_deref()
            .unwrap()
            .starts_with("error: unknown tool"),
    );
    assert_eq!(r.reward_components["correct"], 1.0);
    // The tool is declared in the prompt.
    let first_prompt: String = r.turns[0]
        .prompt_token_ids
        .iter()
        .map(|&t| t as u8 as char)
        .collect();
    assert!(first_prompt.contains("\"name\":\"calc\""), "{first_prompt}");

    let r = play(&task, &s, &["[ANSWER] 400"]).await;
    assert_eq!(r.reward_components["correct"], 0.0);
    // The call budget ends the episode without an answer.
    let many = [call, call, call, call, call];
    let r = play(&task, &s, &many).await;
    assert_eq!(
        r.turns.last().unwrap().situation.as_deref(),
        Some("tool_budget")
    );
    assert_eq!(r.reward_components["correct"], 0.0);
}

#[tokio::test]
async fn episodic_discounts_the_outcome_backwards() {
    let task = registry().get("episodic").unwrap();
    let s = sample(serde_json::json!({"start": 3, "target": 5, "max_steps": 5}));
    let act = |a: &str| format!("<|action_start|>{a}<|action_end|>");
    let (inc, done) = (act("inc()"), act("done()"));
    let r = play(&task, &s, &[&inc, "hmm", &inc, &done]).await;
    assert_eq!(r.status, RolloutStatus::Completed);
    assert_eq!(r.reward, 1.0);
    assert_eq!(r.reward_components["correct"], 1.0, "stopped on target");
    let situations: Vec<_> = r
        .turns
        .iter()
        .map(|t| t.situation.as_deref().unwrap())
        .collect();
    assert_eq!(situations, ["move", "invalid", "move", "done"]);
    let rewards: Vec<f64> = r.turns.iter().map(|t| t.env_reward.unwrap()).collect();
    let expected = [0.9f64.powi(3), 0.9f64.powi(2), 0.9, 1.0];
    for (got, want) in rewards.iter().zip(expected) {
        assert!((got - want).abs() < 1e-12, "{rewards:?}");
    }
    // Stopping off target: outcome 0 everywhere.
    let r = play(&task, &s, &[&inc, &done]).await;
    assert_eq!(r.reward, 0.0);
    assert_eq!(r.reward_components["correct"], 0.0);
    assert!(r.turns.iter().all(|t| t.env_reward == Some(0.0)));
    // Running out of steps ends the episode with 0.
    let r = play(&task, &s, &[&inc, &inc, &inc, &inc, &inc]).await;
    assert_eq!(
        r.turns.last().unwrap().situation.as_deref(),
        Some("out_of_steps")
    );
    assert_eq!(r.reward, 0.0);
}

/// Every task's reference episode, played turn by turn against its real env, is correct: what a
/// warm-start imitates must be right, for multi-turn tasks (a tool call, then the answer to the
/// tool's result; a walk of several moves) as for single-turn ones.
#[tokio::test]
async fn reference_episodes_are_correct_on_every_turn() {
    let r = registry();
    for name in r.names() {
        let task = r.get(&name).unwrap();
        if !task.reference_reply_declared() || !task.generates_data() || name == "python_code" {
            continue; // python_code's reference runs in the sandbox: tested there.
        }
        let spec: DatasetSpec = format!("d::{name}@train").parse().unwrap();
        for s in task.generate_dataset(&spec, 3, 20).unwrap().samples() {
            let replies: Vec<String> = (0..)
                .map_while(|turn| task.reference_reply(s, turn))
                .collect();
            if replies.len() > TokenEnvLimits::default().max_turns as usize {
                continue; // a walk longer than the episode limit `play` runs with
            }
            let refs: Vec<&str> = replies.iter().map(String::as_str).collect();
            let rollout = play(&task, s, &refs).await;
            assert_eq!(rollout.status, RolloutStatus::Completed, "{name}: {s:?}");
            assert_eq!(rollout.turns.len(), replies.len(), "{name}: {s:?}");
            assert_eq!(
                rollout.reward_components.get("correct"),
                Some(&1.0),
                "{name}: {s:?} {replies:?}"
            );
        }
    }
    // The multi-turn ones take several turns.
    let calc = r.get("calculator_tool").unwrap();
    let s = sample(serde_json::json!({"expression": "(37 * 12) - 5", "answer": 439}));
    assert_eq!(calc.reference_reply(&s, 1).as_deref(), Some("[ANSWER] 439"));
    assert!(calc.reference_reply(&s, 2).is_none());
}

#[test]
fn configured_datasets_come_from_files_or_generators() {
    use sluice_data::config::{BadLinePolicy, DataConfig};
    use sluice_env::datasets::{GeneratedRows, load_datasets};
    let dir = std::env::temp_dir().join(format!("sluice-env-ds-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("code")).unwrap();
    std::fs::write(
        dir.join("code/snippets.jsonl"),
        "{\"input\": 1}\n{\"input\": 2}\n",
    )
    .unwrap();
    let data = DataConfig {
        datasets: vec![
            "math::arithmetic@train".parse().unwrap(),
            "math::arithmetic@eval".parse().unwrap(),
            "code::snippets".parse().unwrap(),
        ],
        data_dir: dir.clone(),
        on_bad_line: BadLinePolicy::Fail,
        read_limits: Default::default(),
        adaptive_mix: true,
        domain_options: Default::default(),
    };
    let rows = GeneratedRows {
        seed: 3,
        train: 40,
        eval: 7,
    };
    let sets = load_datasets(&data, &registry(), rows).unwrap();
    assert_eq!(sets.iter().map(|d| d.len()).collect::<Vec<_>>(), [40, 7, 2]);
    assert_eq!(sets[2].samples()[1].input, serde_json::json!(2));

    let missing = DataConfig {
        datasets: vec!["code::nowhere".parse().unwrap()],
        ..data
    };
    let err = load_datasets(&missing, &registry(), rows).unwrap_err();
    assert!(err.to_string().contains("nowhere.jsonl"), "{err}");

    // A link where a generated dataset's file would be is a file meant, even when it leads
    // nowhere: its error, not the generator's rows.
    std::fs::create_dir_all(dir.join("math/arithmetic")).unwrap();
    let link = dir.join("math/arithmetic/train.jsonl");
    std::os::unix::fs::symlink(dir.join("gone.jsonl"), &link).unwrap();
    let linked = DataConfig {
        datasets: vec!["math::arithmetic@train".parse().unwrap()],
        ..missing
    };
    let err = load_datasets(&linked, &registry(), rows).unwrap_err();
    assert!(err.to_string().contains("train.jsonl"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn arithmetic_heldout_set_is_fixed_and_never_trained_on() {
    use sluice_env::tasks::arithmetic::{all_problems, heldout_samples};
    let heldout = heldout_samples();
    assert_eq!(heldout, heldout_samples());
    let n = heldout.len();
    let all = all_problems().len();
    assert!(
        (all / 20..=all / 5).contains(&n),
        "about a tenth of {all}: {n}"
    );
    let held: BTreeSet<String> = heldout.iter().map(|s| s.input.to_string()).collect();
    assert_eq!(held.len(), n, "each problem once");
    let task = registry().get("arithmetic").unwrap();
    for seed in 0..3 {
        let train = task
            .generate_dataset(&"math::arithmetic@train".parse().unwrap(), seed, 2000)
            .unwrap();
        assert!(
            train
                .samples()
                .iter()
                .all(|s| !held.contains(&s.input.to_string()))
        );
    }
}

#[test]
fn arithmetic_wide_holds_out_over_100_problems_and_trains_on_the_rest() {
    use sluice_env::tasks::arithmetic::{WIDE, WIDE_HELDOUT_ONE_IN};
    let heldout = WIDE.heldout_samples();
    assert_eq!(heldout, WIDE.heldout_samples());
    let n = heldout.len();
    let all = WIDE.all_problems().len();
    // One problem must be worth under a point of accuracy (issue 39: 23 problems moved it in
    // 4.3-point jumps), and the share held out near one in WIDE_HELDOUT_ONE_IN.
    assert!(n >= 100, "{n} held-out problems");
    let share = n as f64 / all as f64;
    let expected = 1.0 / WIDE_HELDOUT_ONE_IN as f64;
    assert!(
        (share - expected).abs() < 0.05,
        "{n} of {all} held out, about 1/{WIDE_HELDOUT_ONE_IN} expected"
    );
    let held: BTreeSet<String> = heldout.iter().map(|s| s.input.to_string()).collect();
    assert_eq!(held.len(), n, "each problem once");
    let task = registry().get("arithmetic_wide").unwrap();
    for seed in 0..3 {
        let train = task
            .generate_dataset(&"math::arithmetic_wide@train".parse().unwrap(), seed, 8000)
            .unwrap();
        let trained: BTreeSet<String> = train
            .samples()
            .iter()
            .map(|s| s.input.to_string())
            .collect();
        assert!(
            trained.is_disjoint(&held),
            "seed {seed}: a held-out problem in train"
        );
        // The two splits partition the problems: every other problem is trained on.
        assert_eq!(trained.len() + n, all, "seed {seed}");
        let eval = task
            .generate_dataset(&"math::arithmetic_wide@eval".parse().unwrap(), seed, 500)
            .unwrap();
        assert!(
            eval.samples()
                .iter()
                .all(|s| held.contains(&s.input.to_string())),
            "seed {seed}: the eval split draws from the held-out set"
        );
    }
}

#[tokio::test]
async fn evaluation_reports_accuracy_on_the_heldout_set() {
    use sluice_env::tasks::arithmetic::heldout_samples;
    use sluice_env::{TokenEnvLimits, evaluate};
    let task = registry().get("arithmetic").unwrap();
    let samples: Vec<_> = heldout_samples().into_iter().take(4).collect();
    // Right on the first two, wrong on the third, chatty on the fourth.
    let answers: Vec<String> = samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let a = s.input["answer"].as_i64().unwrap();
            match i {
                0 | 1 => a.to_string(),
                2 => (a + 1).to_string(),
                _ => format!("the answer is {a}"),
            }
        })
        .collect();
    let refs: Vec<&str> = answers.iter().map(String::as_str).collect();
    let mut policy = common::Scripted::new(&refs);
    let (report, rollouts) = evaluate(
        &task,
        &samples,
        common::renderer(),
        &TokenEnvLimits::default(),
        &mut policy,
    )
    .await
    .unwrap();
    assert_eq!(report.episodes, 4);
    assert_eq!(report.accuracy, 0.5);
    assert_eq!(report.statuses["completed"], 4);
    let expected_mean = (1.0 + 1.0 + 0.1 / 1.1) / 4.0;
    assert!(
        (report.mean_reward - expected_mean).abs() < 1e-12,
        "{report:?}"
    );
    assert_eq!(rollouts.len(), 4);
}

#[path = "tasks/free_form.rs"]
mod free_form;
