//! The KL penalty in the reward within a step ([`crate::kl_reward`] has the arithmetic): the
//! reference's log-probs at every loss slot of the step's shares before anything updates, each
//! token's `k_t = log π_behaviour − log π_ref`, and the penalty applied where the advantage is
//! formed.

use std::collections::HashMap;

use sluice_core::RolloutGroup;
use sluice_model::ForwardOptions;

use super::NativeTrainer;
use crate::advantage::{AdvantageBatch, AdvantageConfig, compute_advantages};
use crate::batcher::Packing;
use crate::error::TrainerError;
use crate::kl_reward::{KlRewardStep, StepKl};
use crate::report::StepStats;
use crate::steps::{rollouts, slot_logprobs, slot_places};

impl NativeTrainer {
    /// With `trainer.kl_in_reward` (else nothing): every packed token's KL estimate, and the
    /// penalty `−β·k_t` applied. Under `advantage = "gae"` the penalties are returned, per text
    /// and token, for GAE to take as rewards; under any other advantage each rollout's reward
    /// becomes `R − β·Σ k_t`, the same groups' advantages are computed again from those, and
    /// they are written into `packings`' micro-batches.
    pub(super) fn kl_reward_part<'a>(
        &self,
        groups: &'a [RolloutGroup],
        adv: &mut AdvantageBatch<'a>,
        ranges: &[std::ops::Range<usize>],
        packings: &mut [Packing],
        stats: &mut StepStats,
    ) -> Result<Option<Vec<Vec<f64>>>, TrainerError> {
        let Some(controller) = self.kl_controller else {
            return Ok(None);
        };
        let mut clock = self.part_clock();
        let estimator = controller.estimator();
        let reference = self.reference.as_ref().ok_or_else(|| {
            TrainerError::Input("trainer.kl_in_reward without a reference model".into())
        })?;
        let options = ForwardOptions {
            logits_chunk_rows: self.config.logits_chunk_rows,
            temperature: self.config.temperature,
            kept_logits_bytes: 0,
        };
        // Each text's estimates, token by token; `None` for a text no slot scored (one the
        // packing left out, which trains nothing).
        let mut k: Vec<Option<Vec<f64>>> = vec![None; adv.texts.len()];
        let mut places = Vec::with_capacity(packings.len());
        for (packing, range) in packings.iter().zip(ranges) {
            let at = slot_places(packing, &adv.texts[range.clone()], range.start)?;
            let scored = self.each_micro_batch(&packing.micro_batches, |mb| {
                slot_logprobs(reference, mb, options, "reference log-probs")
            })?;
            for ((mb, at), lp) in packing.micro_batches.iter().zip(&at).zip(scored) {
                for ((&slot, &(text, c)), r) in mb.loss_slots().iter().zip(at).zip(lp) {
                    let tokens = adv.texts[text].text.completion_tokens();
                    let ks = k[text].get_or_insert_with(|| vec![0.0; tokens]);
                    ks[c] = estimator.at(f64::from(mb.behaviour[slot]) - f64::from(r));
                }
            }
            places.push(at);
        }
        let coef = controller.coef();
        let mut step = StepKl::default();
        let mut sums: HashMap<(usize, usize), f64> = HashMap::new();
        for rollout in rollouts(&adv.texts) {
            let ks: Vec<f64> = rollout
                .clone()
                .flat_map(|i| k[i].iter().flatten().copied())
                .collect();
            step.add(&ks);
            let t = &adv.texts[rollout.start];
            sums.insert((t.group, t.rollout), ks.iter().sum());
        }
        stats.kl_reward = Some(KlRewardStep { coef, kl: step });
        if self.config.critic.is_some() {
            stats.parts.scoring += clock.lap()?;
            let penalties = adv
                .texts
                .iter()
                .zip(k)
                .map(|(t, ks)| match ks {
                    Some(ks) => ks.iter().map(|x| -coef * x).collect(),
                    None => vec![0.0; t.text.completion_tokens()],
                })
                .collect();
            return Ok(Some(penalties));
        }
        // The kept groups again, their rollouts' rewards penalised, every one kept (the filter
        // chose them on the rewards themselves).
        let mut kept: Vec<usize> = adv.texts.iter().map(|t| t.group).collect();
        kept.dedup();
        let mut penalised: Vec<RolloutGroup> = kept.iter().map(|&g| groups[g].clone()).collect();
        for (at, group) in kept.iter().zip(&mut penalised) {
            for (r, rollout) in group.rollouts.iter_mut().enumerate() {
                if let Some(sum) = sums.get(&(*at, r)) {
                    rollout.reward -= coef * sum;
                }
            }
        }
        let config = AdvantageConfig {
            filter_zero_advantage: false,
            ..self.config.advantage.clone()
        };
        let again = compute_advantages(&penalised, &config);
        let by_turn: HashMap<(usize, usize, usize), f32> = again
            .texts
            .iter()
            .map(|t| ((kept[t.group], t.rollout, t.turn), t.advantage))
            .collect();
        for t in &mut adv.texts {
            if let Some(&a) = by_turn.get(&(t.group, t.rollout, t.turn)) {
                t.advantage = a;
            }
        }
        for (packing, at) in packings.iter_mut().zip(&places) {
            for (mb, at) in packing.micro_batches.iter_mut().zip(at) {
                for (slot, &(text, _)) in mb.loss_slots().into_iter().zip(at) {
                    mb.advantages[slot] = adv.texts[text].advantage;
                }
            }
        }
        stats.situations = crate::advantage::situation_summary(groups, adv);
        stats.parts.scoring += clock.lap()?;
        Ok(None)
    }
}
