//! Supervised warm-start: a few cross-entropy steps on a task's reference replies, so a small
//! random model starts RL able to answer sometimes (RL needs some reward to climb from). It stops
//! as soon as a probe on *training* problems reaches the target accuracy, so the held-out set
//! is never used to decide anything.

use std::sync::Arc;

use sluice_core::DataSample;
use sluice_env::{EnvError, Next, Task, TokenEnvLimits};
use sluice_trainer::native::{ModelSnapshot, NativeTrainer, SupervisedExample};

use super::eval::Evaluator;
use super::renderer::ModelRenderer;

/// How long to warm up.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupSettings {
    /// Most supervised steps.
    pub max_steps: u64,
    /// Demonstrations per step.
    pub batch_size: usize,
    /// Stop once the probe accuracy reaches this.
    pub target_accuracy: f64,
    /// Probe every this many steps.
    pub check_every: u64,
}

/// One demonstration: prompt and reference completion, as token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Demonstration {
    /// Rendered prompt (system prompt, question, generation prompt).
    pub prompt: Vec<u32>,
    /// Reference reply and the end-of-turn id.
    pub completion: Vec<u32>,
}

/// Progress after a probe.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupProgress {
    /// Supervised steps taken.
    pub step: u64,
    /// Mean cross-entropy of the last step.
    pub loss: f64,
    /// Probe accuracy at this step.
    pub accuracy: f64,
}

/// How the warm-start ended.
#[derive(Debug, Clone)]
pub struct WarmupReport {
    /// Steps taken.
    pub steps: u64,
    /// Last probe accuracy.
    pub probe_accuracy: f64,
    /// Each probe.
    pub history: Vec<WarmupProgress>,
    /// The warmed-up weights.
    pub weights: Arc<ModelSnapshot>,
}

/// Renders each sample's first prompt and reference reply; samples without a reference reply
/// are skipped. Fails when none has one.
pub async fn demonstrations(
    task: &Task,
    samples: &[DataSample],
    renderer: &Arc<ModelRenderer>,
    limits: &TokenEnvLimits,
) -> Result<Vec<Demonstration>, EnvError> {
    let mut out = Vec::with_capacity(samples.len());
    for sample in samples {
        let Some(reply) = task.reference_reply(sample) else {
            continue;
        };
        let mut env = task.token_env(sample, renderer.clone(), limits.clone())?;
        let next = env.start().await;
        env.close().await;
        let Next::Generate(prompt) = next else {
            continue;
        };
        out.push(Demonstration {
            prompt: prompt.prompt_token_ids,
            completion: renderer.encode_reply(&reply)?,
        });
    }
    if out.is_empty() {
        return Err(EnvError::Config(format!(
            "task `{}` declares no reference replies: it cannot be warm-started",
            task.name()
        )));
    }
    Ok(out)
}

/// Runs supervised steps on `demos` (cycling through them in order; shuffle beforehand) until the
/// probe reaches the target or the step budget is spent. Steps run on the blocking pool; the
/// probe on its own engine. Returns the trainer for the caller to keep or drop.
pub async fn warm_start(
    mut trainer: NativeTrainer,
    demos: Arc<Vec<Demonstration>>,
    probe: &mut Evaluator,
    settings: &WarmupSettings,
    mut on_progress: impl FnMut(&WarmupProgress),
) -> Result<(NativeTrainer, WarmupReport), String> {
    let mut history = Vec::new();
    let mut cursor = 0usize;
    let mut steps = 0u64;
    let mut accuracy = 0.0;
    let batch = settings.batch_size.clamp(1, demos.len());
    while steps < settings.max_steps {
        let start = cursor;
        cursor = (cursor + batch) % demos.len();
        let data = Arc::clone(&demos);
        let (t, loss) = tokio::task::spawn_blocking(move || {
            let examples: Vec<SupervisedExample<'_>> = (0..batch)
                .map(|i| &data[(start + i) % data.len()])
                .map(|d| SupervisedExample {
                    prompt: &d.prompt,
                    completion: &d.completion,
                })
                .collect();
            let loss = trainer
                .supervised_step(&examples)
                .map(|(stats, _)| stats.loss.loss);
            (trainer, loss)
        })
        .await
        .map_err(|e| format!("warm-up step panicked: {e}"))?;
        trainer = t;
        let loss = loss.map_err(|e| format!("warm-up step {}: {e}", steps + 1))?;
        steps += 1;
        if steps.is_multiple_of(settings.check_every.max(1)) || steps == settings.max_steps {
            let eval = probe
                .evaluate(Arc::clone(trainer.published()))
                .await
                .map_err(|e| format!("warm-up probe: {e}"))?;
            accuracy = eval.report.accuracy.unwrap_or(0.0);
            let p = WarmupProgress {
                step: steps,
                loss,
                accuracy,
            };
            on_progress(&p);
            history.push(p);
            if accuracy >= settings.target_accuracy {
                break;
            }
        }
    }
    let weights = Arc::clone(trainer.published());
    Ok((
        trainer,
        WarmupReport {
            steps,
            probe_accuracy: accuracy,
            history,
            weights,
        },
    ))
}
