//! The step's attention where the cache does not attend itself: keys and values gathered from
//! it, decoding sequences batched under one mask and prompt chunks in padded batches.

use candle_core::{DType, Tensor};

use super::{InferenceModel, StepInput};
use crate::cache::{KvCache, NewTokens, SeqId};
use crate::error::{Result, TensorContext};
use crate::ops::{Kernels, softmax_last_dim};
use crate::ragged::{PrefillBatch, StepLayout};

impl InferenceModel {
    /// Attention of a batch of prompt chunks: queries `q` `(rows, heads, d)` after RoPE, the
    /// batch's keys and values `(B, kv_heads, T, d)` from the cache; returns `(rows, heads·d)`.
    fn attend_prompts(
        &self,
        batch: &PrefillBatch,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        kernels: Kernels,
    ) -> candle_core::Result<Tensor> {
        let c = &*self.config;
        let (b, l, t) = (batch.seqs.len(), batch.longest_new, batch.longest_total);
        let (kv, g, d) = (c.num_kv_heads, c.kv_groups(), c.head_dim);
        let scale = 1.0 / (d as f64).sqrt();
        let q = match &batch.pad {
            Some(pad) => q.index_select(pad, 0)?,
            None => q.clone(),
        };
        // Group the query heads of each kv head as extra rows: no copy of k/v per head.
        let q = q
            .reshape((b, l, kv, g, d))?
            .permute((0, 2, 3, 1, 4))?
            .contiguous()?
            .reshape((b, kv, g * l, d))?;
        let scores = (q.matmul(&k.t()?)? * scale)?
            .reshape((b, kv, g, l, t))?
            .broadcast_add(&batch.mask)?
            .reshape((b, kv, g * l, t))?;
        let att = softmax_last_dim(&scores, kernels)?
            .matmul(v)?
            .reshape((b, c.num_heads, l, d))?
            .transpose(1, 2)?
            .reshape((b * l, c.num_heads * d))?;
        match &batch.unpad {
            Some(unpad) => att.index_select(unpad, 0),
            None => Ok(att),
        }
    }

    /// The step's attention over keys and values gathered from a cache that computes none
    /// itself: decoding sequences (the first `layout.decoding` inputs) batched under the step's
    /// [`decode_mask`], prompt chunks in padded batches (both built at the first layer).
    /// Returns `(Σ news, heads·d)` in the step's order.
    pub(super) fn attend_gathered(
        &self,
        cache: &mut dyn KvCache,
        step: GatherStep<'_>,
        layer: usize,
        new: NewTokens<'_>,
    ) -> Result<Tensor> {
        let context = format!("inference step, layer {layer}, attention");
        let (q, k, v) = new.heads.split().ctx(&context)?;
        let GatherStep {
            layout,
            inputs,
            past,
            built,
        } = step;
        let decoding = layout.decoding;
        let (dtype, device) = (self.weights.embed.dtype(), self.weights.embed.device());
        let rows = |t: &Tensor, start: usize, len: usize| t.narrow(0, start, len).ctx(&context);
        let batches = match built.batches.get() {
            Some(b) => b,
            None => {
                let b = layout
                    .prefill_batches(inputs, past, self.config.num_heads, (dtype, device))
                    .ctx("prompt attention batches")?;
                built.batches.get_or_init(|| b)
            }
        };
        let mut parts = Vec::with_capacity(1 + batches.len());
        if decoding > 0 {
            let mask = match built.mask.get() {
                Some(m) => m,
                None => {
                    let m = decode_mask(&past[..decoding], dtype, device).ctx("decode mask")?;
                    built.mask.get_or_init(|| m)
                }
            };
            let heads = DecodeHeads {
                seqs: &new.seqs[..decoding],
                layer,
                q: &rows(&q, 0, decoding)?,
                k: &rows(&k, 0, decoding)?,
                v: &rows(&v, 0, decoding)?,
                mask,
            };
            parts.push(self.attend_decode(cache, heads)?);
        }
        for batch in batches {
            let start = decoding + batch.first_row;
            let (q, k, v) = (
                rows(&q, start, batch.rows)?,
                rows(&k, start, batch.rows)?,
                rows(&v, start, batch.rows)?,
            );
            let (k_all, v_all) = cache.append_ragged(&batch.seqs, &batch.news, layer, &k, &v)?;
            parts.push(
                self.attend_prompts(batch, &q, &k_all, &v_all, Kernels::Fused)
                    .ctx(&context)?,
            );
        }
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        Tensor::cat(&parts, 0).ctx(&context)
    }

    /// Attention of one new token per sequence, all sequences batched over their gathered keys
    /// and values: `q` `(B, heads, d)` and `k` `(B, kv_heads, d)` after RoPE, `v` `(B,
    /// kv_heads, d)`; returns `(B, heads·d)`. (Fields of [`DecodeHeads`].)
    fn attend_decode(&self, cache: &mut dyn KvCache, heads: DecodeHeads<'_>) -> Result<Tensor> {
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
        let v = v.contiguous().ctx("v")?;
        let scale = 1.0 / (d as f64).sqrt();
        let (k_all, v_all) = cache.append_ragged(seqs, &vec![1; b], layer, k, &v)?;
        (|| {
            // (B, kv, g, d) @ (B, kv, d, T) → (B, kv, g, T), masked per sequence length.
            let q = q.reshape((b, c.num_kv_heads, g, d))?;
            let scores = (q.matmul(&k_all.transpose(2, 3)?)? * scale)?.broadcast_add(mask)?;
            let att = softmax_last_dim(&scores, Kernels::Fused)?.matmul(&v_all)?;
            att.reshape((b, c.num_heads * d))
        })()
        .ctx("batched decode attention")
    }
}

/// What the gathered attention path builds once per step, at its first layer.
#[derive(Default)]
pub(super) struct Gathered {
    /// The decoding sequences' [`decode_mask`].
    mask: std::cell::OnceCell<Tensor>,
    /// The prompt chunks' padded batches ([`StepLayout::prefill_batches`]).
    batches: std::cell::OnceCell<Vec<PrefillBatch>>,
}

/// The step as the gathered attention path needs it: its layout, its inputs and their past
/// lengths in the step's order, and what it has built so far.
#[derive(Clone, Copy)]
pub(super) struct GatherStep<'a> {
    pub(super) layout: &'a StepLayout,
    pub(super) inputs: &'a [StepInput<'a>],
    pub(super) past: &'a [usize],
    pub(super) built: &'a Gathered,
}

/// One layer's inputs to batched decode attention over gathered keys and values.
struct DecodeHeads<'a> {
    seqs: &'a [SeqId],
    layer: usize,
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    /// The step's [`decode_mask`].
    mask: &'a Tensor,
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
