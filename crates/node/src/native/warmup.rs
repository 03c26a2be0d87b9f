//! Supervised warm-start: a few cross-entropy steps on tasks' reference replies, so a small
//! random model starts RL able to answer sometimes (RL needs some reward to climb from). A run of
//! several domains warms them up together (their demonstrations interleaved) and each has its own
//! probe and its own target; the warm-up stops as soon as every probe reaches its target. A probe
//! plays whatever problems it is given: a draw of *training* problems (`warmup.probe = "train"`,
//! the held-out sets decide nothing) or the domain's held-out set (`"heldout"`), so RL starts
//! from the same held-out accuracy however the warm-start got there.

use std::sync::Arc;

use sluice_core::DataSample;
use sluice_env::token_env::TurnFinish;
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

/// Every domain's demonstrations as one endless stream: item `i` is the next demonstration of
/// domain `i mod k`, each domain's list starting over once used up. So every warm-up batch holds
/// the domains in equal shares for the whole warm-up; a domain with fewer demonstrations repeats
/// them instead of dropping out of later batches (which left a multi-domain warm-up training on
/// the longest domain alone once the others ran out, and forgetting them).
#[derive(Debug, Clone, PartialEq)]
pub struct DemoStream {
    lists: Vec<Vec<Demonstration>>,
}

impl DemoStream {
    /// The stream over `lists` (one per domain); empty lists are left out.
    pub fn new(lists: Vec<Vec<Demonstration>>) -> Self {
        Self {
            lists: lists.into_iter().filter(|l| !l.is_empty()).collect(),
        }
    }

    /// Demonstrations across every domain (one pass over each list).
    pub fn len(&self) -> usize {
        self.lists.iter().map(Vec::len).sum()
    }

    /// Whether no domain has a demonstration.
    pub fn is_empty(&self) -> bool {
        self.lists.is_empty()
    }

    /// Item `i` of the stream. Panics on an empty stream.
    pub fn get(&self, i: usize) -> &Demonstration {
        let k = self.lists.len();
        let list = &self.lists[i % k];
        &list[(i / k) % list.len()]
    }
}

/// One domain's probe: greedy accuracy on a fixed set of its problems (training or held-out),
/// and the accuracy the warm-up must bring it to.
#[derive(Debug)]
pub struct WarmupProbe {
    /// The domain probed.
    pub domain: String,
    /// Plays the probe's problems.
    pub evaluator: Evaluator,
    /// Stop once this accuracy is reached (by every probe).
    pub target: f64,
}

/// Progress after a probe.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupProgress {
    /// Supervised steps taken.
    pub step: u64,
    /// Mean cross-entropy of the last step.
    pub loss: f64,
    /// Mean probe accuracy over the domains at this step.
    pub accuracy: f64,
    /// Each domain's probe accuracy, in probe order.
    pub domains: Vec<(String, f64)>,
}

/// How the warm-start ended.
#[derive(Debug, Clone)]
pub struct WarmupReport {
    /// Steps taken.
    pub steps: u64,
    /// Last probe accuracy (mean over the domains).
    pub probe_accuracy: f64,
    /// Each domain's last probe accuracy.
    pub domains: Vec<(String, f64)>,
    /// Each probe.
    pub history: Vec<WarmupProgress>,
    /// The warmed-up weights.
    pub weights: Arc<ModelSnapshot>,
}

/// Plays each sample's reference episode through its env and returns one demonstration per
/// turn: the prompt the env rendered at that turn and the reference reply to it. A multi-turn
/// episode (a tool call, then the answer to the tool's result) therefore teaches every turn on
/// the prompt the model will really see. Samples without a reference reply are skipped; fails
/// when none has one.
pub async fn demonstrations(
    task: &Task,
    samples: &[DataSample],
    renderer: &Arc<ModelRenderer>,
    limits: &TokenEnvLimits,
) -> Result<Vec<Demonstration>, EnvError> {
    let mut out = Vec::with_capacity(samples.len());
    for sample in samples {
        let mut env = task.token_env(sample, renderer.clone(), limits.clone())?;
        let mut next = env.start().await;
        let mut turn = 0;
        while let Next::Generate(prompt) = next {
            let Some(reply) = task.reference_reply(sample, turn) else {
                break;
            };
            let completion = renderer.encode_reply(&reply)?;
            next = env.step(&completion, TurnFinish::Stop).await.next;
            out.push(Demonstration {
                prompt: prompt.prompt_token_ids,
                completion,
            });
            turn += 1;
        }
        env.close().await;
    }
    if out.is_empty() {
        return Err(EnvError::Config(format!(
            "task `{}` declares no reference replies: it cannot be warm-started",
            task.name()
        )));
    }
    Ok(out)
}

/// Runs supervised steps on `demos` (cycling through them in order; shuffle or interleave
/// beforehand) until every probe reaches its target or the step budget is spent. Steps run on
/// the blocking pool; the probes on their own engines. Returns the trainer for the caller to keep
/// or drop.
pub async fn warm_start(
    mut trainer: NativeTrainer,
    demos: Arc<DemoStream>,
    probes: &mut [WarmupProbe],
    settings: &WarmupSettings,
    mut on_progress: impl FnMut(&WarmupProgress),
) -> Result<(NativeTrainer, WarmupReport), String> {
    let mut history = Vec::new();
    let mut cursor = 0usize;
    let mut steps = 0u64;
    let mut last = WarmupProgress {
        step: 0,
        loss: f64::NAN,
        accuracy: 0.0,
        domains: Vec::new(),
    };
    if demos.is_empty() {
        return Err("no demonstrations to warm up on".into());
    }
    let batch = settings.batch_size.clamp(1, demos.len());
    while steps < settings.max_steps {
        let start = cursor;
        cursor += batch;
        let data = Arc::clone(&demos);
        let (t, loss) = tokio::task::spawn_blocking(move || {
            let examples: Vec<SupervisedExample<'_>> = (start..start + batch)
                .map(|i| data.get(i))
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
            let mut domains = Vec::with_capacity(probes.len());
            let mut reached = true;
            for probe in probes.iter_mut() {
                let eval = probe
                    .evaluator
                    .evaluate(Arc::clone(trainer.published()))
                    .await
                    .map_err(|e| format!("warm-up probe of `{}`: {e}", probe.domain))?;
                let accuracy = eval.report.accuracy;
                reached &= accuracy >= probe.target;
                domains.push((probe.domain.clone(), accuracy));
            }
            last = WarmupProgress {
                step: steps,
                loss,
                accuracy: domains.iter().map(|d| d.1).sum::<f64>() / domains.len().max(1) as f64,
                domains,
            };
            on_progress(&last);
            history.push(last.clone());
            if reached {
                break;
            }
        }
    }
    let weights = Arc::clone(trainer.published());
    Ok((
        trainer,
        WarmupReport {
            steps,
            probe_accuracy: last.accuracy,
            domains: last.domains,
            history,
            weights,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo(id: u32) -> Demonstration {
        Demonstration {
            prompt: vec![id],
            completion: vec![],
        }
    }

    #[test]
    fn the_stream_keeps_every_domain_in_equal_shares_past_its_end() {
        let stream = DemoStream::new(vec![
            vec![demo(1), demo(2), demo(3)],
            vec![],
            vec![demo(10)],
            vec![demo(20), demo(21)],
        ]);
        assert_eq!(stream.len(), 6);
        let ids: Vec<u32> = (0..12).map(|i| stream.get(i).prompt[0]).collect();
        assert_eq!(ids, [1, 10, 20, 2, 10, 21, 3, 10, 20, 1, 10, 21]);
        assert!(DemoStream::new(vec![vec![]]).is_empty());
    }
}
