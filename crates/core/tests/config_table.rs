//! Config parse → validate on good and bad files. Each bad case asserts the whole one-line message:
//! file, key and expectation are the contract with users.

use sluice_core::WeightUpdateMode;
use sluice_core::config::{self, ConfigErrorKind, Override};

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
    // no concurrency cap beyond admission: (η + 1) · groups_per_step · group_size.
    assert_eq!(c.rollout.knobs.max_concurrent_rollouts, 2 * 8 * 8);
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
        remote_urls = ["http://10.0.0.1:30000", "https://gpu-2/"]
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

/// (TOML text, `--set` overrides, expected message, expected kind)
const BAD: &[(&str, &[&str], &str, ConfigErrorKind)] = &[
    (
        "[rollout]\ngrop_size = 4",
        &[],
        "test.toml: rollout.grop_size: unknown key; did you mean `group_size`?",
        ConfigErrorKind::UnknownKey,
    ),
    (
        "[rolout]\ngroup_size = 4",
        &[],
        "test.toml: rolout: unknown key; did you mean `rollout`?",
        ConfigErrorKind::UnknownKey,
    ),
    (
        "[engine]\nzzz = 1",
        &[],
        "test.toml: engine.zzz: unknown key; expected one of: backend, replicas, max_running_sequences, max_step_tokens, threads, kv_cache_mb, remote_urls, request_timeout_s, remote_keep_versions, simulated",
        ConfigErrorKind::UnknownKey,
    ),
    (
        "[rollout]\ngroup_size = \"eight\"",
        &[],
        "test.toml: rollout.group_size: invalid type: string \"eight\", expected an integer",
        ConfigErrorKind::Type,
    ),
    (
        "[rollout]\nenable_partial_rollout = 1",
        &[],
        "test.toml: rollout.enable_partial_rollout: invalid type: integer `1`, expected true or false",
        ConfigErrorKind::Type,
    ),
    (
        "[data]\ndatasets = \"math::x\"",
        &[],
        "test.toml: data.datasets: invalid type: string \"math::x\", expected a sequence",
        ConfigErrorKind::Type,
    ),
    (
        "[rollout]\ngroup_size = 0",
        &[],
        "test.toml: rollout.group_size: expected an integer ≥ 1, got 0",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\nenv_workers = 0",
        &[],
        "test.toml: rollout.env_workers: expected an integer ≥ 1, got 0",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\nenv_calls_per_worker = -4",
        &[],
        "test.toml: rollout.env_calls_per_worker: expected an integer ≥ 1, got -4",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nremote_keep_versions = 0",
        &[],
        "test.toml: engine.remote_keep_versions: expected an integer ≥ 1, got 0",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\nstaleness_threshold = -0.5",
        &[],
        "test.toml: rollout.staleness_threshold: expected a number ≥ 0, got -0.5",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\nstaleness_threshold = 101.0",
        &[],
        "test.toml: rollout.staleness_threshold: expected a number ≤ 100, got 101",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\nstaleness_threshold = nan",
        &[],
        "test.toml: rollout.staleness_threshold: expected a number ≥ 0, got NaN",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\nweight_update_mode = \"sometimes\"",
        &[],
        "test.toml: rollout.weight_update_mode: expected one of abort_resume, in_flight, drain, got `sometimes`",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nthreads = -1",
        &[],
        "test.toml: engine.threads: expected an integer ≥ 0, got -1",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\nthreads = -2",
        &[],
        "test.toml: trainer.threads: expected an integer ≥ 0, got -2",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\nmax_version_lag = -1",
        &[],
        "test.toml: rollout.max_version_lag: expected an integer ≥ 0, got -1",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\ntop_p = 0",
        &[],
        "test.toml: rollout.top_p: expected a number in (0, 1], got 0",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\ngroups_per_step = 5000000000",
        &[],
        "test.toml: rollout.groups_per_step: expected at most 65536 (groups per training step), got 5000000000",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\ndomain_mix = { chess = 1.0 }\n[data]\ndatasets = [\"math::a\"]",
        &[],
        "test.toml: rollout.domain_mix.chess: unknown domain; data.datasets declares: math",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\ndomain_mix = { math = 0.0 }",
        &[],
        "test.toml: rollout.domain_mix: expected at least one weight > 0, all are 0",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\nloss = \"dpo\"",
        &[],
        "test.toml: trainer.loss: expected one of ppo, tis, decoupled_ppo, got `dpo`",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\nclip_low = 1.5",
        &[],
        "test.toml: trainer.clip_low: expected a number in [0, 1), got 1.5",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\nlearning_rate = 0",
        &[],
        "test.toml: trainer.learning_rate: expected a number > 0, got 0",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\ngamma = 1.5",
        &[],
        "test.toml: trainer.gamma: expected a number in (0, 1], got 1.5",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\nloss_aggregation = \"mean\"",
        &[],
        "test.toml: trainer.loss_aggregation: expected one of token_mean, sequence_mean, rollout_normalized, got `mean`",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\ntis_level = \"turn\"",
        &[],
        "test.toml: trainer.tis_level: expected one of token, sequence, got `turn`",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\ntis_mode = \"clip\"",
        &[],
        "test.toml: trainer.tis_mode: expected one of truncate, mask, got `clip`",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\nis_cap = 0",
        &[],
        "test.toml: trainer.is_cap: expected a number > 0, got 0",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\noversized_text = \"truncate\"",
        &[],
        "test.toml: trainer.oversized_text: expected one of split, reject, got `truncate`",
        ConfigErrorKind::Value,
    ),
    (
        "[model]\ndtype = \"f64\"",
        &[],
        "test.toml: model.dtype: expected one of f32, bf16, f16, got `f64`",
        ConfigErrorKind::Value,
    ),
    (
        "[model]\ndevice = \"tpu\"",
        &[],
        "test.toml: model.device: expected cpu, cuda or cuda:N, got `tpu`",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nbackend = \"remote\"",
        &[],
        "test.toml: engine.remote_urls: backend `remote` needs at least one base URL",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nremote_urls = [\"localhost:3000\"]",
        &[],
        "test.toml: engine.remote_urls[0]: expected an http:// or https:// base URL, got `localhost:3000`",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"gsm8k\"]",
        &[],
        "test.toml: data.datasets[0]: expected `domain::name[@split]` with parts of [A-Za-z0-9_.-], got `gsm8k`",
        ConfigErrorKind::Value,
    ),
    (
        "[data]\ndatasets = [\"m::a\", \"m::a\"]",
        &[],
        "test.toml: data.datasets[1]: `m::a` is listed twice",
        ConfigErrorKind::Value,
    ),
    (
        "[run]\nname = \"my run\"",
        &[],
        "test.toml: run.name: expected a non-empty name of [A-Za-z0-9._-], got `my run`",
        ConfigErrorKind::Value,
    ),
    (
        "[run]\nmax_steps = 0",
        &[],
        "test.toml: run.max_steps: expected an integer ≥ 1, got 0",
        ConfigErrorKind::Value,
    ),
    (
        "[metrics]\nlisten = \"localhost\"",
        &[],
        "test.toml: metrics.listen: expected an address like 127.0.0.1:9400, got `localhost`",
        ConfigErrorKind::Value,
    ),
    (
        "[admin]\nlisten = \"0.0.0.0:9401\"",
        &[],
        "test.toml: admin.listen: 0.0.0.0:9401 is not a loopback address; set admin.token or $SLUICE_ADMIN_TOKEN to expose the admin API",
        ConfigErrorKind::Value,
    ),
    (
        "[admin]\nlisten = \"127.0.0.1:9400\"",
        &[],
        "test.toml: admin.listen: 127.0.0.1:9400 is also metrics.listen; give them different ports",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout\ngroup_size = 4",
        &[],
        "test.toml: line 1, column 9: invalid TOML: unclosed table, expected `]`",
        ConfigErrorKind::Syntax,
    ),
    // Overrides are checked like the file, and errors say the value came from --set.
    (
        "[run]\nname = \"a\"\nname = \"b\"",
        &[],
        "test.toml: line 3, column 1: invalid TOML: duplicate key",
        ConfigErrorKind::Syntax,
    ),
    (
        "",
        &["rollout.group_size=0"],
        "test.toml: --set rollout.group_size: expected an integer ≥ 1, got 0",
        ConfigErrorKind::Value,
    ),
    (
        "",
        &["rollout.grop_size=3"],
        "test.toml: --set rollout.grop_size: unknown key; did you mean `group_size`?",
        ConfigErrorKind::UnknownKey,
    ),
    (
        "",
        &["rollout.weight_update_mode=later"],
        "test.toml: --set rollout.weight_update_mode: expected one of abort_resume, in_flight, drain, got `later`",
        ConfigErrorKind::Value,
    ),
    (
        "[run]\nname = \"x\"",
        &["run.name.first=3"],
        "test.toml: --set run.name.first: `run.name` is not a table (found string), so it has no key `first`",
        ConfigErrorKind::Override,
    ),
    // Upper bounds: a typo'd exponent is refused with the key, never a panic at run time.
    (
        "[supervision]\nshutdown_timeout_s = 1e300",
        &[],
        "test.toml: supervision.shutdown_timeout_s: expected at most 604800 (seconds; a week at most), got 1e300",
        ConfigErrorKind::Value,
    ),
    (
        "",
        &["supervision.engine_watchdog_s=1e300"],
        "test.toml: --set supervision.engine_watchdog_s: expected at most 604800 (seconds; a week at most), got 1e300",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nreplicas = 100000",
        &[],
        "test.toml: engine.replicas: expected at most 256 (engine replicas on one node), got 100000",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nkv_cache_mb = 2000000",
        &[],
        "test.toml: engine.kv_cache_mb: expected at most 1048576 (MiB of KV cache per replica; 1 TiB at most), got 2000000",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nkv_cache_mb = -1",
        &[],
        "test.toml: engine.kv_cache_mb: expected an integer ≥ 0, got -1",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nmax_running_sequences = 100000",
        &[],
        "test.toml: engine.max_running_sequences: expected at most 16384 (sequences per replica), got 100000",
        ConfigErrorKind::Value,
    ),
    (
        "[engine.simulated.lengths.math]\ndistribution = \"fixed\"\ntokens = 10000000",
        &[],
        "test.toml: engine.simulated.lengths.math.tokens: expected at most 1048576 (tokens), got 10000000",
        ConfigErrorKind::Value,
    ),
    (
        "[engine.simulated]\ntime_scale = 1e300",
        &[],
        "test.toml: engine.simulated.time_scale: expected at most 1000 (times real time; 1000 at most), got 1e300",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nbackend = \"simulated\"\n[trainer.simulated]\nenabled = false",
        &[],
        "test.toml: trainer.simulated.enabled: expected true with engine.backend = \"simulated\" (the simulated engine and the simulated trainer go together), got false",
        ConfigErrorKind::Value,
    ),
    (
        "",
        &["trainer.simulated.enabled=true"],
        "test.toml: --set trainer.simulated.enabled: expected false with engine.backend = \"native\" (the simulated engine and the simulated trainer go together), got true",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\nlearning_rate = 5.0",
        &[],
        "test.toml: trainer.learning_rate: expected at most 1 (the learning rate), got 5",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\ndomain_mix = { a = 1e300 }\n[data]\ndatasets = [\"a::x\"]",
        &[],
        "test.toml: rollout.domain_mix.a: expected at most 1000000000 (a relative weight), got 1e300",
        ConfigErrorKind::Value,
    ),
    (
        "[faults]\nenv_hang_every_steps = 10000000000",
        &[],
        "test.toml: faults.env_hang_every_steps: expected at most 1000000000 (a fault period), got 10000000000",
        ConfigErrorKind::Value,
    ),
    (
        "[admin]\ntoken = \"<redacted>\"",
        &[],
        "test.toml: admin.token: `<redacted>` is the placeholder `sluice check` prints; set the real token",
        ConfigErrorKind::Value,
    ),
    (
        "[trainer]\nminibatches = 4\n[rollout]\ngroups_per_step = 2",
        &[],
        "test.toml: trainer.minibatches: expected at most rollout.groups_per_step (2): each minibatch holds whole groups; got 4",
        ConfigErrorKind::Value,
    ),
    (
        "[model]\nchat_template_kwargs = { \"enable-thinking\" = false }",
        &[],
        "test.toml: model.chat_template_kwargs.enable-thinking: expected a template variable name of [A-Za-z_][A-Za-z0-9_]*, got `enable-thinking`",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\nmax_prompt_tokens = -1",
        &[],
        "test.toml: rollout.max_prompt_tokens: expected an integer ≥ 0, got -1",
        ConfigErrorKind::Value,
    ),
    (
        "[rollout]\nmax_prompt_tokens = 2000000",
        &[],
        "test.toml: rollout.max_prompt_tokens: expected at most 1048576 (tokens), got 2000000",
        ConfigErrorKind::Value,
    ),
    // [node]: the roles of a run across machines.
    (
        "[node]\nrole = \"worker\"",
        &[],
        "test.toml: node.role: expected one of head, engine, env, got `worker`",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"engine\"",
        &[],
        "test.toml: node.head: an engine node joins a head: expected the head's admin URL, like http://10.0.0.1:9401",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"head\"\nhead = \"http://h:1\"",
        &[],
        "test.toml: node.head: the head joins no one: remove node.head (or set node.role = \"engine\" or \"env\")",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"engine\"\nhead = \"10.0.0.1:9401\"",
        &[],
        "test.toml: node.head: expected a base URL like http://10.0.0.1:9401, got `10.0.0.1:9401`",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"engine\"\nhead = \"http://h:1\"\nlisten = \"0.0.0.0:8000\"",
        &[],
        "test.toml: node.advertise: node.listen = 0.0.0.0:8000 is not an address the head can reach: set node.advertise to this node's URL",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"engine\"\nhead = \"http://h:1\"\nheartbeat_s = 2\nlost_after_s = 1",
        &[],
        "test.toml: node.lost_after_s: expected more seconds than node.heartbeat_s (2), got 1",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"head\"",
        &[],
        "test.toml: engine.backend: a head (node.role = \"head\") routes to the engine nodes that join it: expected \"remote\"",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"head\"\nmax_nodes = 5000",
        &[],
        "test.toml: node.max_nodes: expected at most 4096 (members of one head), got 5000",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"env\"\nhead = \"http://h:1\"\nname = \"a b\"",
        &[],
        "test.toml: node.name: expected 1 to 63 characters of [A-Za-z0-9._-], got `a b`",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"head\"\nlisten = \"127.0.0.1:1\"",
        &[],
        "test.toml: node.listen: the head serves on admin.listen; node.listen is for engine and env nodes",
        ConfigErrorKind::Value,
    ),
    (
        "[engine]\nbackend = \"remote\"\n[admin]\nlisten = \"0.0.0.0:9401\"\ntoken = \"t\"\n[node]\nrole = \"head\"",
        &[],
        "test.toml: node.advertise: admin.listen = 0.0.0.0:9401 is not an address engine nodes can reach: set node.advertise to the head's URL",
        ConfigErrorKind::Value,
    ),
    (
        "[node]\nrole = \"engine\"\nhead = \"http://h:1\"\nzzz = 1",
        &[],
        "test.toml: node.zzz: unknown key; expected one of: role, head, name, listen, advertise, heartbeat_s, lost_after_s, max_nodes",
        ConfigErrorKind::UnknownKey,
    ),
    (
        "[rollout]\nbalance_threshold = inf",
        &[],
        "test.toml: rollout.balance_threshold: expected a finite reward, got inf",
        ConfigErrorKind::Value,
    ),
];

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
