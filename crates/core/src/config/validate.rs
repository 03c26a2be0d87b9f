//! Phase one's error mapping and phase two's checks: raw values → typed config.

use std::num::NonZeroU64;
use std::path::PathBuf;

use super::ADMIN_TOKEN_ENV;
use super::check::{Ctx, choice, device, role_device, socket, u64_incl_zero};
use super::error::{ConfigError, ConfigErrorKind, closest};
use super::raw::*;
use super::typed::*;

pub(crate) mod bounds;
mod domain;
mod engine;
mod node;
mod quickstart;
mod relations;
mod rollout;
mod supervision;
mod trainer;

use engine::validate_engine;
use rollout::{validate_data, validate_rollout};
pub(crate) use trainer::DECOUPLED_MINIBATCHES;
use trainer::{default_minibatches, validate_trainer};

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
            node,
        } = self;
        let node = node.map(|n| node::validate_node(n, ctx)).transpose()?;
        let head = node.as_ref().is_some_and(|n| n.role == NodeRole::Head);
        let run = validate_run(run, ctx)?;
        let model = validate_model(model, &run, ctx)?;
        // Each role runs on its own device, by default the model's (so a config without these
        // keys behaves as before); the evaluator follows the engine.
        let engine_device =
            role_device(ctx, "engine.device", engine.device.as_deref(), model.device)?;
        let trainer_device = role_device(
            ctx,
            "trainer.device",
            trainer.device.as_deref(),
            model.device,
        )?;
        let eval_device = role_device(ctx, "eval.device", eval.device.as_deref(), engine_device)?;
        let engine = validate_engine(engine, &run, head, engine_device, ctx)?;
        let minibatches_unset = trainer.minibatches.is_none();
        let mut trainer = validate_trainer(trainer, &engine, trainer_device, ctx)?;
        let data = validate_data(data, ctx)?;
        let rollout = validate_rollout(rollout, &data, ctx)?;
        if minibatches_unset {
            trainer.minibatches = default_minibatches(trainer.loss, rollout.groups_per_step);
        }
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
            eval: quickstart::validate_eval(eval, eval_device, ctx)?,
            supervision: supervision::validate_supervision(supervision, ctx)?,
            faults: supervision::validate_faults(faults, ctx)?,
            node,
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
        .map(|p| choice::<ModelPreset>(ctx, "model.init_preset", p))
        .transpose()?;
    let dtype: DType = choice(ctx, "model.dtype", &raw.dtype)?;
    let device = device(ctx, "model.device", &raw.device)?;
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
    for name in raw.chat_template_kwargs.keys() {
        let key = format!("model.chat_template_kwargs.{name}");
        let identifier = name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !identifier {
            return Err(ctx.value(
                &key,
                format!(
                    "expected a template variable name of [A-Za-z_][A-Za-z0-9_]*, got `{name}`"
                ),
            ));
        }
    }
    let chat_template = match raw.chat_template {
        Some(p) if p.trim().is_empty() => {
            return Err(ctx.value(
                "model.chat_template",
                "expected the path of a Jinja template file, got an empty string",
            ));
        }
        p => p.map(PathBuf::from),
    };
    Ok(ModelConfig {
        path,
        init_preset,
        dtype,
        device,
        chat_template_kwargs: raw.chat_template_kwargs,
        chat_template,
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
        expired: choice(ctx, "replay.expired", &raw.expired)?,
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
