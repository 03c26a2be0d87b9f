//! The reward models of rubrics' `reward_model` tables, loaded in process
//! ([`sluice_model::RewardModel`]) for the env crate's `reward_model` function: each directory
//! and device once, whatever number of domains name it, and one forward at a time per model (a
//! forward already spreads over the device's cores; two at once would only contend for them).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use sluice_core::Message;
use sluice_core::config::Device;
use sluice_data::config::RewardModelConfig;
use sluice_env::reward_model::{ConversationScorer, RewardModelLoader};
use sluice_model::RewardModel;

/// One loaded reward model and the bound on what it scores.
struct Loaded {
    model: RewardModel,
    /// Held for each forward.
    busy: Mutex<()>,
}

/// A loaded model as one rubric's function sees it: its own token bound.
struct Scorer {
    loaded: Arc<Loaded>,
    max_tokens: usize,
}

impl ConversationScorer for Scorer {
    fn score(&self, messages: &[Message]) -> Result<f64, String> {
        let model = &self.loaded.model;
        let tokens = model.tokens(messages).map_err(|e| e.to_string())?;
        if tokens.len() > self.max_tokens {
            return Err(format!(
                "the conversation is {} tokens of the reward model's tokenizer, more than reward_model.max_tokens = {}",
                tokens.len(),
                self.max_tokens
            ));
        }
        let _busy = self
            .loaded
            .busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let scores = model.score_tokens(&[tokens]).map_err(|e| e.to_string())?;
        Ok(f64::from(scores[0]))
    }
}

/// A scorer for a command that only checks the config: it never scores.
struct Checked;

impl ConversationScorer for Checked {
    fn score(&self, _: &[Message]) -> Result<f64, String> {
        Err("the reward model was only checked, not loaded".into())
    }
}

/// The loader of a run: each `(path, device)` loaded on first use and shared after.
pub fn in_process() -> Box<RewardModelLoader> {
    let loaded: Mutex<HashMap<(PathBuf, String), Arc<Loaded>>> = Mutex::default();
    Box::new(move |config: &RewardModelConfig| {
        let path = PathBuf::from(&config.path);
        let key = (path.clone(), config.device.to_string());
        let mut cache = loaded.lock().unwrap_or_else(PoisonError::into_inner);
        let shared = match cache.get(&key) {
            Some(l) => Arc::clone(l),
            None => {
                let l = Arc::new(load(&path, config.device)?);
                cache.insert(key, Arc::clone(&l));
                l
            }
        };
        Ok(Arc::new(Scorer {
            loaded: shared,
            max_tokens: config.max_tokens as usize,
        }) as Arc<dyn ConversationScorer>)
    })
}

/// The loader of `sluice check` and `sluice data`: each model checked as it would load (its
/// config, the weights' headers, tokenizer and chat template), no weights read.
pub fn checked() -> Box<RewardModelLoader> {
    Box::new(|config: &RewardModelConfig| {
        let path = PathBuf::from(&config.path);
        RewardModel::check(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Arc::new(Checked) as Arc<dyn ConversationScorer>)
    })
}

/// `trainer.critic_path`, when set, checked as the first RL step will load it (its config and
/// headers, no weights), and its vocabulary against the policy's when known (`policy_vocab`):
/// a run finds a bad critic before its warm-up, `sluice check` before anything.
pub fn check_critic(
    config: &sluice_config::Config,
    policy_vocab: Option<usize>,
) -> Result<(), String> {
    let Some(path) = &config.trainer.critic_path else {
        return Ok(());
    };
    let critic = sluice_model::reward::check_classifier(std::path::Path::new(path))
        .map_err(|e| format!("trainer.critic_path: {e}"))?;
    if let Some(vocab_size) = policy_vocab
        && critic.vocab_size != vocab_size
    {
        return Err(format!(
            "trainer.critic_path: {path} has a vocabulary of {} tokens, the policy {vocab_size}: the critic reads the policy's tokens, so it must share its tokenizer",
            critic.vocab_size
        ));
    }
    Ok(())
}

fn load(path: &std::path::Path, device: Device) -> Result<Loaded, String> {
    let device = sluice_model::device(device).map_err(|e| e.to_string())?;
    let started = std::time::Instant::now();
    let model = RewardModel::load(path, &device).map_err(|e| format!("{}: {e}", path.display()))?;
    tracing::info!(
        dir = %path.display(),
        layers = model.config().num_layers,
        seconds = started.elapsed().as_secs_f64(),
        "reward model loaded"
    );
    Ok(Loaded {
        model,
        busy: Mutex::new(()),
    })
}
