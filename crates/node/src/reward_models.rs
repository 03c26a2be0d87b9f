//! The reward models of rubrics' `reward_model` tables, loaded in process
//! ([`sluice_model::RewardModel`]) for the env crate's `reward_model` function: each directory
//! and device once, whatever number of domains name it.
//!
//! Rollouts are scored one call each, on the blocking pool, and a group's finish together: the
//! calls that arrive while a forward runs wait, and the next forward scores all of them at once
//! (run by the first of them to find the model free, up to [`BATCH_TOKENS`]). One forward runs
//! at a time per model: it already spreads over the device's cores.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use sluice_core::Message;
use sluice_core::config::Device;
use sluice_core::metrics::ENV_REWARD_MODEL_BATCH_ROLLOUTS;
use sluice_data::config::RewardModelConfig;
use sluice_env::reward_model::{ConversationScorer, RewardModelLoader};
use sluice_model::RewardModel;

/// Most tokens one forward scores (the conversations waiting beyond it go to the next).
pub const BATCH_TOKENS: usize = 16_384;

/// One loaded reward model and the conversations waiting for its next forward.
struct Loaded {
    model: RewardModel,
    queue: Mutex<Queue>,
    /// Wakes the waiting calls when a forward's scores are in.
    scored: Condvar,
}

/// The conversations of a model waiting for a forward, and the scores not yet taken.
#[derive(Default)]
struct Queue {
    /// Tickets and token ids, in arrival order.
    waiting: Vec<(u64, Vec<u32>)>,
    /// Each scored ticket's score, or why its forward failed.
    done: HashMap<u64, Result<f32, String>>,
    /// Whether a forward is running.
    running: bool,
    next_ticket: u64,
}

impl Loaded {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The score of `tokens`: queued, and scored by the next forward (which this call runs when
    /// it finds none running, for every conversation waiting then).
    fn score(&self, tokens: Vec<u32>) -> Result<f32, String> {
        let mut queue = self.queue();
        let ticket = queue.next_ticket;
        queue.next_ticket += 1;
        queue.waiting.push((ticket, tokens));
        loop {
            if let Some(result) = queue.done.remove(&ticket) {
                return result;
            }
            if queue.running {
                queue = self
                    .scored
                    .wait(queue)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            let batch = take_batch(&mut queue.waiting);
            queue.running = true;
            drop(queue);
            let sequences: Vec<Vec<u32>> = batch.iter().map(|(_, t)| t.clone()).collect();
            metrics::histogram!(ENV_REWARD_MODEL_BATCH_ROLLOUTS).record(batch.len() as f64);
            let scores = catch_unwind(AssertUnwindSafe(|| self.model.score_tokens(&sequences)));
            queue = self.queue();
            queue.running = false;
            for (i, (t, _)) in batch.iter().enumerate() {
                let result = match &scores {
                    Ok(Ok(scores)) => Ok(scores[i]),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("the reward model's forward panicked".to_owned()),
                };
                queue.done.insert(*t, result);
            }
            self.scored.notify_all();
        }
    }
}

/// The waiting conversations one forward takes: the oldest, as many as [`BATCH_TOKENS`] allows
/// (one at least).
fn take_batch(waiting: &mut Vec<(u64, Vec<u32>)>) -> Vec<(u64, Vec<u32>)> {
    let mut tokens = 0;
    let n = waiting
        .iter()
        .take_while(|(_, t)| {
            tokens += t.len();
            tokens <= BATCH_TOKENS
        })
        .count()
        .max(1);
    waiting.drain(..n).collect()
}

/// A loaded model as one rubric's function sees it: its own token bound.
struct Scorer {
    loaded: Arc<Loaded>,
    max_tokens: usize,
}

impl ConversationScorer for Scorer {
    fn score(&self, messages: &[Message]) -> Result<f64, String> {
        let tokens = self
            .loaded
            .model
            .tokens(messages)
            .map_err(|e| e.to_string())?;
        let context = self.loaded.model.config().max_position_embeddings;
        if tokens.len() > context {
            return Err(format!(
                "the conversation is {} tokens of the reward model's tokenizer, more than its context ({context}, max_position_embeddings)",
                tokens.len()
            ));
        }
        if tokens.len() > self.max_tokens {
            return Err(format!(
                "the conversation is {} tokens of the reward model's tokenizer, more than reward_model.max_tokens = {}",
                tokens.len(),
                self.max_tokens
            ));
        }
        self.loaded.score(tokens).map(f64::from)
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
        queue: Mutex::default(),
        scored: Condvar::new(),
    })
}
