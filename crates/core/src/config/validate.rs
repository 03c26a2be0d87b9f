//! Phase one's error mapping and phase two's checks: raw values → typed config.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use super::ADMIN_TOKEN_ENV;
use super::error::{ConfigError, ConfigErrorKind, closest};
use super::raw::*;
use super::typed::*;
use crate::knobs::{AdmissionMode, Knobs, WeightUpdateMode};

pub(crate) mod bounds;
mod quickstart;
mod relations;
mod supervision;

/// What validation needs to know besides the raw values.
pub(crate) struct Ctx<'a> {
    pub file: &'a str,
    /// Keys set by `--set`, so their errors can say so.
    pub overridden: &'a BTreeSet<String>,
    pub env: &'a dyn Fn(&str) -> Option<String>,
}

impl Ctx<'_> {
    fn err(&self, key: &str, kind: ConfigErrorKind, message: impl Into<String>) -> ConfigError {
        let e = ConfigError::key(self.file, key, kind, message);
        // An override of `a.b` explains errors at `a.b`, below it (a table value) and above it
        // (an unknown section it created).
        let from_override = self.overridden.iter().any(|o| {
            o == key || o.starts_with(&format!("{key}.")) || key.starts_with(&format!("{o}."))
        });
        if from_override { e.via("--set") } else { e }
    }

    fn value(&self, key: &str, message: impl Into<String>) -> ConfigError {
        self.err(key, ConfigErrorKind::Value, message)
    }
}

/// Phase one: serde with the failing key's path, and messages rewritten for humans.
pub(crate) fn deserialize(tree: toml::Value, ctx: &Ctx<'_>) -> Result<RawConfig, ConfigError> {
    serde_path_to_error::deserialize::<_, RawConfig>(tree).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        let message = e.inner().message().to_owned();
        if let Some((field, expected)) = parse_unknown_field(&message) {
            // serde_path_to_error's path already ends with the unknown field.
            let key = if path.is_empty() { field.clone() } else { path };
            let expected: Vec<&str> = expected.iter().map(String::as_str).collect();
            let hint = match closest(&field, &expected) {
                Some(s) => format!("unknown key; did you mean `{s}`?"),
                None => format!("unknown key; expected one of: {}", expected.join(", ")),
            };
            ctx.err(&key, ConfigErrorKind::UnknownKey, hint)
        } else {
            ctx.err(&path, ConfigErrorKind::Type, humanize(&message))
        }
    })
}

/// Pulls the field and the valid names out of serde's `unknown field` message.
fn parse_unknown_field(message: &str) -> Option<(String, Vec<String>)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (field, rest) = rest.split_once('`')?;
    let expected = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    Some((field.to_owned(), expected))
}

/// serde names Rust types ("expected i64"); users wrote TOML.
fn humanize(message: &str) -> String {
    let mut out = message.to_owned();
    for (rust, human) in [
        ("expected i64", "expected an integer"),
        ("expected f64", "expected a number"),
        ("expected a boolean", "expected true or false"),
        ("expected a string", "expected a string"),
    ] {
        out = out.replace(rust, human);
    }
    out
}

fn non_zero_u32(ctx: &Ctx<'_>, key: &str, v: i64) -> Result<NonZeroU32, ConfigError> {
    let n = u32_at_least(ctx, key, v, 1)?;
    Ok(NonZeroU32::new(n).expect("checked ≥ 1"))
}

fn u32_incl_zero(ctx: &Ctx<'_>, key: &str, v: i64) -> Result<u32, ConfigError> {
    u32_at_least(ctx, key, v, 0)
}

fn u32_at_least(ctx: &Ctx<'_>, key: &str, v: i64, min: u32) -> Result<u32, ConfigError> {
    if v < i64::from(min) {
        return Err(ctx.value(key, format!("expected an integer ≥ {min}, got {v}")));
    }
    u32::try_from(v)
        .map_err(|_| ctx.value(key, format!("expected an integer ≤ {}, got {v}", u32::MAX)))
}

fn u64_incl_zero(ctx: &Ctx<'_>, key: &str, v: i64) -> Result<u64, ConfigError> {
    u64::try_from(v).map_err(|_| ctx.value(key, format!("expected an integer ≥ 0, got {v}")))
}

/// A finite number satisfying `ok`, described by `expected` in the error.
fn number(
    ctx: &Ctx<'_>,
    key: &str,
    v: f64,
    expected: &str,
    ok: impl Fn(f64) -> bool,
) -> Result<f64, ConfigError> {
    if v.is_finite() && ok(v) {
        Ok(v)
    } else {
        Err(ctx.value(key, format!("expected {expected}, got {v}")))
    }
}

/// One of a fixed set of spellings.
fn choice<T: Copy>(
    ctx: &Ctx<'_>,
    key: &str,
    v: &str,
    options: &[(&str, T)],
) -> Result<T, ConfigError> {
    options
        .iter()
        .find(|(name, _)| *name == v)
        .map(|(_, t)| *t)
        .ok_or_else(|| {
            let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
            ctx.value(
                key,
                format!("expected one of {}, got `{v}`", names.join(", ")),
            )
        })
}

fn socket(ctx: &Ctx<'_>, key: &str, v: &str) -> Result<SocketAddr, ConfigError> {
    v.parse().map_err(|_| {
        ctx.value(
            key,
            format!("expected an address like 127.0.0.1:9400, got `{v}`"),
        )
    })
}

impl RawConfig {
    /// Phase two: checks every value and resolves defaults that depend on other keys.
    pub(crate) fn validate(self, ctx: &Ctx<'_>) -> Result<Config, ConfigError> {
        let Self {
            run,
            model,
            engine,
            trainer,
            rollout,
            data,
            replay,
            metrics,
            admin,
            warmup,
            eval,
            supervision,
            faults,
        } = self;
        let run = validate_run(run, ctx)?;
        let model = validate_model(model, &run, ctx)?;
        let engine = validate_engine(engine, &run, ctx)?;
        let trainer = validate_trainer(trainer, &engine, ctx)?;
        let data = validate_data(data, ctx)?;
        let rollout = validate_rollout(rollout, &data, ctx)?;
        let replay = validate_replay(replay, &run, ctx)?;
        let metrics = MetricsConfig {
            enabled: metrics.enabled,
            listen: socket(ctx, "metrics.listen", &metrics.listen)?,
        };
        let admin = validate_admin(admin, ctx)?;
        if metrics.enabled && metrics.listen.port() != 0 && metrics.listen == admin.listen {
            return Err(ctx.value(
                "admin.listen",
                format!(
                    "{} is also metrics.listen; give them different ports",
                    admin.listen
                ),
            ));
        }
        let config = Config {
            run,
            model,
            engine,
            trainer,
            rollout,
            data,
            replay,
            metrics,
            admin,
            warmup: quickstart::validate_warmup(warmup, ctx)?,
            eval: quickstart::validate_eval(eval, ctx)?,
            supervision: supervision::validate_supervision(supervision, ctx)?,
            faults: supervision::validate_faults(faults, ctx)?,
        };
        relations::check(&config, ctx)?;
        Ok(config)
    }
}

fn validate_run(raw: RawRun, ctx: &Ctx<'_>) -> Result<RunConfig, ConfigError> {
    let valid_name = !raw.name.is_empty()
        && raw
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if !valid_name {
        return Err(ctx.value(
            "run.name",
            format!(
                "expected a non-empty name of [A-Za-z0-9._-], got `{}`",
                raw.name
            ),
        ));
    }
    let output_dir = match raw.output_dir {
        Some(d) if d.trim().is_empty() => {
            return Err(ctx.value(
                "run.output_dir",
                "expected a directory path, got an empty string",
            ));
        }
        Some(d) => PathBuf::from(d),
        None => PathBuf::from("runs").join(&raw.name),
    };
    let seed = u64_incl_zero(ctx, "run.seed", raw.seed)?;
    let max_steps = u64::try_from(raw.max_steps)
        .ok()
        .and_then(NonZeroU64::new)
        .ok_or_else(|| {
            ctx.value(
                "run.max_steps",
                format!("expected an integer ≥ 1, got {}", raw.max_steps),
            )
        })?;
    Ok(RunConfig {
        name: raw.name,
        output_dir,
        seed,
        max_steps,
    })
}

fn validate_model(
    raw: RawModel,
    run: &RunConfig,
    ctx: &Ctx<'_>,
) -> Result<ModelConfig, ConfigError> {
    let init_preset = raw
        .init_preset
        .as_deref()
        .map(|p| {
            choice(
                ctx,
                "model.init_preset",
                p,
                &[
                    ("tiny", ModelPreset::Tiny),
                    ("small", ModelPreset::Small),
                    ("medium", ModelPreset::Medium),
                ],
            )
        })
        .transpose()?;
    let dtype = choice(
        ctx,
        "model.dtype",
        &raw.dtype,
        &[
            ("f32", DType::F32),
            ("bf16", DType::Bf16),
            ("f16", DType::F16),
        ],
    )?;
    let device = Device::from_str(&raw.device).map_err(|()| {
        ctx.value(
            "model.device",
            format!("expected cpu, cuda or cuda:N, got `{}`", raw.device),
        )
    })?;
    let path = match raw.path {
        Some(p) if p.trim().is_empty() => {
            return Err(ctx.value(
                "model.path",
                "expected a model directory, got an empty string",
            ));
        }
        Some(p) => PathBuf::from(p),
        None => run.output_dir.join("model"),
    };
    Ok(ModelConfig {
        path,
        init_preset,
        dtype,
        device,
    })
}

fn validate_engine(
    raw: RawEngine,
    run: &RunConfig,
    ctx: &Ctx<'_>,
) -> Result<EngineConfig, ConfigError> {
    let backend = choice(
        ctx,
        "engine.backend",
        &raw.backend,
        &[
            ("native", EngineBackend::Native),
            ("remote", EngineBackend::Remote),
            ("simulated", EngineBackend::Simulated),
        ],
    )?;
    for (i, url) in raw.remote_urls.iter().enumerate() {
        let host = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"));
        if host.is_none_or(|h| h.trim_end_matches('/').is_empty()) {
            return Err(ctx.value(
                &format!("engine.remote_urls[{i}]"),
                format!("expected an http:// or https:// base URL, got `{url}`"),
            ));
        }
    }
    if backend == EngineBackend::Remote && raw.remote_urls.is_empty() {
        return Err(ctx.value(
            "engine.remote_urls",
            "backend `remote` needs at least one base URL",
        ));
    }
    let timeout = number(
        ctx,
        "engine.request_timeout_s",
        raw.request_timeout_s,
        "a number of seconds > 0",
        |v| v > 0.0,
    )?;
    Ok(EngineConfig {
        backend,
        replicas: non_zero_u32(ctx, "engine.replicas", raw.replicas)?,
        max_running_sequences: non_zero_u32(
            ctx,
            "engine.max_running_sequences",
            raw.max_running_sequences,
        )?,
        max_step_tokens: non_zero_u32(ctx, "engine.max_step_tokens", raw.max_step_tokens)?,
        threads: u32_incl_zero(ctx, "engine.threads", raw.threads)?,
        remote_urls: raw.remote_urls,
        request_timeout: Duration::from_secs_f64(timeout),
        remote_keep_versions: non_zero_u32(
            ctx,
            "engine.remote_keep_versions",
            raw.remote_keep_versions,
        )?,
        simulated: validate_sim_engine(raw.simulated, run, ctx)?,
    })
}

fn validate_sim_engine(
    raw: RawSimEngine,
    run: &RunConfig,
    ctx: &Ctx<'_>,
) -> Result<SimEngineConfig, ConfigError> {
    let k = |name: &str| format!("engine.simulated.{name}");
    let seconds =
        |name: &str, v: f64| number(ctx, &k(name), v, "a number of seconds ≥ 0", |v| v >= 0.0);
    let mut lengths = std::collections::BTreeMap::new();
    for (domain, d) in raw.lengths {
        let key = k(&format!("lengths.{domain}"));
        let dist = match d.distribution.as_str() {
            "fixed" => LengthDistribution::Fixed {
                tokens: non_zero_u32(ctx, &format!("{key}.tokens"), d.tokens)?.get(),
            },
            "uniform" => {
                let min = non_zero_u32(ctx, &format!("{key}.min"), d.min)?.get();
                let max = non_zero_u32(ctx, &format!("{key}.max"), d.max)?.get();
                if max < min {
                    return Err(ctx.value(
                        &format!("{key}.max"),
                        format!("expected an integer ≥ min ({min}), got {max}"),
                    ));
                }
                LengthDistribution::Uniform { min, max }
            }
            "lognormal" => LengthDistribution::Lognormal {
                median: number(
                    ctx,
                    &format!("{key}.median"),
                    d.median,
                    "a number ≥ 1",
                    |v| v >= 1.0,
                )?,
                sigma: number(
                    ctx,
                    &format!("{key}.sigma"),
                    d.sigma,
                    "a number ≥ 0",
                    |v| v >= 0.0,
                )?,
            },
            other => {
                return Err(ctx.value(
                    &format!("{key}.distribution"),
                    format!("expected one of fixed, uniform, lognormal, got `{other}`"),
                ));
            }
        };
        lengths.insert(domain, dist);
    }
    lengths
        .entry("default".to_owned())
        .or_insert(LengthDistribution::Lognormal {
            median: 128.0,
            sigma: 1.0,
        });
    Ok(SimEngineConfig {
        time_scale: seconds("time_scale", raw.time_scale)?,
        prefill_seconds_per_token: seconds(
            "prefill_seconds_per_token",
            raw.prefill_seconds_per_token,
        )?,
        decode_step_base_seconds: seconds(
            "decode_step_base_seconds",
            raw.decode_step_base_seconds,
        )?,
        decode_step_per_sequence_seconds: seconds(
            "decode_step_per_sequence_seconds",
            raw.decode_step_per_sequence_seconds,
        )?,
        prompt_tokens: non_zero_u32(ctx, &k("prompt_tokens"), raw.prompt_tokens)?,
        env_reply_tokens: u32_incl_zero(ctx, &k("env_reply_tokens"), raw.env_reply_tokens)?,
        lengths,
        seed: match raw.seed {
            Some(s) => u64_incl_zero(ctx, &k("seed"), s)?,
            None => run.seed,
        },
    })
}

fn validate_sim_trainer(
    raw: RawSimTrainer,
    engine: &EngineConfig,
    ctx: &Ctx<'_>,
) -> Result<SimTrainerConfig, ConfigError> {
    let seconds = |name: &str, v: f64| {
        number(
            ctx,
            &format!("trainer.simulated.{name}"),
            v,
            "a number of seconds ≥ 0",
            |v| v >= 0.0,
        )
    };
    Ok(SimTrainerConfig {
        enabled: raw
            .enabled
            .unwrap_or(engine.backend == EngineBackend::Simulated),
        step_base_seconds: seconds("step_base_seconds", raw.step_base_seconds)?,
        step_seconds_per_token: seconds("step_seconds_per_token", raw.step_seconds_per_token)?,
    })
}

fn validate_trainer(
    raw: RawTrainer,
    engine: &EngineConfig,
    ctx: &Ctx<'_>,
) -> Result<TrainerConfig, ConfigError> {
    Ok(TrainerConfig {
        simulated: validate_sim_trainer(raw.simulated, engine, ctx)?,
        loss: choice(
            ctx,
            "trainer.loss",
            &raw.loss,
            &[
                ("ppo", LossKind::Ppo),
                ("tis", LossKind::Tis),
                ("decoupled_ppo", LossKind::DecoupledPpo),
            ],
        )?,
        learning_rate: number(
            ctx,
            "trainer.learning_rate",
            raw.learning_rate,
            "a number > 0",
            |v| v > 0.0,
        )?,
        lr_schedule: choice(
            ctx,
            "trainer.lr_schedule",
            &raw.lr_schedule,
            &[
                ("constant", LrSchedule::Constant),
                ("cosine", LrSchedule::Cosine),
            ],
        )?,
        warmup_steps: u64_incl_zero(ctx, "trainer.warmup_steps", raw.warmup_steps)?,
        weight_decay: number(
            ctx,
            "trainer.weight_decay",
            raw.weight_decay,
            "a number ≥ 0",
            |v| v >= 0.0,
        )?,
        max_grad_norm: number(
            ctx,
            "trainer.max_grad_norm",
            raw.max_grad_norm,
            "a number > 0",
            |v| v > 0.0,
        )?,
        clip_low: number(
            ctx,
            "trainer.clip_low",
            raw.clip_low,
            "a number in [0, 1)",
            |v| (0.0..1.0).contains(&v),
        )?,
        clip_high: number(
            ctx,
            "trainer.clip_high",
            raw.clip_high,
            "a number ≥ 0",
            |v| v >= 0.0,
        )?,
        kl_coef: number(ctx, "trainer.kl_coef", raw.kl_coef, "a number ≥ 0", |v| {
            v >= 0.0
        })?,
        micro_batch_size: non_zero_u32(ctx, "trainer.micro_batch_size", raw.micro_batch_size)?,
        max_seq_len: non_zero_u32(ctx, "trainer.max_seq_len", raw.max_seq_len)?,
        minibatches: non_zero_u32(ctx, "trainer.minibatches", raw.minibatches)?,
        threads: u32_incl_zero(ctx, "trainer.threads", raw.threads)?,
        activation_checkpointing: raw.activation_checkpointing,
        advantage: choice(
            ctx,
            "trainer.advantage",
            &raw.advantage,
            &[
                ("group", AdvantageKind::Group),
                ("situational", AdvantageKind::Situational),
            ],
        )?,
        normalize_advantage_std: raw.normalize_advantage_std,
        gamma: number(ctx, "trainer.gamma", raw.gamma, "a number in (0, 1]", |v| {
            v > 0.0 && v <= 1.0
        })?,
        only_keep_outcome: raw.only_keep_outcome,
        pad_situations: raw.pad_situations,
        loss_aggregation: choice(
            ctx,
            "trainer.loss_aggregation",
            &raw.loss_aggregation,
            &[
                ("token_mean", LossAggregation::TokenMean),
                ("sequence_mean", LossAggregation::SequenceMean),
                ("rollout_normalized", LossAggregation::RolloutNormalized),
            ],
        )?,
        tis_level: choice(
            ctx,
            "trainer.tis_level",
            &raw.tis_level,
            &[("token", TisLevel::Token), ("sequence", TisLevel::Sequence)],
        )?,
        tis_mode: choice(
            ctx,
            "trainer.tis_mode",
            &raw.tis_mode,
            &[("truncate", TisMode::Truncate), ("mask", TisMode::Mask)],
        )?,
        is_cap: number(ctx, "trainer.is_cap", raw.is_cap, "a number > 0", |v| {
            v > 0.0
        })?,
        oversized_text: choice(
            ctx,
            "trainer.oversized_text",
            &raw.oversized_text,
            &[
                ("split", OversizedText::Split),
                ("reject", OversizedText::Reject),
            ],
        )?,
    })
}

fn validate_data(raw: RawData, ctx: &Ctx<'_>) -> Result<DataConfig, ConfigError> {
    let mut datasets: Vec<DatasetSpec> = Vec::with_capacity(raw.datasets.len());
    for (i, spec) in raw.datasets.iter().enumerate() {
        let key = format!("data.datasets[{i}]");
        let parsed: DatasetSpec = spec.parse().map_err(|m: String| ctx.value(&key, m))?;
        if datasets.contains(&parsed) {
            return Err(ctx.value(&key, format!("`{spec}` is listed twice")));
        }
        datasets.push(parsed);
    }
    let mut domains = std::collections::BTreeMap::new();
    for (name, d) in raw.domains {
        let key = format!("data.domains.{name}");
        if !datasets.iter().any(|spec| spec.domain == name) {
            let known: Vec<&str> = datasets.iter().map(|spec| spec.domain.as_str()).collect();
            return Err(ctx.value(
                &key,
                format!(
                    "no dataset belongs to domain `{name}`; the datasets' domains are: {}",
                    known.join(", ")
                ),
            ));
        }
        if let Some(task) = &d.task {
            let ok = !task.is_empty()
                && task
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
            if !ok {
                return Err(ctx.value(
                    &format!("{key}.task"),
                    format!("expected a task name of [A-Za-z0-9_.-], got `{task}`"),
                ));
            }
        }
        domains.insert(
            name,
            DomainConfig {
                system_prompt: d.system_prompt,
                task: d.task,
            },
        );
    }
    Ok(DataConfig {
        datasets,
        data_dir: PathBuf::from(raw.data_dir),
        adaptive_mix: raw.adaptive_mix,
        domain_options: domains,
        on_bad_line: choice(
            ctx,
            "data.on_bad_line",
            &raw.on_bad_line,
            &[("skip", BadLinePolicy::Skip), ("fail", BadLinePolicy::Fail)],
        )?,
    })
}

fn validate_rollout(
    raw: RawRollout,
    data: &DataConfig,
    ctx: &Ctx<'_>,
) -> Result<RolloutConfig, ConfigError> {
    let group_size = non_zero_u32(ctx, "rollout.group_size", raw.group_size)?;
    let groups_per_step = non_zero_u32(ctx, "rollout.groups_per_step", raw.groups_per_step)?;
    let max_version_lag = u64_incl_zero(ctx, "rollout.max_version_lag", raw.max_version_lag)?;
    let staleness_threshold = number(
        ctx,
        "rollout.staleness_threshold",
        raw.staleness_threshold,
        "a number ≥ 0",
        |v| v >= 0.0,
    )?;
    if staleness_threshold > crate::knobs::MAX_STALENESS_THRESHOLD {
        return Err(ctx.value(
            "rollout.staleness_threshold",
            format!(
                "expected a number ≤ {}, got {staleness_threshold}",
                crate::knobs::MAX_STALENESS_THRESHOLD
            ),
        ));
    }
    let weight_update_mode = WeightUpdateMode::from_str(&raw.weight_update_mode)
        .map_err(|m| ctx.value("rollout.weight_update_mode", m))?;
    let admission =
        AdmissionMode::from_str(&raw.admission).map_err(|m| ctx.value("rollout.admission", m))?;
    let trigger = u32_incl_zero(
        ctx,
        "rollout.tail_batch_trigger_size",
        raw.tail_batch_trigger_size,
    )?;
    let max_concurrent = u32_incl_zero(
        ctx,
        "rollout.max_concurrent_rollouts",
        raw.max_concurrent_rollouts,
    )?;
    // 0 means "no cap beyond admission": the most rollouts admission can ever have in flight.
    let admission_bound = u64::from(groups_per_step.get())
        .saturating_mul(max_version_lag.saturating_add(1))
        .saturating_mul(u64::from(group_size.get()));
    let max_concurrent_rollouts = if max_concurrent == 0 {
        u32::try_from(admission_bound).unwrap_or(u32::MAX)
    } else {
        max_concurrent
    };
    let domains = data.domains();
    for (domain, &w) in &raw.domain_mix {
        let key = format!("rollout.domain_mix.{domain}");
        if !domains.is_empty() && !domains.contains(domain) {
            return Err(ctx.value(
                &key,
                format!(
                    "unknown domain; data.datasets declares: {}",
                    domains.join(", ")
                ),
            ));
        }
        number(ctx, &key, w, "a weight ≥ 0", |v| v >= 0.0)?;
    }
    if raw.domain_mix.len() > crate::knobs::MAX_DOMAINS {
        return Err(ctx.value(
            "rollout.domain_mix",
            format!(
                "expected at most {} domains, got {}",
                crate::knobs::MAX_DOMAINS,
                raw.domain_mix.len()
            ),
        ));
    }
    if !raw.domain_mix.is_empty() && raw.domain_mix.values().sum::<f64>() <= 0.0 {
        return Err(ctx.value(
            "rollout.domain_mix",
            "expected at least one weight > 0, all are 0",
        ));
    }
    let knobs = Knobs {
        staleness_threshold,
        max_version_lag,
        admission,
        enable_partial_rollout: raw.enable_partial_rollout,
        tail_batch_candidate_steps: u32_incl_zero(
            ctx,
            "rollout.tail_batch_candidate_steps",
            raw.tail_batch_candidate_steps,
        )?,
        tail_batch_trigger_size: if trigger == 0 {
            groups_per_step.get()
        } else {
            trigger
        },
        weight_update_mode,
        domain_mix: raw.domain_mix,
        max_concurrent_rollouts,
        paused: raw.paused,
    };
    Ok(RolloutConfig {
        group_size,
        groups_per_step,
        max_turns: non_zero_u32(ctx, "rollout.max_turns", raw.max_turns)?,
        max_new_tokens: non_zero_u32(ctx, "rollout.max_new_tokens", raw.max_new_tokens)?,
        temperature: number(
            ctx,
            "rollout.temperature",
            raw.temperature,
            "a number ≥ 0",
            |v| v >= 0.0,
        )?,
        top_p: number(ctx, "rollout.top_p", raw.top_p, "a number in (0, 1]", |v| {
            v > 0.0 && v <= 1.0
        })?,
        top_k: u32_incl_zero(ctx, "rollout.top_k", raw.top_k)?,
        env_workers: non_zero_u32(ctx, "rollout.env_workers", raw.env_workers)?,
        env_calls_per_worker: non_zero_u32(
            ctx,
            "rollout.env_calls_per_worker",
            raw.env_calls_per_worker,
        )?,
        knobs,
    })
}

fn validate_replay(
    raw: RawReplay,
    run: &RunConfig,
    ctx: &Ctx<'_>,
) -> Result<ReplayConfig, ConfigError> {
    let path = match raw.path {
        Some(p) if p.trim().is_empty() => {
            return Err(ctx.value(
                "replay.path",
                "expected a directory path, got an empty string",
            ));
        }
        Some(p) => PathBuf::from(p),
        None => run.output_dir.join("replay"),
    };
    Ok(ReplayConfig {
        path,
        expired: choice(
            ctx,
            "replay.expired",
            &raw.expired,
            &[
                ("regenerate", ExpiredPolicy::Regenerate),
                ("drop", ExpiredPolicy::Drop),
            ],
        )?,
        filter_zero_advantage: raw.filter_zero_advantage,
    })
}

fn validate_admin(raw: RawAdmin, ctx: &Ctx<'_>) -> Result<AdminConfig, ConfigError> {
    let listen = socket(ctx, "admin.listen", &raw.listen)?;
    let (token, via_env) = match raw.token {
        Some(t) => (Some(t), false),
        None => ((ctx.env)(ADMIN_TOKEN_ENV), true),
    };
    let token = match token {
        // `<redacted>` is what `sluice check` prints in the token's place: a config saved from
        // that output would otherwise run with the placeholder as its token.
        Some(t) if t.trim().is_empty() || t == REDACTED => {
            let e = ctx.value(
                "admin.token",
                if t == REDACTED {
                    "`<redacted>` is the placeholder `sluice check` prints; set the real token"
                } else {
                    "expected a non-empty token, got an empty string"
                },
            );
            return Err(if via_env {
                e.via(format!("${ADMIN_TOKEN_ENV}"))
            } else {
                e
            });
        }
        Some(t) => Some(Secret::new(t)),
        None => None,
    };
    if token.is_none() && !listen.ip().is_loopback() {
        return Err(ctx.value(
            "admin.listen",
            format!(
                "{listen} is not a loopback address; set admin.token or ${ADMIN_TOKEN_ENV} to expose the admin API"
            ),
        ));
    }
    Ok(AdminConfig { listen, token })
}
