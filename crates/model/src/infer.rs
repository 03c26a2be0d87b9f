//! [`InferenceModel`]: the no-gradient forward over a [`KvCache`], for prefill and ragged
//! batched decode in one call, with weight snapshots swapped in between steps.
//!
//! A step takes, for each sequence, the tokens it adds (a whole prompt, a resumed prompt plus
//! partial completion, or one sampled token). All new tokens of all sequences go through the
//! projections and the MLP as one `(N, hidden)` matrix — that is where batching pays, since the
//! weights are read once per step. Attention runs over each sequence's own cache, so sequences at
//! different positions mix freely: where the cache attends itself (the paged cache on the CPU,
//! [`KvCache::attend_new`]) every new token of the step goes in one call, each reading its own
//! sequence's keys in place; otherwise the one-token inputs together (batched decode attention
//! over gathered keys) and the prompt chunks in padded batches of similar lengths.

use std::sync::Arc;

use candle_core::{D, DType, Tensor};
use sluice_core::PolicyVersion;

use crate::cache::{KvCache, NewHeads, NewTokens, SeqId};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result, TensorContext};
use crate::layers::{
    DecoderWeights, Proj, Qkv, StackedLayer, linear_with, stacking_refused, stacks_by_default,
};
use crate::ops::{Kernels, Rope, apply_rope, rms_norm};
use crate::packed::PackedDecoder;
use crate::ragged::StepLayout;
use crate::snapshot::ModelWeights;
use gathered::{GatherStep, Gathered};
pub use graphs::{DECODE_GRAPH_BUCKETS, DecodeGraphStats};

mod gathered;
mod graphs;

/// The tokens one sequence adds in a step.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    /// The sequence (new sequences start at position 0).
    pub seq: SeqId,
    /// Its new tokens, at positions `cache.seq_len(seq)..`.
    pub tokens: &'a [u32],
}

impl<'a> StepInput<'a> {
    /// One input per row of `rows`, sequence `i` for row `i`: a batch numbered from 0.
    pub fn numbered<T: AsRef<[u32]>>(rows: &'a [T]) -> Vec<Self> {
        rows.iter()
            .zip(0..)
            .map(|(row, seq)| StepInput {
                seq,
                tokens: row.as_ref(),
            })
            .collect()
    }
}

/// Which logits a step returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// One row per input: the logits after its last new token (what sampling needs).
    Last,
    /// One row per new token, inputs in order (prompt log-probabilities, `echo`).
    All,
}

/// Inference weights plus the rotary table; the cache is passed into each step.
#[derive(Debug)]
pub struct InferenceModel {
    config: Arc<ModelConfig>,
    snapshot: Arc<ModelWeights>,
    weights: DecoderWeights,
    /// The projections packed for bf16 products ([`Self::set_compute_dtype`]), repacked at
    /// every weight swap; `None`: products in the weights' own dtype.
    packed: Option<PackedDecoder>,
    /// Whether the products are stacked where they can be ([`Self::set_stacked_products`]).
    stack: bool,
    /// Each layer's stacked projections; empty when not stacking or when `packed` is set.
    stacked: Vec<StackedLayer>,
    rope: Rope,
    /// Bumped whenever the products' weights are rebuilt (a swap, a dtype, stacking): a
    /// captured decode graph read the old ones.
    epoch: u64,
    /// Decode steps over fixed buffers, graphed on a GPU ([`Self::set_decode_graphs`]).
    graphs: Option<std::sync::Mutex<graphs::DecodeGraphs>>,
}

impl InferenceModel {
    /// A model reading `snapshot` (shared, not copied).
    pub fn new(snapshot: Arc<ModelWeights>) -> Result<Self> {
        let config = Arc::clone(snapshot.config());
        let weights = DecoderWeights::build(&config, |n| snapshot.require(n).cloned())?;
        let rope = Rope::new(&config);
        let stack = stacks_by_default(snapshot.device(), snapshot.dtype());
        let mut model = Self {
            config,
            snapshot,
            weights,
            packed: None,
            stack,
            stacked: Vec::new(),
            rope,
            epoch: 0,
            graphs: None,
        };
        model.restack()?;
        Ok(model)
    }

    /// Whether a step takes one product for q, k and v and one for gate and up, with the
    /// weights stacked, each residual add computing the norm after it, or one product per
    /// projection. Stacking keeps a copy of those weights (most of a layer) and rebuilds it at
    /// every swap; on by default on a GPU, where each product is a launch. The bf16 tiles
    /// ([`Self::set_compute_dtype`]) already take a layer's products in one pass and ignore it.
    pub fn set_stacked_products(&mut self, on: bool) -> Result<()> {
        if on && let Some(reason) = stacking_refused(self.snapshot.device(), self.snapshot.dtype())
        {
            return Err(ModelError::input(reason));
        }
        self.stack = on;
        self.restack()
    }

    /// Rebuilds the stacked projections from the current weights, or drops them.
    fn restack(&mut self) -> Result<()> {
        self.epoch += 1;
        // Dropped first: never kept stale, and never alive next to the new copy.
        self.stacked = Vec::new();
        self.stacked = if self.stack && self.packed.is_none() {
            let c = &*self.config;
            self.weights
                .layers
                .iter()
                .map(|l| StackedLayer::new(l, c))
                .collect::<candle_core::Result<_>>()
                .ctx("stacking the projections")?
        } else {
            Vec::new()
        };
        Ok(())
    }

    /// The dtype of the step's matrix products: bf16 (operands rounded to bf16, sums in f32,
    /// every activation f32) or the weights' own dtype. bf16 on the CPU needs f32 weights and
    /// Intel AMX tiles, and is refused with the reason otherwise; the weights are packed now and
    /// repacked in place at every [`Self::swap_weights`] (`sluice bench kernels` times it).
    pub fn set_compute_dtype(&mut self, dtype: DType) -> Result<()> {
        self.packed = match dtype {
            DType::BF16 if self.weights.embed.dtype() != DType::BF16 => {
                if let Some(refused) = crate::packed::refusal(&self.weights) {
                    return Err(refused);
                }
                Some(PackedDecoder::pack(&self.weights)?)
            }
            d if d == self.weights.embed.dtype() => None,
            d => {
                return Err(ModelError::input(format!(
                    "compute dtype {d:?} for weights in {:?}: the products run in the weights' dtype or in bf16",
                    self.weights.embed.dtype()
                )));
            }
        };
        self.restack()
    }

    /// The dtype of the step's matrix products ([`Self::set_compute_dtype`]).
    pub fn compute_dtype(&self) -> DType {
        if self.packed.is_some() {
            DType::BF16
        } else {
            self.weights.embed.dtype()
        }
    }

    /// Switches to `snapshot` (same architecture and shapes required). The caches stay valid:
    /// keys and values computed with the old weights are kept, as `in_flight` updates want.
    pub fn swap_weights(&mut self, snapshot: Arc<ModelWeights>) -> Result<()> {
        if **snapshot.config() != *self.config {
            return Err(ModelError::input(format!(
                "weight snapshot {} has a different config from the running model",
                snapshot.version
            )));
        }
        if snapshot.dtype() != self.snapshot.dtype() {
            return Err(ModelError::input(format!(
                "weight snapshot {} is {:?}, the running model {:?}",
                snapshot.version,
                snapshot.dtype(),
                self.snapshot.dtype()
            )));
        }
        // A snapshot published on another device (a trainer on its own GPU, or on the CPU)
        // is copied to this model's; one already here is shared as it is.
        let snapshot = snapshot.on_device(self.snapshot.device())?;
        let weights = DecoderWeights::build(&self.config, |n| snapshot.require(n).cloned())?;
        if let Some(packed) = &mut self.packed {
            packed.repack(&weights)?;
        }
        // Once this thread lets go of the old weights, another may hold their last reference
        // and free them on its own stream (the trainer, replacing what it published): this
        // thread's reads of them finish first.
        crate::device::settle(self.snapshot.device())?;
        self.weights = weights;
        self.snapshot = snapshot;
        if let Err(e) = self.restack() {
            // The new weights are in and a step reads them either way: without the stacked
            // copies it takes one product per projection. Stacking is tried again next swap.
            tracing::warn!(error = %e, version = %self.snapshot.version,
                "stacking the swapped weights failed; one product per projection until the next swap");
        }
        Ok(())
    }

    /// The policy version of the current weights.
    pub fn version(&self) -> PolicyVersion {
        self.snapshot.version
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> &Arc<ModelWeights> {
        &self.snapshot
    }

    /// The architecture.
    pub fn config(&self) -> &Arc<ModelConfig> {
        &self.config
    }

    /// Runs the new tokens of `inputs` through the model, appending their keys and values to
    /// `cache`, and returns f32 logits `(rows, vocab)` per `wanted`. Each sequence may appear
    /// at most once per step.
    pub fn step(
        &self,
        cache: &mut dyn KvCache,
        inputs: &[StepInput<'_>],
        wanted: LogitsWanted,
    ) -> Result<Tensor> {
        let past = self.check_inputs(cache, inputs)?;
        for input in inputs {
            cache.begin_step(input.seq, input.tokens, self.version())?;
        }
        let device = self.weights.embed.device().clone();
        let dtype = self.weights.embed.dtype();
        // One-token inputs first, then prompt chunks longest first (see `StepLayout`).
        let layout = StepLayout::new(inputs);
        let lens: Vec<usize> = inputs.iter().map(|i| i.tokens.len()).collect();
        let caller = inputs;
        let inputs: Vec<StepInput<'_>> = layout.order.iter().map(|&i| caller[i]).collect();
        let past: Vec<usize> = layout.order.iter().map(|&i| past[i]).collect();
        let n: usize = lens.iter().sum();
        let ids: Vec<u32> = inputs
            .iter()
            .flat_map(|i| i.tokens.iter().copied())
            .collect();
        let positions: Vec<u32> = inputs
            .iter()
            .zip(&past)
            .flat_map(|(i, &p)| (p..p + i.tokens.len()).map(|x| x as u32))
            .collect();
        let ids = Tensor::new(ids.as_slice(), &device).ctx("input ids")?;
        let x = self.weights.embed.index_select(&ids, 0).ctx("embedding")?;
        // (1, N, d/2): the fused rope kernel takes per-position tables.
        let (cos, sin) = self
            .rope
            .cos_sin(&positions, (1, n), dtype, &device)
            .ctx("rotary tables")?;
        let (cos, sin) = (cos.squeeze(0).ctx("rope")?, sin.squeeze(0).ctx("rope")?);
        let step_seqs: Vec<SeqId> = inputs.iter().map(|i| i.seq).collect();
        let step_news: Vec<usize> = inputs.iter().map(|i| i.tokens.len()).collect();
        let scale = self.attention_scale();
        // Built on first use: a cache that attends itself never needs them.
        let gathered = Gathered::default();
        let mut attend = |li: usize, heads: NewHeads<'_>| -> Result<Tensor> {
            let new = NewTokens {
                seqs: &step_seqs,
                news: &step_news,
                heads,
            };
            match cache.attend_new(new, li, scale)? {
                Some(att) => Ok(att),
                None => {
                    let step = GatherStep {
                        layout: &layout,
                        inputs: &inputs,
                        past: &past,
                        built: &gathered,
                    };
                    self.attend_gathered(cache, step, li, new)
                }
            }
        };
        let mut x = self.layers(x, (&cos, &sin), &mut attend)?;
        // The logits' rows in the caller's order.
        if let Some(rows) = layout.logit_rows(&lens, wanted) {
            let count = rows.len();
            let idx = Tensor::from_vec(rows, count, &device).ctx("logit rows")?;
            x = x.index_select(&idx, 0).ctx("logit rows")?;
        }
        self.logits(&x)
    }

    /// `1 / sqrt(head_dim)`.
    fn attention_scale(&self) -> f64 {
        1.0 / (self.config.head_dim as f64).sqrt()
    }

    /// The final norm and the lm head over the hidden rows `x`: f32 logits `(rows, vocab)`.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps;
        let x = rms_norm(x, &self.weights.final_norm, eps, Kernels::Fused).ctx("final norm")?;
        match &self.packed {
            Some(packed) => packed.lm_head(&x),
            None => linear_with(&x, &self.weights.lm_head, None, Kernels::Fused),
        }
        .and_then(|l| l.to_dtype(DType::F32))
        .ctx("lm head")
    }

    /// Every layer over the step's hidden rows `x (N, hidden)`, each row rotated by its angles
    /// (`cos`, `sin`: `(N, head_dim/2)`); `attend` gives a layer's attention over the cache for
    /// the rows' heads, `(N, heads · head_dim)`.
    fn layers(
        &self,
        mut x: Tensor,
        (cos, sin): (&Tensor, &Tensor),
        attend: &mut dyn FnMut(usize, NewHeads<'_>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let c = &*self.config;
        let kernels = Kernels::Fused;
        // (N, heads, d) rotated in place of its rows: on the CPU and on a GPU the fused kernel
        // works on the token rows, with no transposed copy either way (one launch where the
        // composition took three).
        let rope_rows = |t: &Tensor| {
            let (n, heads, d) = t.dims3()?;
            if crate::fused::supported(t) || crate::fused::on_device(t) {
                crate::fused::rope(&t.reshape((n, heads * d))?, cos, sin, d)?.reshape((n, heads, d))
            } else {
                let heads = t.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
                apply_rope(&heads, cos, sin, kernels)?
                    .squeeze(0)?
                    .transpose(0, 1)?
                    .contiguous()
            }
        };
        // A stacked layer's input norm, computed with the previous layer's residual add.
        let mut normed: Option<Tensor> = None;
        for (li, layer) in self.weights.layers.iter().enumerate() {
            let context = format!("inference step, layer {li}");
            // The layer's products: the bf16 tiles where packed, its own weights otherwise. A
            // stacked q/k/v product goes to the attention as it is: a cache that attends itself
            // splits and rotates it as it reads (on a GPU, in the attention's launch).
            let stacked = self.stacked.get(li);
            let stacked_rows = match stacked {
                Some(s) => s.qkv_rows(layer, &x, normed.take(), c).ctx(&context)?,
                None => None,
            };
            let split;
            let heads = match &stacked_rows {
                Some((qkv, bias)) => NewHeads::Stacked {
                    qkv,
                    bias: *bias,
                    cos,
                    sin,
                    geometry: (c.num_heads, c.num_kv_heads, c.head_dim),
                },
                None => {
                    let qkv = match &self.packed {
                        Some(packed) => packed
                            .qkv(li, layer, &x, c.rms_norm_eps)
                            .and_then(|qkv| layer.heads(qkv, c, kernels)),
                        None => layer.qkv(&x, c, kernels),
                    }
                    .ctx(&context)?;
                    split = Qkv {
                        q: rope_rows(&qkv.q).ctx(&context)?,
                        k: rope_rows(&qkv.k).ctx(&context)?,
                        v: qkv.v,
                    };
                    NewHeads::Split {
                        q: &split.q,
                        k: &split.k,
                        v: &split.v,
                    }
                }
            };
            let att = attend(li, heads)?;
            let o = match &self.packed {
                Some(packed) => packed.project(li, &att, Proj::O, None),
                None => layer.project(&att, Proj::O, kernels),
            };
            let o = o.ctx(&context)?;
            if let Some(s) = stacked {
                // The next layer's input norm with this one's last add, where it will be used.
                let next = (self.stacked.get(li + 1))
                    .filter(|n| n.stacks_qkv())
                    .map(|_| &self.weights.layers[li + 1].input_norm);
                let eps = c.rms_norm_eps;
                (x, normed) = s.residual_mlp(layer, &x, &o, next, eps).ctx(&context)?;
                continue;
            }
            x = (&x + o).ctx(&context)?;
            x = match &self.packed {
                Some(packed) => packed
                    .mlp(li, layer, &x, c.rms_norm_eps)
                    .and_then(|y| &x + y),
                None => layer.mlp_block(&x, c.rms_norm_eps, kernels),
            }
            .ctx(&context)?;
        }
        Ok(x)
    }

    /// Past lengths of each input, after checking tokens, duplicates and the context limit.
    fn check_inputs(&self, cache: &dyn KvCache, inputs: &[StepInput<'_>]) -> Result<Vec<usize>> {
        if inputs.is_empty() {
            return Err(ModelError::input("a step needs at least one sequence"));
        }
        let mut seen = std::collections::HashSet::new();
        let mut past = Vec::with_capacity(inputs.len());
        for input in inputs {
            if !seen.insert(input.seq) {
                return Err(ModelError::input(format!(
                    "sequence {} appears twice in one step",
                    input.seq
                )));
            }
            if input.tokens.is_empty() {
                return Err(ModelError::input(format!(
                    "sequence {} adds no token",
                    input.seq
                )));
            }
            if let Some(bad) = input
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.config.vocab_size)
            {
                return Err(ModelError::input(format!(
                    "sequence {}: token {bad} is outside the vocabulary ({})",
                    input.seq, self.config.vocab_size
                )));
            }
            let p = cache.seq_len(input.seq);
            if p + input.tokens.len() > self.config.max_position_embeddings {
                return Err(ModelError::input(format!(
                    "sequence {} would reach {} tokens, max_position_embeddings is {}",
                    input.seq,
                    p + input.tokens.len(),
                    self.config.max_position_embeddings
                )));
            }
            past.push(p);
        }
        Ok(past)
    }
}

/// Index of the largest logit per row of `(rows, vocab)` logits (greedy decoding).
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    logits
        .argmax(D::Minus1)
        .and_then(|t| t.to_vec1::<u32>())
        .ctx("argmax")
}
