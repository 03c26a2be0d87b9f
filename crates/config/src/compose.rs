//! Phase one's error mapping (serde → one line naming the key) and the composition of phase two:
//! each section's own checks, in the order their cross-section defaults need, then the rules
//! between sections.

use sluice_core::config::check::{Ctx, role_device, socket};
use sluice_core::config::{ConfigError, ConfigErrorKind, closest};
use sluice_data::config::validate_data;
use sluice_engine::config::{EngineBackend, validate_engine};
use sluice_model::section::validate_model;
use sluice_replay::config::validate_replay;
use sluice_trainer::config::{default_minibatches, validate_trainer};

use crate::raw::RawConfig;
use crate::sections::validate::*;
use crate::sections::{MetricsConfig, NodeRole};
use crate::typed::Config;

pub(crate) mod bounds;
mod relations;

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
        let node = node.map(|n| validate_node(n, ctx)).transpose()?;
        let head = node.as_ref().is_some_and(|n| n.role == NodeRole::Head);
        let run = validate_run(run, ctx)?;
        let model = validate_model(model, &run.output_dir, ctx)?;
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
        let engine = validate_engine(engine, run.seed, head, engine_device, ctx)?;
        let minibatches_unset = trainer.minibatches.is_none();
        let mut trainer = validate_trainer(
            trainer,
            engine.backend == EngineBackend::Simulated,
            trainer_device,
            ctx,
        )?;
        let data = validate_data(data, ctx)?;
        let rollout = validate_rollout(rollout, &data.domains(), ctx)?;
        if minibatches_unset {
            trainer.minibatches = default_minibatches(trainer.loss, rollout.groups_per_step);
        }
        let replay = validate_replay(replay, &run.output_dir, ctx)?;
        let metrics = MetricsConfig {
            enabled: metrics.enabled,
            listen: socket(ctx, "metrics.listen", &metrics.listen)?,
            tensorboard: metrics.tensorboard,
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
            warmup: validate_warmup(warmup, ctx)?,
            eval: validate_eval(eval, eval_device, ctx)?,
            supervision: validate_supervision(supervision, ctx)?,
            faults: validate_faults(faults, ctx)?,
            node,
        };
        relations::check(&config, ctx)?;
        Ok(config)
    }
}
