//! The free-form answer tasks: `word_problems` (generated) and `qa` (JSONL rows), scored on
//! the final answer of sentences.

use super::*;

#[tokio::test]
async fn word_problems_score_sentences_by_their_final_answer_and_marker() {
    let task = registry().get("word_problems").unwrap();
    let s = sample(serde_json::json!({
        "question": "Ana has 20 pens and gets 9 more. How many pens does Ana have now?",
        "answer": 29,
        "working": "20 + 9 = 29."
    }));
    let reasoned = play(
        &task,
        &s,
        &["Ana starts with 20 pens and gets 9 more: 20 + 9 = 29.\n#### 29"],
    )
    .await;
    assert_eq!(reasoned.status, RolloutStatus::Completed);
    assert_eq!(reasoned.reward_components["correct"], 1.0);
    assert_eq!(reasoned.reward_components["format"], 1.0);
    assert!((reasoned.reward - 1.0).abs() < 1e-12);
    let prompt = &reasoned.turns[0].prompt_messages;
    assert_eq!(
        prompt[0].content.as_deref(),
        Some("Solve the problem. Write the final answer as a number after ####.")
    );
    assert_eq!(prompt[1].content.as_deref(), s.input["question"].as_str());
    // A sentence ending in the number is right, without the marker's bonus.
    let sentence = play(&task, &s, &["Ana has 29 pens now."]).await;
    assert_eq!(sentence.reward_components["correct"], 1.0);
    assert_eq!(sentence.reward_components["format"], 0.0);
    assert!((sentence.reward - 1.0 / 1.1).abs() < 1e-12);
    // A wrong marked answer keeps the format bonus only.
    let wrong = play(&task, &s, &["20 + 9 = 28\n#### 28"]).await;
    assert_eq!(wrong.reward_components["correct"], 0.0);
    assert!((wrong.reward - 0.1 / 1.1).abs() < 1e-12, "format only");
    let boxed = play(&task, &s, &["So the answer is \\boxed{29}."]).await;
    assert_eq!(boxed.reward_components["correct"], 1.0);
    let nothing = play(&task, &s, &["I do not know."]).await;
    assert_eq!(nothing.reward, 0.0);
    let cut = play(&task, &s, &["LEN:20 + 9 = "]).await;
    assert_eq!(cut.status, RolloutStatus::Truncated);
    assert_eq!(cut.reward, 0.0, "truncation_reward = 0");
    assert_eq!(
        task.reference_reply(&s, 0).as_deref(),
        Some("20 + 9 = 29.\n#### 29")
    );
    assert!(task.reference_reply(&s, 1).is_none());
}

/// The held-out split shares no problem numbers with training (any seed, any wording), every
/// answer is a whole number ≥ 0 within the small operand ranges, and all four kinds of problem
/// (addition, subtraction, multiplication, two steps) come up.
#[test]
fn word_problems_heldout_numbers_never_appear_in_training() {
    use sluice_env::tasks::word_problems::{is_heldout_problem, split_key};
    let task = registry().get("word_problems").unwrap();
    let keys = |split: &str, seed: u64, n: usize| -> BTreeSet<String> {
        let spec: DatasetSpec = format!("math::word_problems@{split}").parse().unwrap();
        let data = task.generate_dataset(&spec, seed, n).unwrap();
        data.samples()
            .iter()
            .map(|s| {
                let q = s.input["question"].as_str().unwrap();
                let a = s.input["answer"].as_u64().expect("a whole answer ≥ 0");
                assert!(a <= 12 * 12 + 20, "{q} = {a}");
                let numbers = sluice_env::answer::numbers(q);
                assert!(numbers.iter().all(|&n| (2.0..=20.0).contains(&n)), "{q}");
                assert_eq!(is_heldout_problem(q, a), split == "eval", "{q}");
                split_key(q, a)
            })
            .collect()
    };
    let mut train = BTreeSet::new();
    for seed in 0..3 {
        train.extend(keys("train", seed, 2000));
    }
    let heldout = keys("eval", 7, 400);
    assert!(
        heldout.len() > 100,
        "varied held-out problems: {}",
        heldout.len()
    );
    assert!(train.is_disjoint(&heldout));
    let spec: DatasetSpec = "math::word_problems@train".parse().unwrap();
    let texts: Vec<String> = task
        .generate_dataset(&spec, 1, 400)
        .unwrap()
        .samples()
        .iter()
        .map(|s| s.input["working"].as_str().unwrap().to_owned())
        .collect();
    for (kind, sign) in [
        ("addition", " + "),
        ("subtraction", " - "),
        ("multiplication", " * "),
    ] {
        assert!(texts.iter().any(|w| w.contains(sign)), "{kind}");
    }
    assert!(
        texts.iter().any(|w| w.matches(" = ").count() == 2),
        "two steps"
    );
}

#[tokio::test]
async fn word_problems_evaluation_reports_accuracy() {
    use sluice_env::evaluate;
    let task = registry().get("word_problems").unwrap();
    let spec: DatasetSpec = "math::word_problems@eval".parse().unwrap();
    let data = task.generate_dataset(&spec, 5, 4).unwrap();
    let replies: Vec<String> = data
        .samples()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let a = s.input["answer"].as_u64().unwrap();
            match i {
                0 => format!("It is {a}.\n#### {a}"),
                1 => format!("The answer is {a}."),
                2 => format!("#### {}", a + 1),
                _ => "no idea".to_owned(),
            }
        })
        .collect();
    let refs: Vec<&str> = replies.iter().map(String::as_str).collect();
    let mut policy = common::Scripted::new(&refs);
    let (report, _) = evaluate(
        &task,
        data.samples(),
        common::renderer(),
        &TokenEnvLimits::default(),
        &mut policy,
    )
    .await
    .unwrap();
    assert_eq!(report.accuracy, 0.5);
}

/// GSM8K rows load as they are (`"…\n#### 72"`), score free-form replies by their final answer,
/// and give a reference reply without the calculator notes; a row's own system prompt wins.
#[tokio::test]
async fn qa_reads_gsm8k_rows_as_they_are() {
    use sluice_data::Dataset;
    use sluice_data::config::BadLinePolicy;
    let spec: DatasetSpec = "gsm8k::gsm8k@train".parse().unwrap();
    let text = concat!(
        r#"{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"}"#,
        "\n",
        r#"{"question": "What is 2 + 2?", "answer": 4, "system_prompt": "Be brief."}"#,
        "\n"
    );
    let rows = Dataset::parse(
        text,
        std::path::Path::new("train.jsonl"),
        &spec,
        BadLinePolicy::Fail,
    )
    .unwrap();
    let task = registry().get("qa").unwrap();
    let gsm = &rows.samples()[0];
    let r = play(
        &task,
        gsm,
        &["She sold 24 in May, so 48 + 24 = 72.\n#### 72"],
    )
    .await;
    assert_eq!(r.status, RolloutStatus::Completed);
    assert_eq!(r.reward_components["correct"], 1.0);
    assert_eq!(r.reward_components["format"], 1.0);
    assert_eq!(r.turns[0].situation.as_deref(), Some("answer"));
    let prompt = &r.turns[0].prompt_messages;
    assert_eq!(
        prompt[0].content.as_deref(),
        Some("Answer the question. Write the final answer after ####.")
    );
    assert_eq!(prompt[1].content.as_deref(), gsm.input["question"].as_str());
    let r = play(&task, gsm, &["The answer is 72 clips."]).await;
    assert_eq!(
        (
            r.reward_components["correct"],
            r.reward_components["format"]
        ),
        (1.0, 0.0)
    );
    let r = play(&task, gsm, &["48 + 24 = 72, minus 1\n#### 71"]).await;
    assert_eq!(
        (
            r.reward_components["correct"],
            r.reward_components["format"]
        ),
        (0.0, 1.0)
    );
    let reference = task.reference_reply(gsm, 0).unwrap();
    assert_eq!(
        reference,
        "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"
    );
    assert_eq!(
        play(&task, gsm, &[&reference]).await.reward_components["correct"],
        1.0
    );

    let brief = &rows.samples()[1];
    let r = play(&task, brief, &["#### 4"]).await;
    assert_eq!(r.reward_components["correct"], 1.0);
    assert_eq!(
        r.turns[0].prompt_messages[0].content.as_deref(),
        Some("Be brief.")
    );
    assert_eq!(task.reference_reply(brief, 0).as_deref(), Some("#### 4"));

    let no_answer = sample(serde_json::json!({"question": "Why?"}));
    let err = task.make_env(&no_answer).err().unwrap();
    assert_eq!(err.kind(), "env_bad_input");
    assert!(err.to_string().contains("`answer`"), "{err}");
}

/// verl's rows (`examples/data_preprocess/gsm8k.py`'s shape, written by pyarrow as Parquet:
/// `tests/data/gsm8k/verl/train.parquet`) load as they are: the question field holds the
/// prompt's chat messages, the answer field is a dotted path into `reward_model`, and a rubric's
/// generic functions read the same path. A prompt that is not a list of text messages ending
/// with the user's fails its rollout, naming the sample and field.
#[tokio::test]
async fn qa_reads_verl_rows_as_they_are() {
    use sluice_data::config::{BadLinePolicy, DataConfig, DomainConfig, DomainRubric};
    use sluice_env::configured::configure;
    let options = DomainConfig {
        task: Some("qa".into()),
        question_field: Some("prompt".into()),
        answer_field: Some("reward_model.ground_truth".into()),
        ..DomainConfig::default()
    };
    let data = one_domain("gsm8k::verl@train", &options);
    let timeout = std::time::Duration::from_secs(5);
    let reg = configure(registry(), &data, timeout, None, None).unwrap();
    let task = reg.get("gsm8k/qa").unwrap();
    let row = |prompt: serde_json::Value| {
        sample(serde_json::json!({
            "data_source": "openai/gsm8k",
            "prompt": prompt,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "72"},
            "extra_info": {"split": "train", "index": 0}
        }))
    };
    let data_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data");
    let spec: DatasetSpec = "gsm8k::verl@train".parse().unwrap();
    let file = sluice_data::Dataset::load(&data_dir, &spec, BadLinePolicy::Fail).unwrap();
    assert_eq!(file.len(), 8);
    let first = &file.samples()[0];
    assert_eq!(first.id, "1", "no `id` column: the row number");
    assert_eq!(first.input["reward_model"]["ground_truth"], "7");
    assert_eq!(first.input["extra_info"]["index"], 0);
    let r = play(&task, first, &["3 + 4 = 7\n#### 7"]).await;
    assert_eq!(
        (
            r.reward_components["correct"],
            r.reward_components["format"]
        ),
        (1.0, 1.0)
    );
    let prompt = &r.turns[0].prompt_messages;
    assert_eq!(prompt.len(), 2, "the task's system prompt, then the row's");
    assert_eq!(
        prompt[1].content,
        first.input["prompt"][0]["content"]
            .as_str()
            .map(String::from)
    );
    assert!(
        prompt[1]
            .content
            .as_deref()
            .unwrap()
            .starts_with("Tom has 3 apples")
    );
    assert_eq!(task.reference_reply(first, 0).as_deref(), Some("#### 7"));

    let question = "Natalia sold 48 clips in April and half as many in May. How many in all?";
    let with_system = row(serde_json::json!([
        {"role": "system", "content": "You are a careful tutor."},
        {"role": "user", "content": question}
    ]));
    let r = play(&task, &with_system, &["It is 71.\n#### 71"]).await;
    assert_eq!(r.reward_components["correct"], 0.0);
    let prompt = &r.turns[0].prompt_messages;
    assert_eq!(prompt.len(), 2, "the row's own system message wins");
    assert_eq!(
        prompt[0].content.as_deref(),
        Some("You are a careful tutor.")
    );
    // A system message later among them wins too: no second system block is put first.
    let mid_system = row(serde_json::json!([
        {"role": "user", "content": "Hi."},
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": question}
    ]));
    let r = play(&task, &mid_system, &["#### 72"]).await;
    let roles: Vec<_> = r.turns[0].prompt_messages.iter().map(|m| m.role).collect();
    use sluice_core::Role;
    assert_eq!(roles, [Role::User, Role::System, Role::User]);

    // A rubric's generic answer check reads the dotted path too.
    let with_rubric = DataConfig {
        domain_options: [(
            "gsm8k".to_owned(),
            DomainConfig {
                rubric: Some(DomainRubric {
                    weights: [("math_answer".to_owned(), 1.0)].into(),
                    truncation_reward: None,
                    error_reward: None,
                    timeout: None,
                    regex: None,
                    judge: None,
                    reward_model: None,
                }),
                ..options
            },
        )]
        .into(),
        ..data
    };
    let reg = configure(registry(), &with_rubric, timeout, None, None).unwrap();
    let rubric_task = reg.get("gsm8k/qa").unwrap();
    let r = play(&rubric_task, first, &["so 7 apples"]).await;
    assert_eq!(r.reward_components["math_answer"], 1.0);

    for (prompt, expected) in [
        (
            serde_json::json!([{"role": "assistant", "content": "Hi"}]),
            "must end with a user message",
        ),
        (
            serde_json::json!([{"role": "tool", "content": "3", "tool_call_id": "c"}, {"role": "user", "content": "?"}]),
            "message 0",
        ),
        (
            serde_json::json!([{"role": "wizard", "content": "?"}]),
            "messages",
        ),
        (serde_json::json!([]), "must end with a user message"),
        (
            serde_json::json!({"role": "user"}),
            "must be a string or a list",
        ),
    ] {
        let err = task.make_env(&row(prompt.clone())).err().unwrap();
        assert_eq!(err.kind(), "env_bad_input", "{prompt}");
        let err = err.to_string();
        assert!(
            err.contains("`prompt`") && err.contains(expected),
            "{prompt}: {err}"
        );
    }
}

/// A domain names the `qa` row fields and the `\boxed{}` marker; its rubric's generic
/// functions read the same answer field. The keys on another task's domain are refused, naming
/// the key.
#[tokio::test]
async fn qa_domains_configure_fields_marker_and_rubric() {
    use sluice_data::config::{AnswerMarker, DataConfig, DomainConfig, DomainRubric};
    use sluice_env::configured::configure;
    let options = DomainConfig {
        task: Some("qa".into()),
        question_field: Some("problem".into()),
        answer_field: Some("solution".into()),
        system_prompt_field: Some("instructions".into()),
        answer_marker: Some(AnswerMarker::Boxed),
        ..DomainConfig::default()
    };
    let data = one_domain("mathqa::problems@train", &options);
    let timeout = std::time::Duration::from_secs(5);
    let reg = configure(registry(), &data, timeout, None, None).unwrap();
    assert_eq!(reg.domain_tasks()["mathqa"], "mathqa/qa");
    let task = reg.get("mathqa/qa").unwrap();
    let row = sample(serde_json::json!({
        "problem": "What is 3 divided by 2?",
        "solution": "3 / 2 = \\boxed{1.5}",
        "instructions": "Think step by step."
    }));
    let r = play(&task, &row, &["3/2 = 1.5, so \\boxed{1.50}"]).await;
    assert_eq!(
        (
            r.reward_components["correct"],
            r.reward_components["format"]
        ),
        (1.0, 1.0)
    );
    let prompt = &r.turns[0].prompt_messages;
    assert_eq!(prompt[0].content.as_deref(), Some("Think step by step."));
    assert_eq!(
        prompt[1].content.as_deref(),
        Some("What is 3 divided by 2?")
    );
    let r = play(&task, &row, &["#### 1.5"]).await;
    assert_eq!(
        (
            r.reward_components["correct"],
            r.reward_components["format"]
        ),
        (1.0, 0.0),
        "right, but not boxed"
    );
    assert_eq!(
        task.reference_reply(&row, 0).as_deref(),
        Some("3 / 2 = \\boxed{1.5}")
    );
    let plain = sample(serde_json::json!({"problem": "2+2?", "solution": "4"}));
    let r = play(&task, &plain, &["\\boxed{4}"]).await;
    assert_eq!(r.reward_components["correct"], 1.0);
    assert_eq!(
        r.turns[0].prompt_messages[0].content.as_deref(),
        Some("Answer the question. Put the final answer in \\boxed{}.")
    );
    assert_eq!(
        task.reference_reply(&plain, 0).as_deref(),
        Some("\\boxed{4}")
    );

    // A rubric with the generic functions reads `solution` too.
    let with_rubric = DataConfig {
        domain_options: [(
            "mathqa".to_owned(),
            DomainConfig {
                rubric: Some(DomainRubric {
                    weights: [("regex".to_owned(), 1.0), ("exact_match".to_owned(), 1.0)].into(),
                    truncation_reward: None,
                    error_reward: None,
                    timeout: None,
                    regex: Some(r"answer is (\S+)".into()),
                    judge: None,
                    reward_model: None,
                }),
                ..options
            },
        )]
        .into(),
        ..data.clone()
    };
    let reg = configure(registry(), &with_rubric, timeout, None, None).unwrap();
    let task = reg.get("mathqa/qa").unwrap();
    let r = play(&task, &plain, &["the answer is 4.0"]).await;
    assert_eq!(
        (
            r.reward_components["regex"],
            r.reward_components["exact_match"]
        ),
        (1.0, 0.0)
    );

    let other = DataConfig {
        datasets: vec!["math::arithmetic@train".parse().unwrap()],
        domain_options: [(
            "math".to_owned(),
            DomainConfig {
                answer_marker: Some(AnswerMarker::Boxed),
                ..DomainConfig::default()
            },
        )]
        .into(),
        ..data
    };
    let err = configure(registry(), &other, timeout, None, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("data.domains.math.answer_marker") && err.contains("only the `qa` task"),
        "{err}"
    );
}

/// `[data]` with the one dataset `spec` (no files: the rows are the tests' own) and its domain's
/// `options`.
fn one_domain(
    spec: &str,
    options: &sluice_data::config::DomainConfig,
) -> sluice_data::config::DataConfig {
    let spec: DatasetSpec = spec.parse().unwrap();
    sluice_data::config::DataConfig {
        domain_options: [(spec.domain.clone(), options.clone())].into(),
        datasets: vec![spec],
        data_dir: "unused".into(),
        on_bad_line: sluice_data::config::BadLinePolicy::Fail,
        adaptive_mix: true,
        read_limits: Default::default(),
    }
}
