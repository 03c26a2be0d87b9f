//! `[model]`: the policy checkpoint's section of the run config (not `config.json`, which is
//! [`config`](crate::config)), owned here with the built-in [`ModelPreset`]s it may create the
//! directory from. Raw (serde, defaults; [`RawModel`]) → [`validate_model`] → [`ModelSection`];
//! `sluice-config` composes it into the whole file. `DType` and `Device` stay in core: the engine
//! and the trainer read them too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sluice_core::config::check::{Ctx, choice, device};
use sluice_core::config::{ConfigError, DType, Device};

/// `[model]`: the policy checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawModel {
    /// Hugging Face model directory (default `<output_dir>/model`).
    pub path: Option<String>,
    /// Create the directory from a built-in preset when it does not exist (`tiny`, `small`).
    pub init_preset: Option<String>,
    /// `f32`, `bf16` or `f16`.
    pub dtype: String,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Extra variables of the chat template when rollouts are rendered (`enable_thinking`).
    pub chat_template_kwargs: BTreeMap<String, toml::Value>,
    /// A Jinja file that replaces the model's chat template.
    pub chat_template: Option<String>,
}

impl Default for RawModel {
    fn default() -> Self {
        Self {
            path: None,
            init_preset: None,
            dtype: "f32".into(),
            device: "cpu".into(),
            chat_template_kwargs: BTreeMap::new(),
            chat_template: None,
        }
    }
}

/// Built-in model presets that `sluice model init` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelPreset {
    /// A few hundred thousand parameters: tests and the quickstart.
    Tiny,
    /// Roughly 50–100M parameters: benchmarks.
    Small,
    /// The layer shapes of Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP
    /// 4864) with the character tokenizer: memory and speed at a real model's shapes.
    Medium,
}

impl ModelPreset {
    /// Every preset, in size order.
    pub const ALL: [Self; 3] = [Self::Tiny, Self::Small, Self::Medium];

    /// The preset's name in configs and flags.
    pub fn name(self) -> &'static str {
        sluice_core::choice::Choice::name(self)
    }

    /// The preset named `name` (a flag's value); the error lists the names.
    pub fn parse_name(name: &str) -> Result<Self, String> {
        <Self as sluice_core::choice::Choice>::parse(name).map_err(|_| {
            format!(
                "unknown preset `{name}` ({})",
                <Self as sluice_core::choice::Choice>::names().join(", ")
            )
        })
    }
}

sluice_core::impl_choice!(ModelPreset);

/// `[model]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSection {
    /// Hugging Face model directory.
    pub path: PathBuf,
    /// Preset to create the directory from when it is absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_preset: Option<ModelPreset>,
    /// Weight dtype.
    pub dtype: DType,
    /// Device.
    pub device: Device,
    /// Extra chat-template variables for rendering rollouts (`enable_thinking = false`).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub chat_template_kwargs: std::collections::BTreeMap<String, toml::Value>,
    /// A Jinja file that replaces the model's own chat template (`None`: the model's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<PathBuf>,
}

/// Phase two of `[model]`; the default path is `<output_dir>/model` (`run.output_dir`).
pub fn validate_model(
    raw: RawModel,
    output_dir: &Path,
    ctx: &Ctx<'_>,
) -> Result<ModelSection, ConfigError> {
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
        None => output_dir.join("model"),
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
    Ok(ModelSection {
        path,
        init_preset,
        dtype,
        device,
        chat_template_kwargs: raw.chat_template_kwargs,
        chat_template,
    })
}
