//! Config parse → validate on good and bad files. Each bad case asserts the whole one-line message:
//! file, key and expectation are the contract with users.

use sluice_config::{self as config, ConfigErrorKind, Override};
use sluice_core::WeightUpdateMode;

#[path = "config_table/bad_rows.rs"]
mod bad_rows;

use bad_rows::BAD;

const FILE: &str = "test.toml";

fn no_env(_: &str) -> Option<String> {
    None
}

fn parse(text: &str, sets: &[&str]) -> Result<config::Config, config::ConfigError> {
    let overrides: Vec<Override> = sets.iter().map(|s| s.parse().unwrap()).collect();
    config::parse(text, FILE, &overrides, &no_env)
}

#[test]
fn an_empty_file_is_a_valid_config_with_defaults() {
    let c = parse("", &[]).unwrap();
    assert_eq!(c.run.name, "sluice");
    assert_eq!(c.run.output_dir, std::path::PathBuf::from("runs/sluice"));
    assert_eq!(c.model.path, std::path::PathBuf::from("runs/sluice/model"));
    assert_eq!(
        c.replay.path,
        std::path::PathBuf::from("runs/sluice/replay")
    );
    assert_eq!(c.metrics.listen.to_string(), "127.0.0.1:9400");
    assert_eq!(c.admin.listen.to_string(), "127.0.0.1:9401");
    assert_eq!(c.rollout.knobs.max_version_lag, 1);
    assert_eq!(c.rollout.knobs.staleness_threshold, 0.0);
    // trigger size 0 resolves to the global batch size in groups.
    assert_eq!(c.rollout.knobs.tail_batch_trigger_size, 8);
    // no concurrency cap beyond admission, whose bound the scheduler reads from the live η.
    assert_eq!(c.rollout.knobs.max_concurrent_rollouts, 0);
}

#[test]
fn a_full_file_resolves() {
    let text = r#"
        [run]
        name = "exp-1"
        output_dir = "/tmp/exp"
        seed = 7
        max_steps = 3
        [model]
        path = "/models/qwen"
        dtype = "bf16"
        device = "cuda:1"
        [engine]
        backend = "remote"
        remote_urls = ["http://10.0.0.1:30000", "http://gpu-2:30000"]
        request_timeout_s = 5
        [trainer]
        loss = "decoupled_ppo"
        lr_schedule = "cosine"
        [rollout]
        group_size = 4
        groups_per_step = 16
        staleness_threshold = 0.2
        weight_update_mode = "drain"
        tail_batch_candidate_steps = 1
        domain_mix = { math = 0.4, code = 0.3, chat = 0.3 }
        [data]
        datasets = ["math::gsm8k@train", "code::mbpp", "chat::ultra@test"]
        on_bad_line = "fail"
        [admin]
        listen = "0.0.0.0:9401"
        token = "s3cret"
    "#;
    let c = parse(text, &[]).unwrap();
    assert_eq!(c.run.seed, 7);
    assert_eq!(c.model.path, std::path::PathBuf::from("/models/qwen"));
    assert_eq!(c.model.device, config::Device::Cuda(1));
    assert_eq!(c.engine.remote_urls.len(), 2);
    assert_eq!(c.engine.replicas.get(), 2, "one replica per remote server");
    assert_eq!(c.engine.request_timeout.as_secs(), 5);
    assert_eq!(c.trainer.loss, config::LossKind::DecoupledPpo);
    assert_eq!(c.rollout.knobs.weight_update_mode, WeightUpdateMode::Drain);
    assert_eq!(c.rollout.knobs.tail_batch_trigger_size, 16);
    assert_eq!(c.data.domains(), ["math", "code", "chat"]);
    assert_eq!(c.data.datasets[0].split.as_deref(), Some("train"));
    assert_eq!(c.admin.token.as_ref().unwrap().expose(), "s3cret");
    let printed = c.to_toml();
    assert!(printed.contains("token = \"<redacted>\""), "{printed}");
    assert!(!printed.contains("s3cret"));
}

#[test]
fn each_role_names_its_device_and_defaults_to_the_model_s() {
    let c = parse("[model]\ndevice = \"cuda:1\"", &[]).unwrap();
    assert_eq!(c.engine.device, config::Device::Cuda(1));
    assert_eq!(c.trainer.device, config::Device::Cuda(1));
    assert_eq!(c.eval.device, config::Device::Cuda(1));
    // The evaluator follows the engine unless it names its own.
    let c = parse(
        "[engine]\ndevice = \"cuda:0\"\n[trainer]\ndevice = \"cuda\"",
        &["model.device=cpu"],
    )
    .unwrap();
    assert_eq!(c.model.device, config::Device::Cpu);
    assert_eq!(c.engine.device, config::Device::Cuda(0));
    assert_eq!(c.trainer.device, config::Device::Cuda(0));
    assert_eq!(c.eval.device, config::Device::Cuda(0));
    let c = parse("", &["engine.device=cuda:2", "eval.device=cpu"]).unwrap();
    assert_eq!(
        (c.engine.device, c.trainer.device, c.eval.device),
        (
            config::Device::Cuda(2),
            config::Device::Cpu,
            config::Device::Cpu
        )
    );
    // The resolved devices print and load back.
    assert_eq!(parse(&c.to_toml(), &[]).unwrap(), c);
}

#[test]
fn kept_logits_default_follows_the_device_and_activation_checkpointing() {
    let kept = |sets: &[&str]| parse("", sets).unwrap().trainer.kept_logits_mib;
    assert_eq!(kept(&[]), 1024);
    assert_eq!(kept(&["trainer.device=\"cuda:0\""]), 8192);
    assert_eq!(kept(&["trainer.activation_checkpointing=true"]), 0);
    let both = [
        "trainer.device=\"cuda:0\"",
        "trainer.activation_checkpointing=true",
    ];
    assert_eq!(kept(&both), 0);
    // What is set wins, 0 included.
    assert_eq!(kept(&["trainer.kept_logits_mib=0"]), 0);
    let set = [
        "trainer.activation_checkpointing=true",
        "trainer.kept_logits_mib=64",
    ];
    assert_eq!(kept(&set), 64);
}

#[test]
fn the_printed_config_loads_back_to_the_same_config() {
    let c = parse(
        "[rollout]\ngroup_size = 3\ndomain_mix = { a = 1.0 }\n[data]\ndatasets = [\"a::x\"]",
        &["run.name=rt"],
    )
    .unwrap();
    let again = parse(&c.to_toml(), &[]).unwrap();
    assert_eq!(again, c);
}

#[test]
fn overrides_apply_before_validation() {
    let c = parse(
        "[rollout]\ngroup_size = 8",
        &[
            "rollout.group_size=2",
            "rollout.weight_update_mode=in_flight",
            "run.name=from-cli",
            "data.datasets=[\"m::a\", \"n::b\"]",
        ],
    )
    .unwrap();
    assert_eq!(c.rollout.group_size.get(), 2);
    assert_eq!(
        c.rollout.knobs.weight_update_mode,
        WeightUpdateMode::InFlight
    );
    // Derived defaults see the overridden value.
    assert_eq!(c.run.output_dir, std::path::PathBuf::from("runs/from-cli"));
    assert_eq!(c.data.domains(), ["m", "n"]);
}

#[test]
fn minibatches_default_follows_the_loss_and_unsound_settings_are_advised() {
    let decoupled = |sets: &[&str]| {
        let mut all = vec!["trainer.loss=\"decoupled_ppo\""];
        all.extend_from_slice(sets);
        parse("", &all).unwrap()
    };
    // Unset: four updates for decoupled_ppo (a trust region for all but the first), at most
    // one per group; one for ppo.
    assert_eq!(decoupled(&[]).trainer.minibatches.get(), 4);
    assert_eq!(
        decoupled(&["rollout.groups_per_step=3"])
            .trainer
            .minibatches
            .get(),
        3
    );
    assert_eq!(parse("", &[]).unwrap().trainer.minibatches.get(), 1);
    assert!(decoupled(&[]).advisories().is_empty());
    // Set explicitly: kept, and one update with η > 0 is advised against.
    let one = decoupled(&["trainer.minibatches=1", "rollout.max_version_lag=4"]);
    assert_eq!(one.trainer.minibatches.get(), 1);
    let notes = one.advisories();
    assert_eq!(notes.len(), 1);
    assert!(
        notes[0].starts_with("trainer.minibatches = 1 with loss = \"decoupled_ppo\" and rollout.max_version_lag = 4: "),
        "{notes:?}"
    );
    let synchronous = decoupled(&["trainer.minibatches=1", "rollout.max_version_lag=0"]);
    assert!(
        synchronous.advisories().is_empty(),
        "η = 0 has no drift to bound"
    );
}

#[test]
fn one_rollout_a_group_and_a_dual_clip_under_tis_are_advised_against() {
    let with = |sets: &[&str]| parse("", sets).unwrap().advisories();
    let single = with(&["rollout.group_size=1", "trainer.advantage=\"rloo\""]);
    assert_eq!(single.len(), 1, "{single:?}");
    assert!(
        single[0].starts_with("rollout.group_size = 1 with trainer.advantage = \"rloo\": ")
            && single[0].contains("every advantage is 0"),
        "{single:?}"
    );
    let tis = with(&["trainer.loss=\"tis\"", "trainer.dual_clip=3"]);
    assert_eq!(tis.len(), 1, "{tis:?}");
    assert!(tis[0].contains("changes nothing"), "{tis:?}");
    assert!(with(&["trainer.loss=\"ppo\"", "trainer.dual_clip=3"]).is_empty());
}

#[test]
fn a_prefix_version_lag_outside_in_flight_updates_is_advised_against() {
    let with = |sets: &[&str]| parse("", sets).unwrap().advisories();
    assert!(
        with(&[
            "engine.prefix_cache_version_lag=2",
            "rollout.weight_update_mode=\"in_flight\""
        ])
        .is_empty()
    );
    let drain = with(&[
        "engine.prefix_cache_version_lag=2",
        "rollout.weight_update_mode=\"drain\"",
    ]);
    assert_eq!(drain.len(), 1, "{drain:?}");
    assert!(
        drain[0].starts_with(
            "engine.prefix_cache_version_lag = 2 with rollout.weight_update_mode = \"drain\": "
        ),
        "{drain:?}"
    );
    let off = with(&[
        "engine.prefix_cache_version_lag=2",
        "engine.prefix_caching=false",
    ]);
    assert!(off[0].contains("nothing is cached"), "{off:?}");
    assert!(with(&[]).is_empty());
}

#[test]
fn the_admin_token_may_come_from_the_environment() {
    let env = |k: &str| (k == config::ADMIN_TOKEN_ENV).then(|| "from-env".to_owned());
    let c = config::parse("[admin]\nlisten = \"0.0.0.0:1\"", FILE, &[], &env).unwrap();
    assert_eq!(c.admin.token.unwrap().expose(), "from-env");
    // The file wins over the environment.
    let c = config::parse("[admin]\ntoken = \"file\"", FILE, &[], &env).unwrap();
    assert_eq!(c.admin.token.unwrap().expose(), "file");
    let empty = |_: &str| Some(String::new());
    let err = config::parse("", FILE, &[], &empty).unwrap_err();
    assert_eq!(
        err.to_string(),
        "test.toml: $SLUICE_ADMIN_TOKEN admin.token: expected a non-empty token, got an empty string"
    );
}

#[test]
fn node_roles_resolve_and_print_back() {
    // No [node]: the whole pipeline here, and nothing printed for it.
    let c = parse("", &[]).unwrap();
    assert!(c.node.is_none());
    assert!(!c.to_toml().contains("[node]"));
    // A head may route to joined engine nodes only: remote with no static URL.
    let head = parse(
        "[engine]\nbackend = \"remote\"\nreplicas = 2\n[node]\nrole = \"head\"\nheartbeat_s = 0.5",
        &[],
    )
    .unwrap();
    let node = head.node.as_ref().unwrap();
    assert_eq!(node.role, config::NodeRole::Head);
    assert_eq!((node.listen, node.head.as_deref()), (None, None));
    assert_eq!(node.heartbeat.as_millis(), 500);
    assert_eq!(head.engine.replicas.get(), 2);
    let again = parse(&head.to_toml(), &[]).unwrap();
    assert_eq!(again, head);
    let engine = parse(
        "[node]\nrole = \"engine\"\nhead = \"http://10.0.0.1:9401/\"",
        &[
            "node.listen=\"127.0.0.3:0\"",
            "node.advertise=\"http://10.0.0.3:8000\"",
        ],
    )
    .unwrap();
    let node = engine.node.as_ref().unwrap();
    assert_eq!(node.head.as_deref(), Some("http://10.0.0.1:9401"));
    assert_eq!(node.listen.unwrap().to_string(), "127.0.0.3:0");
    assert_eq!(parse(&engine.to_toml(), &[]).unwrap(), engine);
    let env = parse("[node]\nrole = \"env\"\nhead = \"http://h:1\"", &[]).unwrap();
    assert_eq!(
        env.node.unwrap().listen.unwrap().to_string(),
        "127.0.0.1:8071"
    );
}

#[test]
fn bad_configs_name_file_key_and_expectation() {
    assert!(BAD.len() >= 15);
    let mut failures = Vec::new();
    for (text, sets, expected, kind) in BAD {
        match parse(text, sets) {
            Ok(_) => failures.push(format!("accepted: {text:?} {sets:?}")),
            Err(e) => {
                let got = e.to_string();
                if got != *expected || e.kind != *kind {
                    failures.push(format!(
                        "input {text:?} {sets:?}\n  expected [{}] {expected}\n  got      [{}] {got}",
                        kind.as_str(),
                        e.kind()
                    ));
                }
                assert!(!got.contains('\n'), "message must be one line: {got}");
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn a_missing_file_names_the_file() {
    let err = config::load(std::path::Path::new("/nonexistent/sluice.toml"), &[]).unwrap_err();
    assert_eq!(err.kind, ConfigErrorKind::Io);
    assert!(
        err.to_string()
            .starts_with("/nonexistent/sluice.toml: cannot read config: "),
        "{err}"
    );
}

#[test]
fn domain_mix_names_a_bounded_number_of_domains() {
    let mix: Vec<String> = (0..=sluice_core::knobs::MAX_DOMAINS)
        .map(|i| format!("d{i} = 1.0"))
        .collect();
    let text = format!("[rollout]\ndomain_mix = {{ {} }}", mix.join(", "));
    let err = parse(&text, &[]).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "test.toml: rollout.domain_mix: expected at most {} domains, got {}",
            sluice_core::knobs::MAX_DOMAINS,
            sluice_core::knobs::MAX_DOMAINS + 1
        )
    );
}
