//! `[data.domains.<domain>.rubric.reward_model]`: the `reward_model` reward function's model, a
//! Hugging Face sequence classifier with one label (a Bradley–Terry reward model) that scores
//! each rollout's conversation. Raw (serde, defaults) → [`validate_reward_model`] →
//! [`RewardModelConfig`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize, Serializer};
use sluice_core::config::check::{Ctx, device, non_zero_u32};
use sluice_core::config::{ConfigError, Device};

/// The reward function's name in a rubric's `weights`.
pub const REWARD_MODEL_FN: &str = "reward_model";

/// `[data.domains.<domain>.rubric.reward_model]` as serde reads it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRewardModel {
    /// The model directory.
    pub path: Option<String>,
    /// Where it runs: `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Longest conversation scored, tokens (of the reward model's tokenizer).
    pub max_tokens: i64,
    /// Map the score through the logistic function, to (0, 1).
    pub sigmoid: bool,
}

impl Default for RawRewardModel {
    fn default() -> Self {
        Self {
            path: None,
            device: "cpu".into(),
            max_tokens: 8192,
            sigmoid: false,
        }
    }
}

/// `[data.domains.<domain>.rubric.reward_model]`, validated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RewardModelConfig {
    /// The model directory (`config.json` naming a `*ForSequenceClassification`, the weights,
    /// `tokenizer.json` and a chat template).
    pub path: String,
    /// Where it runs.
    #[serde(serialize_with = "display")]
    pub device: Device,
    /// Longest conversation scored, tokens: a longer one fails its rollout's scoring.
    pub max_tokens: u32,
    /// Whether the score is mapped to (0, 1) by the logistic function.
    pub sigmoid: bool,
}

fn display<S: Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(d)
}

/// Phase two of a rubric's `reward_model` table (`key` is `data.domains.<d>.rubric.reward_model`);
/// the rubric's `weights` must name `reward_model`.
pub fn validate_reward_model(
    key: &str,
    weights: &BTreeMap<String, f64>,
    raw: RawRewardModel,
    ctx: &Ctx<'_>,
) -> Result<RewardModelConfig, ConfigError> {
    if !weights.contains_key(REWARD_MODEL_FN) {
        return Err(ctx.value(
            key,
            "the table is for the `reward_model` reward function, which `weights` does not name (add `reward_model = 1.0` to `weights`)",
        ));
    }
    let path = raw.path.filter(|p| !p.trim().is_empty()).ok_or_else(|| {
        ctx.value(
            &format!("{key}.path"),
            "expected the reward model's directory (a Hugging Face sequence classifier with one label)",
        )
    })?;
    Ok(RewardModelConfig {
        path,
        device: device(ctx, &format!("{key}.device"), &raw.device)?,
        max_tokens: non_zero_u32(ctx, &format!("{key}.max_tokens"), raw.max_tokens)?.get(),
        sigmoid: raw.sigmoid,
    })
}
