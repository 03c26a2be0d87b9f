//! [`InferenceModel`]: the no-gradient forward over a [`KvCache`], for prefill and ragged
//! batched decode in one call, with weight snapshots swapped in between steps.
//!
//! A step takes, for each sequence, the tokens it adds (a whole prompt, a resumed prompt plus
//! partial completion, or one sampled token). All new tokens of all sequences go through the
//! projections and the MLP as one `(N, hidden)` matrix — that is where batching pays, since the
//! weights are read once per step. Attention runs per sequence against its own cache, so
//! sequences at different positions mix freely.

use std::sync::Arc;

use candle_core::{D, DType, Tensor};
use sluice_core::PolicyVersion;

use crate::cache::{KvCache, SeqId};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result, TensorContext};
use crate::layers::{DecoderWeights, linear_with};
use crate::ops::{Kernels, Rope, apply_rope, rms_norm, softmax_last_dim};
use crate::snapshot::ModelWeights;

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
    rope: Rope,
}

impl InferenceModel {
    /// A model reading `snapshot` (shared, not copied).
    pub fn new(snapshot: Arc<ModelWeights>) -> Result<Self> {
        let config = Arc::clone(snapshot.config());
        let weights = DecoderWeights::build(&config, |n| snapshot.require(n).cloned())?;
        let rope = Rope::new(&config);
        Ok(Self {
            config,
            snapshot,
            weights,
            rope,
        })
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
        self.weights = DecoderWeights::build(&self.config, |n| snapshot.require(n).cloned())?;
        self.snapshot = snapshot;
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
        let c = &*self.config;
        let past = self.check_inputs(cache, inputs)?;
        for input in inputs {
            cache.begin_step(input.seq, input.tokens, self.version())?;
        }
        let n: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        let device = self.weights.embed.device().clone();
        let dtype = self.weights.embed.dtype();
        let kernels = Kernels::Fused;
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
        let mut x = self.weights.embed.index_select(&ids, 0).ctx("embedding")?;
        // (1, N, d/2): the fused rope kernel takes per-position tables.
        let (cos, sin) = self
            .rope
            .cos_sin(&positions, (1, n), dtype, &device)
            .ctx("rotary tables")?;
        let (cos, sin) = (cos.squeeze(0).ctx("rope")?, sin.squeeze(0).ctx("rope")?);
        // A step of one new token per sequence (the steady state of continuous batching) runs
        // attention for all sequences at once; anything else goes sequence by sequence.
        let seqs: Vec<SeqId> = inputs.iter().map(|i| i.seq).collect();
        let decode = inputs.iter().all(|i| i.tokens.len() == 1);
        // Built on first use: a cache with its own decode kernel never needs it.
        let mask = std::cell::OnceCell::new();
        // (N, heads, d) → (heads, N, d), rotated, for attention sequence by sequence.
        let rope_heads = |t: &Tensor| {
            let heads = t.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
            apply_rope(&heads, &cos, &sin, kernels)?.squeeze(0)
        };
        // (N, heads, d) rotated in place of its rows: on the CPU the fused kernel works on the
        // token rows, with no transposed copy either way.
        let rope_rows = |t: &Tensor| {
            let (n, heads, d) = t.dims3()?;
            if crate::fused::supported(t) {
                crate::fused::rope(&t.reshape((n, heads * d))?, &cos, &sin, d)?
                    .reshape((n, heads, d))
            } else {
                rope_heads(t)?.transpose(0, 1)?.contiguous()
            }
        };
        for (li, layer) in self.weights.layers.iter().enumerate() {
            let context = format!("inference step, layer {li}");
            let qkv = layer.qkv(&x, c, kernels).ctx(&context)?;
            if decode {
                let heads = DecodeHeads {
                    seqs: &seqs,
                    layer: li,
                    q: &rope_rows(&qkv.q).ctx(&context)?,
                    k: &rope_rows(&qkv.k).ctx(&context)?,
                    v: &qkv.v,
                    mask: || {
                        if let Some(m) = mask.get() {
                            return Ok(Tensor::clone(m));
                        }
                        let m = decode_mask(&past, dtype, &device).ctx("decode mask")?;
                        Ok(mask.get_or_init(|| m).clone())
                    },
                };
                let att = self.attend_decode(cache, heads)?;
                x = (&x + linear_with(&att, &layer.o_proj, None, kernels).ctx(&context)?)
                    .ctx(&context)?;
                x = layer.mlp_block(&x, c.rms_norm_eps, kernels).ctx(&context)?;
                continue;
            }
            let q = rope_heads(&qkv.q).ctx(&context)?;
            let k = rope_heads(&qkv.k).ctx(&context)?;
            let v = qkv.v.transpose(0, 1).ctx(&context)?;
            let mut outs = Vec::with_capacity(inputs.len());
            let mut start = 0;
            for (input, &p) in inputs.iter().zip(&past) {
                let len = input.tokens.len();
                let take = |t: &Tensor| t.narrow(1, start, len)?.contiguous();
                let (k_all, v_all) = cache.append(
                    input.seq,
                    li,
                    &take(&k).ctx(&context)?,
                    &take(&v).ctx(&context)?,
                )?;
                let q_i = take(&q).ctx(&context)?;
                outs.push(
                    self.attend(&q_i, &k_all, &v_all, p, kernels)
                        .ctx(&context)?,
                );
                start += len;
            }
            // (heads, N, d) → (N, heads·d)
            let att = Tensor::cat(&outs, 1)
                .and_then(|a| a.transpose(0, 1)?.reshape((n, c.num_heads * c.head_dim)))
                .ctx(&context)?;
            x = (&x + linear_with(&att, &layer.o_proj, None, kernels).ctx(&context)?)
                .ctx(&context)?;
            x = layer.mlp_block(&x, c.rms_norm_eps, kernels).ctx(&context)?;
        }
        let x = match wanted {
            LogitsWanted::All => x,
            LogitsWanted::Last => {
                let mut last = Vec::with_capacity(inputs.len());
                let mut end = 0;
                for input in inputs {
                    end += input.tokens.len();
                    last.push((end - 1) as u32);
                }
                let idx = Tensor::new(last.as_slice(), &device).ctx("last rows")?;
                x.index_select(&idx, 0).ctx("last rows")?
            }
        };
        let x =
            rms_norm(&x, &self.weights.final_norm, c.rms_norm_eps, kernels).ctx("final norm")?;
        linear_with(&x, &self.weights.lm_head, None, Kernels::Fused)
            .and_then(|l| l.to_dtype(DType::F32))
            .ctx("lm head")
    }

    /// Attention of one sequence's new queries `(heads, n, d)` over its cached keys/values
    /// `(kv_heads, past + n, d)`; returns `(heads, n, d)`.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        past: usize,
        kernels: Kernels,
    ) -> candle_core::Result<Tensor> {
        let c = &*self.config;
        let (n, d, g) = (q.dim(1)?, c.head_dim, c.kv_groups());
        let total = k.dim(1)?;
        let scale = 1.0 / (d as f64).sqrt();
        // Group the query heads of each kv head as extra rows: no copy of k/v per head.
        let q = q.reshape((c.num_kv_heads, g * n, d))?;
        let mut scores = (q.matmul(&k.t()?)? * scale)?;
        if n > 1 {
            // New token i (position past + i) sees cache slots 0..=past + i.
            let mask: Vec<f32> = (0..n)
                .flat_map(|i| {
                    (0..total).map(move |j| {
                        if j <= past + i {
                            0.0
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                })
                .collect();
            let mask = Tensor::from_vec(mask, (1, 1, n, total), q.device())?.to_dtype(q.dtype())?;
            scores = scores
                .reshape((c.num_kv_heads, g, n, total))?
                .broadcast_add(&mask)?
                .reshape((c.num_kv_heads, g * n, total))?;
        }
        let att = softmax_last_dim(&scores, kernels)?.matmul(v)?;
        att.reshape((c.num_heads, n, d))
    }

    /// Attention of one new token per sequence, all sequences batched: `q` `(B, heads, d)` and
    /// `k` `(B, kv_heads, d)` after RoPE, `v` `(B, kv_heads, d)`; returns `(B, heads·d)`.
    /// (Fields of [`DecodeHeads`].)
    fn attend_decode<M>(&self, cache: &mut dyn KvCache, heads: DecodeHeads<'_, M>) -> Result<Tensor>
    where
        M: Fn() -> Result<Tensor>,
    {
        let DecodeHeads {
            seqs,
            layer,
            q,
            k,
            v,
            mask,
        } = heads;
        let c = &*self.config;
        let (b, d, g) = (seqs.len(), c.head_dim, c.kv_groups());
        let run = |t: candle_core::Result<Tensor>| t.ctx("batched decode attention");
        let v = v.contiguous().ctx("v")?;
        let scale = 1.0 / (d as f64).sqrt();
        // The cache's own kernel when it has one (the paged pool on the CPU: no gathered copy).
        if let Some(att) = cache.attend_decode(seqs, layer, q, k, &v, scale)? {
            return Ok(att);
        }
        let (k_all, v_all) = cache.append_decode(seqs, layer, k, &v)?;
        let mask = mask()?;
        run((|| {
            // (B, kv, g, d) @ (B, kv, d, T) → (B, kv, g, T), masked per sequence length.
            let q = q.reshape((b, c.num_kv_heads, g, d))?;
            let scores = (q.matmul(&k_all.transpose(2, 3)?)? * scale)?.broadcast_add(&mask)?;
            let att = softmax_last_dim(&scores, Kernels::Fused)?.matmul(&v_all)?;
            att.reshape((b, c.num_heads * d))
        })())
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

/// One layer's inputs to batched decode attention.
struct DecodeHeads<'a, M> {
    seqs: &'a [SeqId],
    layer: usize,
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    /// The step's [`decode_mask`], for caches without a decode kernel of their own.
    mask: M,
}

/// `(B, 1, 1, T)` additive mask for a decode step: the new token of sequence `b` (at position
/// `past[b]`) sees slots `0..=past[b]`; `T = max(past) + 1`.
fn decode_mask(
    past: &[usize],
    dtype: DType,
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let t = past.iter().max().map_or(1, |p| p + 1);
    let mask: Vec<f32> = past
        .iter()
        .flat_map(|&p| (0..t).map(move |j| if j <= p { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (past.len(), 1, 1, t), device)?.to_dtype(dtype)
}
