//! The compute thread: the native [`Stepper`] under the shared scheduler core ([`crate::sched`]:
//! queues, aborts, pause, weight updates): one ragged model step at a time, sampling, finishing.
//! Admission by free KV blocks, prefix reuse and preemption are in [`admission`]; the prompt
//! log-probabilities a prefill yields in [`prompt_lps`].

mod admission;
mod device_draw;
mod prompt_lps;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::Receiver;
use sluice_core::{PolicyVersion, RequestId, WeightUpdateMode};
use sluice_model::{
    InferenceModel, KvCache, LogitsWanted, ModelWeights, PagedKvCache, StepInput, Tokenizer,
};

use super::sampler::{log_softmax, splitmix, top_n};
use super::stop::{StopHit, StopRule};
use super::{
    Command, KvBudget, NativeEngineParams, NativeError, NativeRequest, PromptLogprob,
    RequestObserver, RequestUpdate, Shared, TokenStep,
};
use crate::backend::{
    Completion, EngineEvent, EventSink, FinishReason, SamplingParams, TokenOutput, push_token,
};
use crate::sched::{Queued, Queues, Scheduler, Stepper};
use device_draw::Outcome;
use prompt_lps::{PromptChunk, collect_prompt_logprobs};

/// One request inside the engine.
pub(crate) struct Seq {
    id: RequestId,
    /// Its key in the KV cache (unique for the engine's life).
    cache_id: u64,
    prompt_len: usize,
    /// Prompt plus resumed tokens, as submitted (a sequence preempted before it generated
    /// anything starts over from them).
    input: Vec<u32>,
    /// Completion tokens it came with (resumed), so `output.len() - resumed_len` were made here.
    resumed_len: usize,
    /// Its first KV block's tokens, when the input fills more than one block: requests with the
    /// same head wait a step while another computes it, then share it.
    head: Vec<u32>,
    /// Tokens not yet in the cache: the prompt (+ resumed tokens) at first, then the last
    /// sampled token.
    pending: Vec<u32>,
    output: TokenOutput,
    params: SamplingParams,
    seed: u64,
    stop: StopRule,
    top_logprobs: usize,
    /// Prompt log-probabilities gathered so far (`Some` when asked for).
    prompt_lps: Option<Vec<PromptLogprob>>,
    observer: Option<RequestObserver>,
}

impl Queued for Seq {
    fn request_id(&self) -> RequestId {
        self.id
    }
}

pub(crate) struct Worker {
    params: NativeEngineParams,
    model: InferenceModel,
    cache: PagedKvCache,
    /// Context of one sequence: the model's, or the pool's when that is smaller.
    context: usize,
    tokenizer: Option<Arc<Tokenizer>>,
    rx: Receiver<Command>,
    sink: EventSink,
    shared: Arc<Shared>,
    next_cache_id: u64,
}

impl Worker {
    pub(crate) fn new(
        params: NativeEngineParams,
        model: InferenceModel,
        kv: KvBudget,
        tokenizer: Option<Arc<Tokenizer>>,
        rx: Receiver<Command>,
        sink: EventSink,
        shared: Arc<Shared>,
    ) -> Result<Self, NativeError> {
        let snapshot = model.snapshot();
        let mut cache = PagedKvCache::new(
            model.config(),
            snapshot.dtype(),
            snapshot.device(),
            kv.blocks,
            kv.block_tokens,
        )?;
        cache.set_version_lag(params.prefix_cache_version_lag);
        let context = model.config().max_position_embeddings.min(kv.tokens());
        Ok(Self {
            params,
            model,
            cache,
            context,
            tokenizer,
            rx,
            sink,
            shared,
            next_cache_id: 0,
        })
    }

    pub(crate) fn run(mut self) {
        let rx = self.rx.clone();
        Scheduler::new().run(&mut self, &rx);
    }

    fn enqueue(&mut self, req: NativeRequest) -> Option<Seq> {
        let NativeRequest {
            request,
            stop,
            ignore_eos,
            top_logprobs,
            prompt_logprobs,
            observer,
        } = req;
        let output = request.resume.unwrap_or_default();
        let mut pending = request.prompt_token_ids;
        let prompt_len = pending.len();
        pending.extend_from_slice(&output.token_ids);
        let block = self.cache.block_tokens();
        let head = if pending.len() > block {
            pending[..block].to_vec()
        } else {
            Vec::new()
        };
        let seed = request.params.seed.unwrap_or_else(|| {
            let id = &request.id;
            let r = &id.rollout;
            [
                r.group.run.0,
                u64::from(r.group.node.0),
                r.group.counter,
                u64::from(r.index),
            ]
            .into_iter()
            .chain([u64::from(id.turn)])
            .fold(splitmix(self.params.seed), |h, x| splitmix(h ^ x))
        });
        let rule = StopRule::new(
            &self.params.eos_token_ids,
            ignore_eos,
            &request.params.stop_token_ids,
            &stop,
        );
        let seq = Seq {
            id: request.id,
            cache_id: self.next_cache_id,
            prompt_len,
            input: pending.clone(),
            resumed_len: output.len(),
            head,
            pending,
            output,
            params: request.params,
            seed,
            stop: rule,
            top_logprobs: top_logprobs as usize,
            prompt_lps: prompt_logprobs.then(Vec::new),
            observer,
        };
        self.next_cache_id += 1;
        let context = self.model.config().max_position_embeddings;
        if seq.prompt_len >= context {
            self.finish_with(seq, FinishReason::Error("prompt_too_long".into()), None);
            None
        } else if seq.pending.len() >= context {
            // Prompt plus resumed tokens fill the context: nothing more can be generated.
            self.finish_with(seq, FinishReason::Length, None);
            None
        } else {
            Some(seq)
        }
    }

    /// One engine step over the running batch, as plan → run → apply (the shape of vLLM's
    /// scheduler output): which tokens go in, the model over them, then sampling for every
    /// sequence whose pending tokens all went in.
    fn step_batch(&mut self, q: &mut Queues<Seq>) {
        let started = Instant::now();
        let (mut take, decode_only) = self.plan_step(q);
        self.make_room(q, &mut take);
        if q.running.is_empty() {
            return;
        }
        let rows = self.run_model(q, &mut take);
        let generated = self.apply_step(q, &take, &rows);
        self.shared.steps.fetch_add(1, Ordering::Relaxed);
        let nanos = started.elapsed().as_nanos() as u64;
        self.shared.busy_nanos.fetch_add(nanos, Ordering::Relaxed);
        if decode_only {
            self.shared.decode_nanos.fetch_add(nanos, Ordering::Relaxed);
            self.shared
                .decode_tokens
                .fetch_add(generated, Ordering::Relaxed);
        }
    }

    /// Plan: how many pending tokens of each running sequence go into this step. Decoding
    /// sequences first (one token each, never starved), then prompt chunks in admission order
    /// within what is left of `max_step_tokens`. Returns the takes (0: not this step) and whether
    /// the step only decodes.
    fn plan_step(&self, q: &Queues<Seq>) -> (Vec<usize>, bool) {
        let decoding = q.running.iter().filter(|s| s.pending.len() == 1).count();
        let decode_only = decoding == q.running.len();
        let mut budget = self.params.max_step_tokens.max(decoding) - decoding;
        let mut take = vec![0usize; q.running.len()];
        for (i, s) in q.running.iter().enumerate() {
            if s.pending.len() == 1 {
                take[i] = 1;
            }
        }
        for (i, s) in q.running.iter().enumerate() {
            if s.pending.len() > 1 && budget > 0 {
                take[i] = s.pending.len().min(budget);
                budget -= take[i];
            }
        }
        (take, decode_only)
    }

    /// Run: the model over the planned tokens, one call for the sequences that need only their
    /// last row of logits and one for prefills reporting prompt log-probabilities (every row).
    /// Returns what each running sequence got: its rows, or (on a GPU, when every sequence of
    /// the call allows it) the token drawn on the device. A failed call fails its sequences
    /// (removed, with their takes).
    fn run_model(&mut self, q: &mut Queues<Seq>, take: &mut Vec<usize>) -> Vec<Option<Outcome>> {
        let wants_all = |s: &Seq| s.prompt_lps.is_some() && s.pending.len() > 1;
        let mut rows: Vec<Option<Outcome>> = (0..q.running.len()).map(|_| None).collect();
        for all in [false, true] {
            let picked: Vec<usize> = (0..q.running.len())
                .filter(|&i| take[i] > 0 && wants_all(&q.running[i]) == all)
                .collect();
            if picked.is_empty() {
                continue;
            }
            let inputs: Vec<StepInput<'_>> = picked
                .iter()
                .map(|&i| StepInput {
                    seq: q.running[i].cache_id,
                    tokens: &q.running[i].pending[..take[i]],
                })
                .collect();
            let wanted = if all {
                LogitsWanted::All
            } else {
                LogitsWanted::Last
            };
            let on_device = !all
                && picked
                    .iter()
                    .all(|&i| device_draw::qualifies(&q.running[i]));
            let model_started = Instant::now();
            let stepped = self.model.step_paged(&mut self.cache, &inputs, wanted);
            self.shared
                .issue_nanos
                .fetch_add(model_started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if let Some(graphs) = self.model.decode_graph_stats() {
                (self.shared.graph_replays).store(graphs.replays, Ordering::Relaxed);
            }
            let result = stepped.and_then(|t| {
                let seqs = picked.iter().map(|&i| &q.running[i]);
                if on_device && let Some(drawn) = device_draw::draw(&t, seqs) {
                    return drawn.map(|d| d.into_iter().map(Outcome::Drawn).collect());
                }
                let logits =
                    t.to_vec2::<f32>()
                        .map_err(|error| sluice_model::ModelError::Tensor {
                            context: "logits to host".into(),
                            error,
                        })?;
                let mut it = logits.into_iter();
                Ok(picked
                    .iter()
                    .map(|&i| {
                        let n = if all { take[i] } else { 1 };
                        Outcome::Rows(it.by_ref().take(n).collect())
                    })
                    .collect::<Vec<_>>())
            });
            self.shared
                .model_nanos
                .fetch_add(model_started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match result {
                Ok(outcomes) => {
                    for (&i, outcome) in picked.iter().zip(outcomes) {
                        rows[i] = Some(outcome);
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "engine step failed; failing its sequences");
                    for &i in &picked {
                        take[i] = 0;
                        rows[i] = None;
                    }
                    let mut failed: Vec<usize> = picked;
                    failed.sort_unstable();
                    for i in failed.into_iter().rev() {
                        let s = q.running.remove(i);
                        take.remove(i);
                        rows.remove(i);
                        self.finish_with(s, FinishReason::Error("engine_step".into()), None);
                    }
                }
            }
        }
        rows
    }

    /// Apply: the rows' outcomes — prompt log-probabilities and prefill progress, one draw for
    /// every sequence whose pending tokens all went in, stops and lengths — and the finished
    /// sequences reported. Returns the tokens generated.
    fn apply_step(&mut self, q: &mut Queues<Seq>, take: &[usize], rows: &[Option<Outcome>]) -> u64 {
        let version = self.model.version();
        let context = self.context;
        let mut done: Vec<(usize, FinishReason, Option<StopHit>)> = Vec::new();
        let mut generated = 0u64;
        // Prompt log-probabilities and prefill progress; which sequences draw a token.
        let mut drawing: Vec<usize> = Vec::new();
        for (i, s) in q.running.iter_mut().enumerate() {
            let Some(outcome) = rows[i].as_ref() else {
                continue;
            };
            let drawn_on_device = matches!(outcome, Outcome::Drawn(_));
            let rows = outcome.rows();
            let fed: Vec<u32> = s.pending.drain(..take[i]).collect();
            if let Some(lps) = &mut s.prompt_lps
                && rows.len() == fed.len()
            {
                let next = s.pending.first().copied();
                let chunk = PromptChunk {
                    fed: &fed,
                    next,
                    rows,
                };
                collect_prompt_logprobs(s.prompt_len, lps, &chunk, &s.params, s.top_logprobs);
                if lps.len() >= s.prompt_len
                    && let Some(obs) = &s.observer
                {
                    obs(RequestUpdate::PromptLogprobs(std::mem::take(lps)));
                    s.prompt_lps = None;
                }
            }
            if !s.pending.is_empty() || (rows.is_empty() && !drawn_on_device) {
                continue; // still in prefill
            }
            if s.output.len() >= s.params.max_tokens as usize {
                // max_tokens 0 (echo only) or a resumed request already at its length.
                done.push((i, FinishReason::Length, None));
                continue;
            }
            drawing.push(i);
        }
        let picks = device_draw::picks(&q.running, &drawing, rows);
        for (&i, pick) in drawing.iter().zip(picks) {
            let s = &mut q.running[i];
            push_token(&mut s.output, pick.token, pick.logprob, version);
            generated += 1;
            if let Some(obs) = &s.observer {
                let top = if s.top_logprobs > 0 {
                    let last = Outcome::last_row(rows, i);
                    top_n(&log_softmax(last, s.params.temperature), s.top_logprobs)
                } else {
                    Vec::new()
                };
                obs(RequestUpdate::Token(TokenStep {
                    token: pick.token,
                    logprob: pick.logprob,
                    version,
                    top,
                }));
            }
            if let Some(hit) = s.stop.check(&s.output.token_ids, self.tokenizer.as_deref()) {
                done.push((i, FinishReason::Stop, Some(hit)));
            } else if s.output.len() >= s.params.max_tokens as usize
                || s.prompt_len + s.output.len() >= context
            {
                done.push((i, FinishReason::Length, None));
            } else {
                s.pending.push(pick.token);
            }
        }
        // Removed from the highest index down.
        done.sort_unstable_by_key(|d| d.0);
        self.shared
            .generated_tokens
            .fetch_add(generated, Ordering::Relaxed);
        for (i, reason, hit) in done.into_iter().rev() {
            let s = q.running.remove(i);
            self.finish_with(s, reason, hit);
        }
        generated
    }

    fn finish_with(&mut self, s: Seq, finish: FinishReason, stop: Option<StopHit>) {
        self.cache.remove(s.cache_id);
        let completion = Completion {
            id: s.id,
            output: s.output,
            finish,
        };
        if let Some(obs) = &s.observer {
            obs(RequestUpdate::Finished {
                completion: completion.clone(),
                stop,
            });
        }
        (self.sink)(EngineEvent::Finished(completion));
    }

    fn publish_gauges(&self, q: &Queues<Seq>) {
        self.shared
            .kv_used_blocks
            .store(self.cache.blocks_in_use() as u64, Ordering::Relaxed);
        self.shared
            .kv_cached_blocks
            .store(self.cache.cached_blocks() as u64, Ordering::Relaxed);
        self.shared
            .running
            .store(q.running.len() as u64, Ordering::Relaxed);
        self.shared
            .waiting
            .store(q.waiting.len() as u64, Ordering::Relaxed);
    }
}

impl Stepper for Worker {
    type Request = Box<NativeRequest>;
    type Seq = Seq;
    type Weights = Arc<ModelWeights>;

    fn accept(&mut self, request: Box<NativeRequest>) -> Option<Seq> {
        self.enqueue(*request)
    }

    fn finish(&mut self, seq: Seq, finish: FinishReason) {
        self.finish_with(seq, finish, None);
    }

    fn install(
        &mut self,
        weights: Arc<ModelWeights>,
        mode: WeightUpdateMode,
    ) -> Option<PolicyVersion> {
        let version = weights.version;
        if let Err(e) = self.model.swap_weights(weights) {
            // Checked against the config in `update_weights`; a dtype clash lands here.
            tracing::error!(error = %e, %version, "weight swap refused; keeping the old weights");
            return None;
        }
        // Only `in_flight` lets a request's keys and values span versions.
        self.cache
            .set_version_lag(if mode == WeightUpdateMode::InFlight {
                self.params.prefix_cache_version_lag
            } else {
                0
            });
        self.shared.version.store(version.0, Ordering::Relaxed);
        Some(version)
    }

    fn admit(&mut self, queues: &mut Queues<Seq>) {
        self.admit_by_blocks(queues);
    }

    fn step(&mut self, queues: &mut Queues<Seq>) {
        // The replica owns its threads: they poll for the step's many short parallel
        // sections instead of being woken for each (see `keep_awake`).
        let _awake = sluice_model::threads::keep_awake();
        self.step_batch(queues);
    }

    fn report(&mut self, event: EngineEvent) {
        (self.sink)(event);
    }

    fn publish(&mut self, queues: &Queues<Seq>) {
        self.publish_gauges(queues);
    }
}
