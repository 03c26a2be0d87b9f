//! Evaluation per domain, as a native run prepares it: every domain of `data.datasets` is
//! evaluated through the task that serves it, on its task's generated held-out split or on the
//! JSONL file its `eval_dataset` names; `eval.task` narrows it to one task; a missing file is an
//! error naming the key. A warm-start with `warmup.probe = "heldout"` stops on that same held-out
//! set.

use sluice_config::Config;
use sluice_node::run::NativeRun;

fn config(dir: &std::path::Path, extra: &str) -> Config {
    let text = format!(
        r#"
[run]
name = "domain-evals"
output_dir = "{out}"
max_steps = 1

[model]
init_preset = "tiny"

[engine]
backend = "native"

[rollout]
max_new_tokens = 8
max_turns = 12

[data]
datasets = ["math::arithmetic@train", "agent::episodic@train"]
data_dir = "{data}"

[eval]
samples = 5

{extra}
"#,
        out = dir.join("run").display(),
        data = dir.join("data").display(),
    );
    sluice_config::parse(&text, "test.toml", &[], &|_| None).expect("valid config")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_domain_is_evaluated_on_its_own_held_out_set() {
    let dir = tempfile::tempdir().unwrap();
    // The math domain's held-out set is a file (three problems); the agent domain's is its
    // task's generated split (eval.samples = 5 walks).
    let heldout = dir.path().join("data/math/mine");
    std::fs::create_dir_all(&heldout).unwrap();
    std::fs::write(
        heldout.join("test.jsonl"),
        concat!(
            r#"{"id": "a", "question": "1+1=", "answer": 2}"#,
            "\n",
            r#"{"id": "b", "question": "2+3=", "answer": 5}"#,
            "\n",
            r#"{"id": "c", "question": "9-4=", "answer": 5}"#,
            "\n",
        ),
    )
    .unwrap();
    let extra = "[data.domains.math]\neval_dataset = \"mine@test\"\n[data.domains.agent]\nmax_new_tokens = 40\n";
    let two = config(dir.path(), extra);
    let mut run = NativeRun::prepare(&two, |_| {}).await.unwrap();
    assert_eq!(run.evaluations.domains(), ["math", "agent"]);
    assert_eq!(run.evaluations.heldout_len(), 3 + 5);
    let scores = run
        .evaluations
        .run(std::sync::Arc::clone(&run.setup.weights))
        .await
        .unwrap();
    let names: Vec<&str> = scores.domains.iter().map(|d| d.domain.as_str()).collect();
    assert_eq!(names, ["math", "agent"]);
    let mean = scores.domains.iter().map(|d| d.heldout).sum::<f64>() / 2.0;
    assert!((scores.heldout - mean).abs() < 1e-12, "{scores:?}");
    for d in &scores.domains {
        assert!((0.0..=1.0).contains(&d.heldout) && (0.0..=1.0).contains(&d.train));
        assert!(d.sampled.is_none(), "k = 1: no sampled pass");
    }
    assert!(scores.sampled.is_none());

    // `eval.samples_per_problem = 3`: every domain's held-out problems are also answered three
    // times, and the run's pass@3 / mean@3 are the means over the domains.
    // (The keys land in the template's `[eval]` table, before `extra`'s tables.)
    let three = config(
        dir.path(),
        &format!("samples_per_problem = 3\nsample_temperature = 1.0\n{extra}"),
    );
    assert_eq!(three.eval.samples_per_problem.get(), 3);
    let mut run3 = NativeRun::prepare(&three, |_| {}).await.unwrap();
    let scores = run3
        .evaluations
        .run(std::sync::Arc::clone(&run3.setup.weights))
        .await
        .unwrap();
    let sampled = scores.sampled.expect("pass@k with k = 3");
    assert_eq!(sampled.k, 3);
    for d in &scores.domains {
        let s = d.sampled.expect("each domain's pass@k");
        assert!(
            (0.0..=1.0).contains(&s.mean_at_k) && s.mean_at_k <= s.pass_at_k && s.pass_at_k <= 1.0,
            "{d:?}"
        );
    }
    let mean = scores
        .domains
        .iter()
        .map(|d| d.sampled.unwrap().pass_at_k)
        .sum::<f64>()
        / 2.0;
    assert!((sampled.pass_at_k - mean).abs() < 1e-12, "{scores:?}");

    // `eval.task` evaluates that task alone, in the domain whose rows it serves.
    let dir = tempfile::tempdir().unwrap();
    let mut one = config(dir.path(), "");
    one.eval.task = Some("episodic".into());
    let run = NativeRun::prepare(&one, |_| {}).await.unwrap();
    assert_eq!(run.evaluations.domains(), ["agent"]);
    assert_eq!(run.evaluations.heldout_len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_eval_dataset_names_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let missing = config(
        dir.path(),
        "[data.domains.math]\neval_dataset = \"nowhere@test\"\n",
    );
    let err = NativeRun::prepare(&missing, |_| {})
        .await
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(msg.contains("data.domains.math.eval_dataset"), "{msg}");
    assert!(msg.contains("nowhere"), "{msg}");
}

/// The warm-up target of the held-out probe test: low, so a debug build reaches it in a few dozen
/// supervised steps (50 when written; 20 % took over 400).
const HELDOUT_TARGET: f64 = 0.05;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_warm_up_can_stop_on_held_out_accuracy() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"
[run]
name = "heldout-warmup"
output_dir = "{out}"
max_steps = 1

[model]
init_preset = "tiny"

[engine]
backend = "native"

[rollout]
max_new_tokens = 6

[data]
datasets = ["math::arithmetic_wide@train"]

[data.domains.math]
system_prompt = ""

[warmup]
enabled = true
probe = "heldout"
target_accuracy = {HELDOUT_TARGET}
max_steps = 300
check_every = 10
probe_samples = 7
"#,
        out = dir.path().join("run").display(),
    );
    let config = sluice_config::parse(&text, "test.toml", &[], &|_| None).expect("valid config");
    let mut probes = Vec::new();
    let mut run = NativeRun::prepare(&config, |p| probes.push(p.accuracy))
        .await
        .unwrap();
    let warm = run.warmup.clone().expect("a fresh run warm-starts");
    // It stopped at the first probe that reached the target, before the step budget ran out.
    let (&last, earlier) = probes.split_last().expect("probed");
    assert!(
        last >= HELDOUT_TARGET && earlier.iter().all(|&a| a < HELDOUT_TARGET),
        "{probes:?}"
    );
    assert!(
        warm.steps < 300 && warm.steps.is_multiple_of(10),
        "{warm:?}"
    );
    assert_eq!(warm.probe_accuracy, last);
    assert_eq!(warm.domains, [("math".to_owned(), last)]);
    // What it probed is the held-out set the run evaluates: the evaluation of the saved weights
    // finds the same accuracy ...
    let n = run.evaluations.heldout_len();
    assert!(n >= 100 && !n.is_multiple_of(7), "{n} held-out problems");
    let scores = run
        .evaluations
        .run(std::sync::Arc::clone(&run.setup.weights))
        .await
        .unwrap();
    assert!(
        (scores.heldout - warm.probe_accuracy).abs() < 1e-12,
        "warm-up probe {} vs held-out evaluation {scores:?}",
        warm.probe_accuracy
    );
    // ... and a share of n problems (n prime to 7) short of all is no share of the 7 training
    // problems of `probe_samples`.
    let sevenths = warm.probe_accuracy * 7.0;
    assert!(
        warm.probe_accuracy < 1.0 && (sevenths - sevenths.round()).abs() > 1e-9,
        "{warm:?}"
    );
}
