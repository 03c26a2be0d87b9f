//! One optimizer update of the candle trainer: forward, loss and backward per micro-batch,
//! serial or data-parallel over the trainer's workers, then one AdamW step.

use candle_core::Tensor;
use candle_core::backprop::GradStore;
use sluice_model::{Activations, ForwardOptions};

use super::NativeTrainer;
use crate::batcher::{MicroBatch, Packing};
use crate::error::{TrainerError, tensor_ctx};
use crate::loss::{LossStats, TokenInputs};
use crate::optim::GradAccumulator;
use crate::report::{Mismatch, StepParts, StepStats};
use crate::steps::{packed, pick, slot_index};

/// Under mixed precision, `model`'s parameters converted to its compute dtype once for the
/// forwards that follow, until the optimizer changes them
/// ([`sluice_model::TrainableModel::set_step_weights`]): on a GPU by one launch, as the leaf
/// variables the forward reads, where each micro-batch's forward converted every parameter
/// (and its backward converted each gradient back). Nothing when they are there already or the
/// model computes in its parameters' dtype.
pub fn convert_weights(model: &mut sluice_model::TrainableModel) -> Result<(), TrainerError> {
    let params = model.step_weight_params();
    if params.is_empty() || model.has_step_weights() {
        return Ok(());
    }
    let dtype = model.compute_dtype();
    let vars = model.vars();
    let masters: Vec<&Tensor> = params.iter().map(|&i| vars[i].1.as_tensor()).collect();
    let context = tensor_ctx("step weights");
    let converted = match crate::adamw_kernel::step_copies(&masters, dtype) {
        Ok(Some(copies)) => copies,
        Ok(None) => masters
            .iter()
            .map(|t| t.to_dtype(dtype))
            .collect::<candle_core::Result<_>>()
            .map_err(context)?,
        Err(e) => return Err(context(e)),
    };
    model.set_step_weights(converted)?;
    Ok(())
}

/// [`StartPolicy`] for one micro-batch.
#[derive(Debug, Clone, Copy)]
enum MicroStart<'a> {
    Current,
    Proximal(&'a [f32]),
    Moved,
}

/// What training one worker's micro-batches added up to (beside the gradients).
#[derive(Debug, Default)]
struct MicroOut {
    loss: LossStats,
    lag_sum: u64,
    max_lag: u64,
    parts: StepParts,
    mismatch: Mismatch,
}

/// Where an update finds the log-probs of the policy the step started from (the weights that
/// generated its lag-0 tokens): the train/inference mismatch compares them with the engine's.
#[derive(Debug, Clone, Copy)]
pub(super) enum StartPolicy<'a> {
    /// The model still holds those weights (the step's first update): its own log-probs.
    Current,
    /// They were scored before the first update, per micro-batch (the proximal log-probs of
    /// `decoupled_ppo`'s later shares), and are the loss's proximal policy too.
    Proximal(&'a [Vec<f32>]),
    /// The model moved and nothing was scored at the start (a later share of another loss):
    /// nothing is compared.
    Moved,
}

impl NativeTrainer {
    /// One optimizer update on `packing`: forward and backward per micro-batch (log-probs at
    /// `temperature`, coefficients from `terms`, `start`'s proximal log-probs per micro-batch
    /// when the update is not the step's first), gradients accumulated, one AdamW step. Where
    /// `start` has the step's starting policy, its lag-0 tokens are compared with the engine's
    /// log-probs (`stats.mismatch`). Adds the loss,
    /// lag and optimizer figures to `stats` (packing figures: [`record_packing`]) and returns the
    /// summed version lag of the trained tokens.
    ///
    /// With several compute threads and several micro-batches, the micro-batches are trained
    /// data-parallel: worker `w` of `k`, on a single-thread pool of its own, takes micro-batches
    /// `w, w + k, …`, and their gradients are added in micro-batch order as they arrive (at most
    /// `k` wait their turn). Whole micro-batches per thread need no barrier inside an op (the
    /// fine-grained split of each product is what two threads lost to when an engine shared the
    /// cores), and the sums are the serial ones bit for bit. `stats.parts` then sums the workers'
    /// time (CPU seconds).
    pub(super) fn update(
        &mut self,
        packing: &Packing,
        start: StartPolicy<'_>,
        temperature: f64,
        stats: &mut StepStats,
        terms: impl Fn(&TokenInputs<'_>) -> Result<crate::loss::LossTerms, TrainerError> + Sync,
    ) -> Result<u64, TrainerError> {
        let options = ForwardOptions {
            logits_chunk_rows: self.config.logits_chunk_rows,
            temperature,
            kept_logits_bytes: self.config.kept_logits_bytes,
        };
        let micro: Vec<(usize, &MicroBatch)> = packing
            .micro_batches
            .iter()
            .enumerate()
            .filter(|(_, mb)| !mb.loss_slots().is_empty())
            .collect();
        let mut clock = self.part_clock();
        convert_weights(&mut self.model)?;
        stats.parts.forward += clock.lap()?;
        let trained = match &self.adapters {
            Some(a) => 2 * a.len(),
            None => self.model.vars().len(),
        };
        let mut grads = GradAccumulator::new(trained);
        let mut add = |(g, out): (Vec<(usize, Tensor)>, MicroOut)| -> Result<u64, TrainerError> {
            let mut clock = self.part_clock();
            grads.add_gradients(g)?;
            stats.parts.backward += clock.lap()?;
            stats.max_lag = stats.max_lag.max(out.max_lag);
            stats.loss.merge(&out.loss);
            stats.mismatch.merge(&out.mismatch);
            stats.parts.add(&out.parts);
            Ok(out.lag_sum)
        };
        let one =
            |m: usize, mb: &MicroBatch| -> Result<(Vec<(usize, Tensor)>, MicroOut), TrainerError> {
                let mut out = MicroOut::default();
                let start = match start {
                    StartPolicy::Current => MicroStart::Current,
                    StartPolicy::Proximal(p) => MicroStart::Proximal(p[m].as_slice()),
                    StartPolicy::Moved => MicroStart::Moved,
                };
                let store = self.micro_step(mb, start, options, &terms, &mut out)?;
                let mut clock = self.part_clock();
                let mut g = self.model.parameter_gradients(&store);
                if let Some(a) = &self.adapters {
                    g = a.gradients(&store, g)?;
                }
                out.parts.backward += clock.lap()?;
                Ok((g, out))
            };
        let mut lag_sum = 0;
        if self.workers.len() > 1 && micro.len() > 1 {
            let k = self.workers.len().min(micro.len());
            let (tx, rx) = std::sync::mpsc::sync_channel(k);
            std::thread::scope(|scope| -> Result<(), TrainerError> {
                for (w, pool) in self.workers.iter().take(k).enumerate() {
                    let (tx, micro, one) = (tx.clone(), &micro, &one);
                    scope.spawn(move || {
                        pool.install(|| {
                            for (i, &(m, mb)) in micro.iter().enumerate().skip(w).step_by(k) {
                                // A closed channel: the update failed elsewhere; stop.
                                if tx.send((i, one(m, mb))).is_err() {
                                    break;
                                }
                            }
                        });
                    });
                }
                drop(tx);
                let mut waiting = std::collections::BTreeMap::new();
                let mut next = 0;
                for (i, result) in rx {
                    waiting.insert(i, result);
                    while let Some(result) = waiting.remove(&next) {
                        lag_sum += add(result?)?;
                        next += 1;
                    }
                }
                Ok(())
            })?;
        } else {
            for &(m, mb) in &micro {
                lag_sum += add(one(m, mb)?)?;
            }
        }
        // A NaN or infinite loss would move every weight to NaN (the gradient norm catches
        // what the loss does not): refused before the optimizer touches anything.
        if !stats.loss.loss.is_finite() {
            return Err(TrainerError::NonFinite {
                what: "loss",
                value: stats.loss.loss,
            });
        }
        // The masters are about to change: the forward converts them afresh next time.
        self.model.clear_step_weights();
        let mut clock = self.part_clock();
        stats.optim = Some(self.optim.step(&grads)?);
        if let Some(a) = &mut self.adapters {
            a.merge(&self.model)?;
        }
        stats.parts.optimizer += clock.lap()?;
        Ok(lag_sum)
    }

    /// `f` of every micro-batch, in order: on the data-parallel workers when there are several
    /// (worker `w` of `k` takes micro-batches `w, w + k, …` on its single-thread pool), else on
    /// the current pool. The first error stops the workers and is returned.
    pub(super) fn each_micro_batch<R: Send>(
        &self,
        micro: &[MicroBatch],
        f: impl Fn(&MicroBatch) -> Result<R, TrainerError> + Sync,
    ) -> Result<Vec<R>, TrainerError> {
        if self.workers.len() <= 1 || micro.len() <= 1 {
            return micro.iter().map(f).collect();
        }
        let k = self.workers.len().min(micro.len());
        let mut done: Vec<Option<R>> = std::iter::repeat_with(|| None).take(micro.len()).collect();
        let failed = std::sync::atomic::AtomicBool::new(false);
        let results: Vec<Result<Vec<(usize, R)>, TrainerError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .workers
                .iter()
                .take(k)
                .enumerate()
                .map(|(w, pool)| {
                    let (f, failed) = (&f, &failed);
                    scope.spawn(move || {
                        pool.install(|| {
                            let mut mine = Vec::new();
                            for (i, mb) in micro.iter().enumerate().skip(w).step_by(k) {
                                if failed.load(std::sync::atomic::Ordering::Relaxed) {
                                    break;
                                }
                                match f(mb) {
                                    Ok(r) => mine.push((i, r)),
                                    Err(e) => {
                                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                                        return Err(e);
                                    }
                                }
                            }
                            Ok(mine)
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
        for part in results {
            for (i, r) in part? {
                done[i] = Some(r);
            }
        }
        done.into_iter()
            .map(|r| r.ok_or_else(|| TrainerError::Input("a micro-batch was not run".into())))
            .collect()
    }

    /// Forward, loss and backward of one micro-batch; returns its gradients and adds its
    /// figures to `out`.
    fn micro_step(
        &self,
        mb: &MicroBatch,
        start: MicroStart<'_>,
        options: ForwardOptions,
        terms: &(impl Fn(&TokenInputs<'_>) -> Result<crate::loss::LossTerms, TrainerError> + Sync),
        out: &mut MicroOut,
    ) -> Result<GradStore, TrainerError> {
        let mut clock = self.part_clock();
        let slots = mb.loss_slots();
        for &i in &slots {
            let lag = self.version.0.saturating_sub(mb.versions[i]);
            out.lag_sum += lag;
            out.max_lag = out.max_lag.max(lag);
        }
        let batch = packed(mb);
        let activations = if self.config.activation_checkpointing {
            Activations::Recomputed
        } else {
            Activations::Kept
        };
        let (scores, saved) = self
            .model
            .token_scores_for_backward(&batch, options, activations)?;
        out.parts.forward += clock.lap()?;
        let device = self.model.device().clone();
        let index = slot_index(&slots, &device)?;
        let (logprobs, lp_host) = pick(&scores.logprobs, &index, "log-probs")?;
        let (entropy_t, entropy) = pick(&scores.entropy, &index, "entropies")?;
        out.parts.loss += clock.lap()?;
        // No gradient is taken of the reference: no logits to keep for one.
        let no_grad = ForwardOptions {
            kept_logits_bytes: 0,
            ..options
        };
        // The loss's KL penalty (`kl_coef`); a reference kept for `kl_in_reward` alone scores
        // nothing here.
        let reference = match self
            .reference
            .as_ref()
            .filter(|_| self.config.loss.kl_coef > 0.0)
        {
            Some(r) => Some(
                pick(
                    &r.token_scores_recomputable(&batch, no_grad)?
                        .0
                        .logprobs
                        .detach(),
                    &index,
                    "reference log-probs",
                )?
                .1,
            ),
            None => None,
        };
        out.parts.scoring += clock.lap()?;
        let gather = |v: &[f32]| slots.iter().map(|&i| v[i]).collect::<Vec<f32>>();
        let (behaviour, advantages, weights) = (
            gather(&mb.behaviour),
            gather(&mb.advantages),
            gather(&mb.weights),
        );
        let sequence: Vec<u32> = slots.iter().map(|&i| mb.text_ids[i]).collect();
        let proximal = match start {
            MicroStart::Proximal(p) => Some(p),
            MicroStart::Current | MicroStart::Moved => None,
        };
        let at_start = match start {
            MicroStart::Current => Some(lp_host.as_slice()),
            MicroStart::Proximal(p) => Some(p),
            MicroStart::Moved => None,
        };
        if let Some(start_lp) = at_start {
            // Lag 0: generated by exactly the weights `start_lp` was scored with.
            for (k, &i) in slots.iter().enumerate() {
                if mb.versions[i] == self.version.0 {
                    out.mismatch.add(start_lp[k], behaviour[k]);
                }
            }
        }
        let inputs = TokenInputs {
            logprobs: &lp_host,
            behaviour: &behaviour,
            proximal,
            advantages: &advantages,
            weights: &weights,
            sequence: &sequence,
            reference: reference.as_deref(),
            entropy: Some(&entropy),
        };
        let t = terms(&inputs)?;
        out.loss.merge(&t.stats);
        // `Σ c_t · lp_t`, and `Σ e_t · H_t` with the entropy bonus on.
        let weighted = |column: Tensor, c: &[f32], what: &'static str| {
            Tensor::new(c, &device)
                .and_then(|c| c.to_dtype(column.dtype()))
                .and_then(|c| column * c)
                .and_then(|s| s.sum_all())
                .map_err(tensor_ctx(what))
        };
        let mut surrogate = weighted(logprobs, &t.coefficients, "surrogate loss")?;
        if !t.entropy_coefficients.is_empty() {
            let bonus = weighted(entropy_t, &t.entropy_coefficients, "entropy bonus")?;
            surrogate = (surrogate + bonus).map_err(tensor_ctx("entropy bonus"))?;
        }
        out.parts.loss += clock.lap()?;
        let store = self.model.backward_saved(&surrogate, saved)?;
        out.parts.backward += clock.lap()?;
        Ok(store)
    }
}
