//! Phase two of the whole file: [`Config`], one validated section per field, and what only the
//! whole file knows (budgets across sections, the advisories).
//!
//! `Serialize` writes the resolved config back in the file's own shape: `sluice check` prints it,
//! and what it prints loads again to the same config.

use std::num::NonZeroU32;

use serde::Serialize;
use sluice_core::WeightUpdateMode;
use sluice_data::config::DataConfig;
use sluice_engine::config::EngineConfig;
use sluice_model::section::ModelSection;
use sluice_replay::config::ReplayConfig;
use sluice_trainer::config::{AdvantageKind, DECOUPLED_MINIBATCHES, LossKind, TrainerConfig};

use crate::sections::*;

/// The GSPO clip range below which asynchronous samples (η > 0) are warned about: at 0.01 on
/// SmolLM2 with η = 1 a fifth of the texts were clipped a step and the run learned
/// (docs/trainer.md).
const GSPO_OFF_POLICY_CLIP: f64 = 0.01;

/// The validated config.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Config {
    /// `[run]`
    pub run: RunConfig,
    /// `[model]`
    pub model: ModelSection,
    /// `[engine]`
    pub engine: EngineConfig,
    /// `[trainer]`
    pub trainer: TrainerConfig,
    /// `[rollout]`
    pub rollout: RolloutConfig,
    /// `[data]`
    pub data: DataConfig,
    /// `[replay]`
    pub replay: ReplayConfig,
    /// `[metrics]`
    pub metrics: MetricsConfig,
    /// `[admin]`
    pub admin: AdminConfig,
    /// `[warmup]`
    pub warmup: WarmupConfig,
    /// `[eval]`
    pub eval: EvalConfig,
    /// `[supervision]`
    pub supervision: SupervisionConfig,
    /// `[faults]`
    pub faults: FaultsConfig,
    /// `[node]`: this process's role across machines (`None`: the whole pipeline here).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeConfig>,
}

impl Config {
    /// The largest turn budget of any domain: what a prompt must leave room for in the context.
    pub fn largest_turn_tokens(&self) -> NonZeroU32 {
        self.data
            .domain_options
            .values()
            .filter_map(|d| d.max_new_tokens)
            .fold(self.rollout.max_new_tokens, NonZeroU32::max)
    }

    /// Whether the largest turn budget leaves room for a prompt in a `context`-token window; the
    /// refusal names the keys (every episode would otherwise end `prompt_too_long`).
    pub fn check_turn_budget(&self, context: usize) -> Result<(), String> {
        let turn = self.largest_turn_tokens().get() as usize;
        if turn < context {
            return Ok(());
        }
        Err(format!(
            "rollout.max_new_tokens: a turn budget of {turn} tokens (the largest of rollout.max_new_tokens and the domains' max_new_tokens) leaves no room for a prompt in the model's {context}-token context (max_position_embeddings): every episode would end prompt_too_long; set it below {context}"
        ))
    }

    /// The longest prompt a run sends for a model with a `context`-token window: the largest turn
    /// budget (`rollout.max_new_tokens`, or a domain's own when larger) must still fit, and
    /// `rollout.max_prompt_tokens`, when set, lowers the bound further (longer prompts end the
    /// episode as `PromptTooLong`).
    pub fn max_prompt_tokens(&self, context: usize) -> usize {
        let fits = context.saturating_sub(self.largest_turn_tokens().get() as usize);
        self.rollout
            .max_prompt_tokens
            .map_or(fits, |m| fits.min(m.get() as usize))
    }

    /// The domains of a simulated run when `data.datasets` names none: those with a
    /// `[engine.simulated.lengths.<domain>]`, else those of `rollout.domain_mix` (what
    /// `SimSource::from_config` falls back to).
    pub fn simulated_domains(&self) -> Vec<String> {
        let lengths: Vec<String> = self
            .engine
            .simulated
            .lengths
            .keys()
            .filter(|k| *k != "default")
            .cloned()
            .collect();
        if lengths.is_empty() {
            self.rollout.knobs.domain_mix.keys().cloned().collect()
        } else {
            lengths
        }
    }
}

impl Config {
    /// The resolved config as TOML, in the file's own shape (secrets redacted).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// Settings that are valid but unsound, with why and what to set instead; `sluice check`
    /// prints them and `sluice run` logs them as warnings.
    pub fn advisories(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let eta = self.rollout.knobs.max_version_lag;
        if self.trainer.loss == LossKind::DecoupledPpo
            && self.trainer.minibatches.get() == 1
            && eta > 0
        {
            notes.push(format!(
                "trainer.minibatches = 1 with loss = \"decoupled_ppo\" and rollout.max_version_lag = {eta}: with one update per step the proximal policy is the current one, nothing is clipped and no trust region bounds {eta} versions of drift (the η = 4 ablation in docs/pipeline.md); leave trainer.minibatches unset ({} updates) or use loss = \"ppo\"",
                DECOUPLED_MINIBATCHES
            ));
        }
        let (lo, hi) = (self.trainer.clip_low, self.trainer.clip_high);
        if self.trainer.loss == LossKind::Gspo && eta > 0 && lo.max(hi) < GSPO_OFF_POLICY_CLIP {
            notes.push(format!(
                "trainer.loss = \"gspo\" with clip_low = {lo}, clip_high = {hi} and rollout.max_version_lag = {eta}: a text sampled by weights a version or more behind has a geometric-mean ratio beyond that range, so many texts are clipped whole (49 % a step on SmolLM2 at the paper's 3e-4 / 4e-4, whose held-out accuracy went 7.8 → 9.4 % in 20 steps where PPO's went to 21.9 %; docs/trainer.md); widen both to {GSPO_OFF_POLICY_CLIP} or more, or set rollout.max_version_lag = 0"
            ));
        }
        if self.rollout.group_size.get() == 1 && self.trainer.advantage != AdvantageKind::Gae {
            notes.push(format!(
                "rollout.group_size = 1 with trainer.advantage = \"{}\": every advantage is relative to its group's other rollouts, so with one a group every advantage is 0 and the policy gradient is nothing (the zero-advantage filter drops every group); sample several rollouts a prompt (8 or 16 is usual)",
                self.trainer.advantage
            ));
        }
        if self.trainer.advantage == AdvantageKind::Gae && self.replay.filter_zero_advantage {
            notes.push("trainer.advantage = \"gae\" with replay.filter_zero_advantage = true: the replay store drops every group whose rollouts got equal rewards, though under gae their tokens have advantages (the critic's values differ token by token) and they teach the critic; set replay.filter_zero_advantage = false".to_owned());
        }
        if self.trainer.dual_clip > 0.0 && self.trainer.loss == LossKind::Tis {
            notes.push(format!(
                "trainer.dual_clip = {} with loss = \"tis\": the dual clip bounds a clipped ratio's term, and tis clips none (its weights are capped by trainer.is_cap), so it changes nothing",
                self.trainer.dual_clip
            ));
        }
        let lag = self.engine.prefix_cache_version_lag;
        if lag > 0 && !self.engine.prefix_caching {
            notes.push(format!(
                "engine.prefix_cache_version_lag = {lag} with engine.prefix_caching = false: nothing is cached, so the lag changes nothing"
            ));
        } else if lag > 0 && self.rollout.knobs.weight_update_mode != WeightUpdateMode::InFlight {
            notes.push(format!(
                "engine.prefix_cache_version_lag = {lag} with rollout.weight_update_mode = \"{}\": only in_flight updates let a request's keys and values span versions, so older blocks are reused only while that mode is set (a runtime knob)",
                self.rollout.knobs.weight_update_mode.as_str()
            ));
        }
        notes
    }
}
