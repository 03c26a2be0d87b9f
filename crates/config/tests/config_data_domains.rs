//! `[data]` adaptive mix and per-domain options: parsed, validated against the datasets'
//! domains, and printed back in a shape that loads again.

use sluice_config::{self as config, ConfigErrorKind, parse};

fn load(text: &str) -> Result<config::Config, config::ConfigError> {
    parse(text, "t.toml", &[], &|_| None)
}

#[test]
fn domain_options_parse_and_round_trip() {
    let text = r#"
        [data]
        datasets = ["math::arithmetic@train", "code::mbpp"]
        adaptive_mix = false
        [data.domains.code]
        system_prompt = "You write Python."
        task = "sandbox"
        env_url = "http://10.0.0.7:7000"
        [data.domains.code.rubric]
        weights = { passed = 3.0, "env.tests" = 1.0 }
        error_reward = -0.5
        timeout_s = 2.5
    "#;
    let c = load(text).unwrap();
    assert!(!c.data.adaptive_mix);
    let code = &c.data.domain_options["code"];
    assert_eq!(code.system_prompt.as_deref(), Some("You write Python."));
    assert_eq!(code.task.as_deref(), Some("sandbox"));
    assert_eq!(code.env_url.as_deref(), Some("http://10.0.0.7:7000"));
    let rubric = code.rubric.as_ref().unwrap();
    assert_eq!(rubric.weights["passed"], 3.0);
    assert_eq!(rubric.weights["env.tests"], 1.0);
    assert_eq!(rubric.error_reward, Some(-0.5));
    assert_eq!(rubric.truncation_reward, None);
    assert_eq!(rubric.timeout, Some(std::time::Duration::from_millis(2500)));
    let printed = toml::to_string(&c).unwrap();
    assert_eq!(load(&printed).unwrap(), c);

    let defaults = load("[data]\ndatasets = [\"math::arithmetic\"]\n").unwrap();
    assert!(defaults.data.adaptive_mix, "adaptation is on by default");
    assert!(defaults.data.domain_options.is_empty());
}

#[test]
fn domain_options_name_declared_domains_and_valid_tasks() {
    let err =
        load("[data]\ndatasets = [\"math::a\"]\n[data.domains.chess]\nsystem_prompt = \"x\"\n")
            .unwrap_err()
            .to_string();
    assert!(
        err.contains("data.domains.chess") && err.contains("the datasets' domains are: math"),
        "{err}"
    );
    let err = load("[data]\ndatasets = [\"math::a\"]\n[data.domains.math]\ntask = \"a b\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("data.domains.math.task"), "{err}");
    let err = load("[data]\ndatasets = [\"math::a\"]\n[data.domains.math]\nprompt = \"x\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("prompt"), "{err}");
}

#[test]
fn template_kwargs_and_prompt_bound_parse_and_round_trip() {
    let c = load(
        "[model]\nchat_template_kwargs = { enable_thinking = false, style = \"terse\" }\n[rollout]\nmax_prompt_tokens = 300\n",
    )
    .unwrap();
    assert_eq!(
        c.model.chat_template_kwargs["enable_thinking"],
        toml::Value::Boolean(false)
    );
    assert_eq!(c.rollout.max_prompt_tokens.map(|n| n.get()), Some(300));
    let printed = toml::to_string(&c).unwrap();
    assert_eq!(load(&printed).unwrap(), c);
    let defaults = load("").unwrap();
    assert!(defaults.model.chat_template_kwargs.is_empty());
    assert_eq!(defaults.rollout.max_prompt_tokens, None, "0 is the default");
}

/// (TOML text, expected message, expected kind): each mistake in a domain's rubric or env server.
const BAD_DOMAINS: &[(&str, &str, ConfigErrorKind)] = &[
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math.rubric]\nweight = { correct = 1.0 }",
        "test.toml: data.domains.math.rubric.weight: unknown key; did you mean `weights`?",
        ConfigErrorKind::UnknownKey,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math.rubric]\nerror_reward = 0.0",
        "test.toml: data.domains.math.rubric.weights: expected at least one reward function, e.g. `weights = { correct = 1.0 }`",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math.rubric]\nweights = { correct = -1.0 }",
        "test.toml: data.domains.math.rubric.weights.correct: expected a weight ≥ 0, got -1",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math.rubric]\nweights = { correct = 0.0, format = 0 }",
        "test.toml: data.domains.math.rubric.weights: expected at least one weight > 0, all are 0",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math.rubric]\nweights = { \"a b\" = 1.0 }",
        "test.toml: data.domains.math.rubric.weights.a b: expected a reward function name of [A-Za-z0-9_.-], got `a b`",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math.rubric]\nweights = { correct = \"high\" }",
        "test.toml: data.domains.math.rubric.weights.correct: invalid type: string \"high\", expected a number",
        ConfigErrorKind::Type,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math.rubric]\nweights = { correct = 1.0 }\nerror_reward = nan",
        "test.toml: data.domains.math.rubric.error_reward: expected a finite number, got NaN",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math.rubric]\nweights = { correct = 1.0 }\ntruncation_reward = 1e9",
        "test.toml: data.domains.math.rubric.truncation_reward: expected at most 1000000 (a reward), got 1000000000",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math.rubric]\nweights = { correct = 1.0 }\ntimeout_s = 0",
        "test.toml: data.domains.math.rubric.timeout_s: expected a number of seconds > 0, got 0",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math]\nenv_url = \"localhost:7000\"",
        "test.toml: data.domains.math.env_url: expected an http:// or https:// base URL of an env server, got `localhost:7000`",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math]\nenv_urls = \"http://x\"",
        "test.toml: data.domains.math.env_urls: unknown key; did you mean `env_url`?",
        ConfigErrorKind::UnknownKey,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math]\nenv_nodes = true",
        "test.toml: data.domains.math.env_nodes: only a head (node.role = \"head\") has env nodes joined to it; use env_url for an env server of your own",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math]\nenv_nodes = true\nenv_url = \"http://10.0.0.7:7000\"",
        "test.toml: data.domains.math.env_nodes: expected one place for the domain's envs: set env_url (one env server) or env_nodes = true (the env nodes joined to the head), not both",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"math::a\"]\n[data.domains.math]\nenv_nodes = \"yes\"",
        "test.toml: data.domains.math.env_nodes: invalid type: string \"yes\", expected true or false",
        ConfigErrorKind::Type,
    ),
];

#[test]
fn bad_domain_rubrics_and_env_servers_name_the_key() {
    let mut failures = Vec::new();
    for (text, expected, kind) in BAD_DOMAINS {
        match parse(text, "test.toml", &[], &|_| None) {
            Ok(_) => failures.push(format!("accepted: {text:?}")),
            Err(e) if e.to_string() != *expected || e.kind != *kind => failures.push(format!(
                "input {text:?}\n  expected [{}] {expected}\n  got      [{}] {e}",
                kind.as_str(),
                e.kind()
            )),
            Err(_) => {}
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn rubric_regex_compiles_at_load_and_round_trips() {
    let text = r#"
        [data]
        datasets = ["math::word_problems@train"]
        [data.domains.math.rubric]
        weights = { regex = 1.0, format = 0.1 }
        regex = '(?i)answer:\s*(\d+)'
    "#;
    let c = load(text).unwrap();
    let rubric = c.data.domain_options["math"].rubric.as_ref().unwrap();
    assert_eq!(rubric.regex.as_deref(), Some(r"(?i)answer:\s*(\d+)"));
    let printed = toml::to_string(&c).unwrap();
    assert_eq!(load(&printed).unwrap(), c);

    let bad = text.replace(r"(\d+)'", r"(\d+'");
    let err = load(&bad).unwrap_err().to_string();
    assert!(
        err.contains("data.domains.math.rubric.regex")
            && err.contains("regular expression")
            && err.contains("unclosed group"),
        "{err}"
    );
    assert!(!err.contains('\n'), "one line: {err}");
    let unused = text.replace("regex = 1.0, ", "");
    let err = load(&unused).unwrap_err().to_string();
    assert!(
        err.contains("data.domains.math.rubric.regex") && err.contains("does not name"),
        "{err}"
    );
}

#[test]
fn a_rubric_judge_parses_with_defaults_round_trips_and_names_bad_keys() {
    let text = r#"
        [data]
        datasets = ["math::word_problems@train"]
        [data.domains.math.rubric]
        weights = { judge = 1.0, format = 0.1 }
        [data.domains.math.rubric.judge]
        url = "http://127.0.0.1:8000/v1/"
        model = "Qwen/Qwen2.5-7B-Instruct"
    "#;
    let c = load(text).unwrap();
    let rubric = c.data.domain_options["math"].rubric.as_ref().unwrap();
    let judge = rubric.judge.as_ref().unwrap();
    assert_eq!(judge.url, "http://127.0.0.1:8000/v1");
    assert_eq!(judge.prompt, config::DEFAULT_JUDGE_PROMPT);
    assert_eq!(judge.score_regex, config::DEFAULT_SCORE_REGEX);
    assert_eq!((judge.max_score, judge.max_tokens), (10.0, 512));
    assert_eq!((judge.concurrency, judge.timeout.as_secs()), (16, 60));
    let printed = toml::to_string(&c).unwrap();
    assert_eq!(load(&printed).unwrap(), c);

    let refused = |extra: &str, replace: (&str, &str)| {
        let bad = format!("{}{extra}\n", text.replace(replace.0, replace.1));
        load(&bad).unwrap_err().to_string()
    };
    let key = "data.domains.math.rubric.judge";
    for (extra, replace, want) in [
        ("", ("judge = 1.0, ", ""), "does not name"),
        ("", ("url = \"http", "url = \"https"), "http://"),
        ("", ("model = \"Qwen/Qwen2.5-7B-Instruct\"", ""), ".model"),
        (
            "prompt = \"Grade {answer}\"",
            ("", ""),
            "unknown placeholder `{answer}`",
        ),
        ("prompt = \"Grade {question}\"", ("", ""), "`{reply}`"),
        ("prompt = \"Grade {reply\"", ("", ""), "unclosed"),
        ("score_regex = 'Score: \\d+'", ("", ""), "capture group"),
        ("max_score = 0", ("", ""), ".max_score"),
        ("concurrency = 5000", ("", ""), ".concurrency"),
        ("temperature = 3", ("", ""), ".temperature"),
    ] {
        let err = refused(extra, replace);
        assert!(err.contains(key) && err.contains(want), "{extra}: {err}");
    }
    // Braces doubled are literal braces, not placeholders.
    let literal = format!("{text}prompt = \"JSON {{{{\\\"score\\\": N}}}} for {{reply}}\"\n");
    load(&literal).unwrap();
}

#[test]
fn a_rubric_reward_model_parses_with_defaults_round_trips_and_names_bad_keys() {
    let text = r#"
        [data]
        datasets = ["math::word_problems@train"]
        [data.domains.math.rubric]
        weights = { reward_model = 1.0, format = 0.1 }
        [data.domains.math.rubric.reward_model]
        path = "models/Skywork-Reward-V2-Qwen3-0.6B"
    "#;
    let c = load(text).unwrap();
    let rubric = c.data.domain_options["math"].rubric.as_ref().unwrap();
    let model = rubric.reward_model.as_ref().unwrap();
    assert_eq!(model.path, "models/Skywork-Reward-V2-Qwen3-0.6B");
    assert_eq!(model.device, config::Device::Cpu);
    assert_eq!((model.max_tokens, model.sigmoid), (8192, false));
    let printed = toml::to_string(&c).unwrap();
    assert_eq!(load(&printed).unwrap(), c);
    let on_gpu = load(&format!("{text}device = \"cuda:1\"\nsigmoid = true\n")).unwrap();
    let model = on_gpu.data.domain_options["math"].rubric.as_ref().unwrap();
    let model = model.reward_model.as_ref().unwrap();
    assert_eq!(
        (model.device, model.sigmoid),
        (config::Device::Cuda(1), true)
    );
    assert_eq!(load(&toml::to_string(&on_gpu).unwrap()).unwrap(), on_gpu);

    let key = "data.domains.math.rubric.reward_model";
    for (extra, replace, want) in [
        ("", ("reward_model = 1.0, ", ""), "does not name"),
        (
            "",
            ("path = \"models/Skywork-Reward-V2-Qwen3-0.6B\"", ""),
            ".path",
        ),
        ("device = \"tpu\"", ("", ""), ".device"),
        ("max_tokens = 0", ("", ""), ".max_tokens"),
        ("batch = 4", ("", ""), "batch"),
    ] {
        let bad = format!("{}{extra}\n", text.replace(replace.0, replace.1));
        let err = load(&bad).unwrap_err().to_string();
        assert!(err.contains(key) && err.contains(want), "{extra}: {err}");
    }
}

#[test]
fn qa_row_fields_and_marker_parse_and_round_trip() {
    let text = r#"
        [data]
        datasets = ["gsm8k::gsm8k@train"]
        [data.domains.gsm8k]
        task = "qa"
        question_field = "problem"
        answer_field = "solution"
        system_prompt_field = "instructions"
        answer_marker = "boxed"
    "#;
    let c = load(text).unwrap();
    let d = &c.data.domain_options["gsm8k"];
    assert_eq!(d.question_field.as_deref(), Some("problem"));
    assert_eq!(d.answer_field.as_deref(), Some("solution"));
    assert_eq!(d.system_prompt_field.as_deref(), Some("instructions"));
    assert_eq!(d.answer_marker, Some(config::AnswerMarker::Boxed));
    let printed = toml::to_string(&c).unwrap();
    assert!(printed.contains("answer_marker = \"boxed\""), "{printed}");
    assert_eq!(load(&printed).unwrap(), c);
    let hashes = load(&text.replace("\"boxed\"", "\"####\"")).unwrap();
    assert_eq!(
        hashes.data.domain_options["gsm8k"].answer_marker,
        Some(config::AnswerMarker::Hashes)
    );

    let err = load(&text.replace("\"boxed\"", "\"box\""))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("data.domains.gsm8k.answer_marker") && err.contains("boxed"),
        "{err}"
    );
    let err = load(&text.replace("\"problem\"", "\" \""))
        .unwrap_err()
        .to_string();
    assert!(err.contains("data.domains.gsm8k.question_field"), "{err}");
}

#[test]
fn sandbox_limits_parse_round_trip_and_name_a_bad_key() {
    let text = r#"
        [data]
        datasets = ["code::python_code@train"]
        [data.domains.code.sandbox]
        cpu_seconds = 4
        wall_s = 7.5
        memory_mib = 512
    "#;
    let c = load(text).unwrap();
    let sandbox = c.data.domain_options["code"].sandbox.unwrap();
    assert_eq!(sandbox.cpu_seconds, Some(4));
    assert_eq!(sandbox.wall_s, Some(7.5));
    assert_eq!(sandbox.memory_mib, Some(512));
    assert_eq!(
        sandbox.max_processes, None,
        "unset keys keep the task's default"
    );
    let printed = toml::to_string(&c).unwrap();
    assert_eq!(load(&printed).unwrap(), c);

    for (key, value) in [
        ("wall_s", "0"),
        ("cpu_seconds", "0"),
        ("memory_mib", "8"),
        ("max_processes", "100000"),
    ] {
        let text = format!(
            "[data]\ndatasets = [\"code::python_code\"]\n[data.domains.code.sandbox]\n{key} = {value}\n"
        );
        let err = load(&text).unwrap_err().to_string();
        assert!(
            err.contains(&format!("data.domains.code.sandbox.{key}")),
            "{key} = {value}: {err}"
        );
    }
    let err = load(
        "[data]\ndatasets = [\"code::python_code\"]\n[data.domains.code.sandbox]\nnetwork = true\n",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("network"), "{err}");
}

#[test]
fn a_domains_gamma_is_a_discount_in_zero_one() {
    let c = load("[data]\ndatasets = [\"walk::episodic\"]\n[data.domains.walk]\ngamma = 0.8\n")
        .unwrap();
    assert_eq!(c.data.domain_options["walk"].gamma, Some(0.8));
    let printed = toml::to_string(&c).unwrap();
    assert_eq!(load(&printed).unwrap(), c);
    for bad in ["0", "1.5", "-0.1"] {
        let text = format!(
            "[data]\ndatasets = [\"walk::episodic\"]\n[data.domains.walk]\ngamma = {bad}\n"
        );
        let err = load(&text).unwrap_err().to_string();
        assert!(
            err.starts_with("t.toml: data.domains.walk.gamma: expected a number in (0, 1]"),
            "{err}"
        );
    }
}
