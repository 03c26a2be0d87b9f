//! `sluice check`: the shipped configs validate, bad input exits non-zero with one line naming
//! file, key and expectation, and nothing is started or written; (`cli_check/trainer_keys.rs`)
//! the trainer's keys resolved and refused.

use std::path::Path;
use std::process::{Command, Output};

#[path = "cli_check/trainer_keys.rs"]
mod trainer_keys;

fn sluice(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .current_dir(dir)
        .env_remove("SLUICE_ADMIN_TOKEN")
        .output()
        .expect("run sluice")
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn every_shipped_config_validates() {
    let mut checked = 0;
    for entry in std::fs::read_dir(repo().join("configs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = sluice(&["check", path.to_str().unwrap()], repo());
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 1);
}

#[test]
fn check_prints_the_resolved_config_and_applies_overrides() {
    let out = sluice(
        &[
            "check",
            "configs/quickstart.toml",
            "--set",
            "rollout.group_size=3",
            "--set",
            "run.name=cli-test",
        ],
        repo(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: toml::Table = String::from_utf8(out.stdout).unwrap().parse().unwrap();
    assert_eq!(printed["rollout"]["group_size"].as_integer(), Some(3));
    // Defaults are resolved and shown.
    assert_eq!(printed["run"]["output_dir"].as_str(), Some("runs/cli-test"));
    assert_eq!(
        printed["metrics"]["listen"].as_str(),
        Some("127.0.0.1:9400")
    );
}

#[test]
fn bad_input_exits_non_zero_with_one_line_and_starts_nothing() {
    let dir = tempdir();
    std::fs::write(
        dir.join("bad.toml"),
        "[run]\nname = \"bad\"\noutput_dir = \"out\"\n[rollout]\nweight_update_mode = \"eventually\"\n",
    )
    .unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["check", "bad.toml"],
            "error: bad.toml: rollout.weight_update_mode: expected one of abort_resume, in_flight, drain, got `eventually`\n",
        ),
        (
            &["check", "missing.toml"],
            "error: missing.toml: cannot read config: No such file or directory (os error 2)\n",
        ),
        (
            &[
                "check",
                "bad.toml",
                "--set",
                "rollout.weight_update_mode=drain",
                "--set",
                "rollout.group_size=-2",
            ],
            "error: bad.toml: --set rollout.group_size: expected an integer ≥ 1, got -2\n",
        ),
    ];
    for (args, expected) in cases {
        let out = sluice(args, &dir);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert_eq!(String::from_utf8_lossy(&out.stderr), *expected, "{args:?}");
        assert!(out.stdout.is_empty());
    }
    let out = sluice(&["check", "bad.toml", "--set", "nonsense"], &dir);
    assert_eq!(out.status.code(), Some(2), "clap usage errors exit 2");
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected `key.path=value`"));
    assert!(
        !dir.join("out").exists(),
        "check never creates the output dir"
    );
}

/// A malformed `engine.remote_urls` entry is refused by `sluice check`, naming the entry, where
/// it used to pass and fail once its replica started (17 s into the run).
#[test]
fn a_malformed_remote_url_is_refused_naming_the_entry() {
    for (url, reason) in [
        ("http://engine-1", "must name host:port"),
        ("http://engine-1:8x00", "must name a port from 1 to 65535"),
        ("http://u:p@engine-1:8000", "must not carry credentials"),
        ("https://engine-1:8000", "must start with http://"),
    ] {
        let set = format!("engine.remote_urls=[\"http://engine-0:8000\", \"{url}\"]");
        let out = sluice(&["check", "configs/quickstart.toml", "--set", &set], repo());
        assert_eq!(out.status.code(), Some(1), "{url}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("engine.remote_urls[1]: expected an http://host:port[/prefix] base URL, got `{url}`: it {reason}")),
            "{url}: {err}"
        );
    }
}

#[test]
fn unsound_settings_are_checked_with_a_warning() {
    let check = |sets: &[&str]| {
        let mut args = vec!["check", "configs/quickstart.toml"];
        for s in sets {
            args.extend(["--set", s]);
        }
        let out = sluice(&args, repo());
        assert!(out.status.success(), "a warning is not an error");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert_eq!(check(&[]), "", "the quickstart is sound");
    let stderr = check(&["trainer.minibatches=1"]);
    assert!(
        stderr.starts_with(
            "warning: trainer.minibatches = 1 with loss = \"decoupled_ppo\" and rollout.max_version_lag = 2: "
        ),
        "{stderr}"
    );
    // GSPO's own clip range on samples up to η versions old clips most of them.
    let stderr = check(&["trainer.loss=gspo"]);
    assert!(
        stderr.starts_with("warning: trainer.loss = \"gspo\" with clip_low = 0.0003, clip_high = 0.0004 and rollout.max_version_lag = 2: ")
            && stderr.contains("widen both to 0.01"),
        "{stderr}"
    );
    for sound in [
        ["trainer.loss=gspo", "rollout.max_version_lag=0"],
        ["trainer.loss=gspo", "trainer.clip_high=0.01"],
    ] {
        assert_eq!(check(&sound), "", "{sound:?}");
    }
    // Under gae a group of equal rewards trains, so the replay filter that drops them is not
    // what the run wants; one rollout a prompt is sound there.
    let stderr = check(&["trainer.advantage=gae"]);
    assert!(
        stderr.starts_with(
            "warning: trainer.advantage = \"gae\" with replay.filter_zero_advantage = true: "
        ) && stderr.contains("set replay.filter_zero_advantage = false"),
        "{stderr}"
    );
    let gae = [
        "trainer.advantage=gae",
        "replay.filter_zero_advantage=false",
        "rollout.group_size=1",
    ];
    assert_eq!(check(&gae), "", "{gae:?}");
}

/// `sluice data` shows a verl user's rows as the run's `qa` task opens them: the Parquet file's
/// prompt messages after the task's system prompt, its reference reply, and a JSONL row whose
/// prompt does not end with the user's named with the exit code 1; the held-out sets a run
/// loads are loaded too.
#[test]
fn data_shows_rows_as_the_tasks_open_them() {
    let dir = tempdir();
    let data = dir.join("data");
    std::fs::create_dir_all(data.join("gsm8k/verl")).unwrap();
    std::fs::copy(
        repo().join("tests/data/gsm8k/verl/train.parquet"),
        data.join("gsm8k/verl/train.parquet"),
    )
    .unwrap();
    std::fs::create_dir_all(data.join("chat")).unwrap();
    std::fs::write(
        data.join("chat/rows.jsonl"),
        concat!(
            r#"{"id": "good", "prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}], "answer": "4"}"#,
            "\n",
            r#"{"id": "bad", "prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "answer": "4"}"#,
            "\n"
        ),
    )
    .unwrap();
    let qa = |domain: &str, answer: &str| {
        format!(
            "[data.domains.{domain}]\ntask = \"qa\"\nquestion_field = \"prompt\"\nanswer_field = \"{answer}\"\n"
        )
    };
    std::fs::write(
        dir.join("data.toml"),
        format!(
            "[data]\ndatasets = [\"gsm8k::verl@train\", \"chat::rows\"]\ndata_dir = \"{}\"\n{}{}",
            data.display(),
            qa("gsm8k", "reward_model.ground_truth"),
            qa("chat", "answer"),
        ),
    )
    .unwrap();
    let out = sluice(&["data", "data.toml", "--rows", "2"], &dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("gsm8k::verl@train: 8 rows from ") && stderr.contains("train.parquet"),
        "{stderr}"
    );
    let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4, "{rows:?}");
    let first = &rows[0];
    assert_eq!(first["task"], "gsm8k/qa");
    assert_eq!(first["messages"][0]["role"], "system");
    assert!(
        first["messages"][1]["content"]
            .as_str()
            .unwrap()
            .starts_with("Tom has 3 apples"),
        "{first}"
    );
    assert_eq!(first["reference"], "#### 7");
    // The row's own system message wins; the bad row says why, naming its field.
    assert_eq!(rows[2]["messages"][0]["content"], "Be terse.");
    assert_eq!(rows[2]["messages"].as_array().unwrap().len(), 2);
    let error = rows[3]["error"].as_str().unwrap();
    assert!(
        error.contains("`prompt`") && error.contains("user message"),
        "{error}"
    );

    // With the model's directory there, each prompt's tokens through its chat template, held to
    // the run's prompt limit.
    let model = dir.join("model");
    let made = sluice(
        &[
            "model",
            "init",
            "--preset",
            "tiny",
            "--out",
            model.to_str().unwrap(),
        ],
        &dir,
    );
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let set_model = format!("model.path=\"{}\"", model.display());
    let first_row = |extra: &[&str]| {
        let mut args = vec!["data", "configs/quickstart.toml", "--rows", "1"];
        args.extend(["--set", &set_model]);
        for s in extra {
            args.extend(["--set", s]);
        }
        sluice(&args, repo())
    };
    let out = first_row(&[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // `7+5=` and the template's turn markers: a token a character on the tiny model.
    let tokens = row["prompt_tokens"].as_u64().unwrap();
    assert!((4..64).contains(&tokens), "{row}");
    let out = first_row(&["rollout.max_prompt_tokens=3"]);
    assert_eq!(out.status.code(), Some(1));
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        row["error"].as_str().unwrap().contains("over the run's 3"),
        "{row}"
    );
    // A turn budget the context cannot hold leaves no prompt room at all: said as such.
    let out = first_row(&["rollout.max_new_tokens=100000"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rollout.max_new_tokens") && stderr.contains("leaves no room for a prompt"),
        "{stderr}"
    );

    // The held-out sets a run loads when it starts are loaded too: a missing one, or one with no
    // usable row, fails here rather than at the run's start.
    let heldout = |eval_dataset: &str| {
        let config = format!(
            "[data]\ndatasets = [\"gsm8k::verl@train\"]\ndata_dir = \"{}\"\n{}eval_dataset = \"{eval_dataset}\"\n",
            data.display(),
            qa("gsm8k", "reward_model.ground_truth"),
        );
        std::fs::write(dir.join("heldout.toml"), config).unwrap();
        let out = sluice(&["data", "heldout.toml", "--rows", "0"], &dir);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = heldout("verl@train");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("data.domains.gsm8k.eval_dataset: 8 rows from "),
        "{stderr}"
    );
    let (code, stderr) = heldout("nothere@test");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("data.domains.gsm8k.eval_dataset: ") && stderr.contains("nothere"),
        "{stderr}"
    );
    std::fs::write(data.join("gsm8k/verl/empty.jsonl"), "not a row\n").unwrap();
    let (code, stderr) = heldout("verl@empty");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("no usable row"), "{stderr}");
}

#[test]
fn version_flag() {
    let out = sluice(&["--version"], repo());
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("sluice {}", env!("CARGO_PKG_VERSION"))
    );
}

/// A GSM8K-style domain on the `qa` task with a `regex` reward checks; a pattern that does not
/// compile, and a `qa` key on another task's domain, are refused in one line naming the key.
#[test]
fn qa_domain_with_regex_reward_checks_and_bad_keys_are_named() {
    let dir = tempdir();
    std::fs::create_dir_all(dir.join("data/gsm8k/gsm8k")).unwrap();
    std::fs::write(
        dir.join("data/gsm8k/gsm8k/train.jsonl"),
        "{\"question\": \"Ana has 3 pens and gets 4 more. How many now?\", \"answer\": \"3 + 4 = <<3+4=7>>7\\n#### 7\"}\n",
    )
    .unwrap();
    let config = r#"[run]
name = "qa"
output_dir = "out"
[data]
datasets = ["gsm8k::gsm8k@train"]
data_dir = "data"
[data.domains.gsm8k]
task = "qa"
answer_marker = "boxed"
[data.domains.gsm8k.rubric]
weights = { math_answer = 1.0, regex = 0.5, format = 0.1 }
regex = 'answer is (\d+)'
"#;
    std::fs::write(dir.join("qa.toml"), config).unwrap();
    let out = sluice(&["check", "qa.toml"], &dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains("answer_marker = \"boxed\"") && printed.contains("answer is ("),
        "{printed}"
    );

    std::fs::write(
        dir.join("bad_regex.toml"),
        config.replace(r"(\d+)'", r"(\d+'"),
    )
    .unwrap();
    let out = sluice(&["check", "bad_regex.toml"], &dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("bad_regex.toml")
            && stderr.contains("data.domains.gsm8k.rubric.regex")
            && stderr.contains("unclosed group"),
        "{stderr}"
    );

    let other_task = config.replace("task = \"qa\"", "task = \"arithmetic\"");
    std::fs::write(dir.join("not_qa.toml"), other_task).unwrap();
    let out = sluice(&["check", "not_qa.toml"], &dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("data.domains.gsm8k.answer_marker") && stderr.contains("`qa` task"),
        "{stderr}"
    );
}

/// A fresh directory under the target dir (no extra dependency for one temp dir).
fn tempdir() -> std::path::PathBuf {
    // One directory per call: the tests of this binary run side by side.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("cli-check-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `sluice check` says what a run would resume from (its files checked as the run checks them)
/// and which keys changed since, and fails as the run would on a checkpoint whose files changed.
#[test]
fn check_says_what_a_run_would_resume_from() {
    // A directory of its own: `tempdir()` is one per process, emptied by each test that asks.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("resume");
    let config = repo().join("configs/sim_longtail.toml");
    let dir_set = format!("run.output_dir=\"{}\"", out.display());
    let run = sluice(
        &[
            "run",
            config.to_str().unwrap(),
            "--set",
            &dir_set,
            "--set",
            "run.max_steps=2",
            "--set",
            "engine.simulated.time_scale=0.01",
            "--set",
            "metrics.enabled=false",
            "--set",
            "admin.listen=\"127.0.0.1:0\"",
        ],
        repo(),
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let check = |extra: &[&str]| {
        let mut args = vec!["check", config.to_str().unwrap(), "--set", &dir_set];
        args.extend_from_slice(extra);
        sluice(&args, repo())
    };
    let ok = check(&["--set", "run.seed=9"]);
    let stderr = String::from_utf8_lossy(&ok.stderr);
    assert!(ok.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "resumes from {} at step 2",
            out.join("checkpoint").display()
        )) && stderr.contains("changed since that checkpoint: ")
            && stderr.contains("run.seed: 0 → 9"),
        "{stderr}"
    );
    let saved = out.join("checkpoint/config.toml");
    let mut text = std::fs::read_to_string(&saved).unwrap();
    text.push('\n');
    std::fs::write(&saved, text).unwrap();
    let refused = check(&[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("a run of this config would not resume") && stderr.contains("config.toml"),
        "{stderr}"
    );
}
