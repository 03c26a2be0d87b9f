//! A decoder layer's backward written by hand, for the fused ops ([`crate::fused`]).
//!
//! candle's `backward()` walks the graph and, for every edge, zero-fills a gradient buffer the
//! size of the edge's input and adds the edge's gradient into it: for a layer at `[8, 2048]` on
//! Qwen2.5-0.5B's shapes that is about 0.9 GB of buffers written zero, then read twice and
//! written again, before any product. Here the layer's forward runs without a graph, keeping
//! what its backward reads (a [`LayerTape`]), and [`LayerTape::backward`] calls each fused op's
//! backward in reverse order: a gradient that reaches a tensor once is passed on as it is, and
//! one that reaches it from several consumers (the normed input from q, k and v; the residual
//! stream from its norm and its skip) is summed with one add per extra consumer.
//!
//! The same ops and the same products as the graph's backward, in the same dtypes; only the
//! order of some additions differs (equal within rounding; `crates/model/tests/gradients.rs`).

use std::sync::Arc;

use candle_core::{Result, Tensor};

use crate::config::ModelConfig;
use crate::fused::{
    AttentionHeads, KeptAttention, Segments, attention_kept, linear, linear_grads,
    linear_input_grad, rms_norm, rms_norm_grads, rope, rope_grad, swiglu, swiglu_grads,
};
use crate::layers::{LayerWeights, Proj};
use crate::low_rank::LowRank;

/// What one layer's backward reads, kept by [`LayerTape::forward`]: every op's inputs (its
/// output too where the backward reads it), none of them part of a graph.
pub(crate) struct LayerTape {
    /// The layer's input, the residual stream.
    x: Tensor,
    /// `x` through the input norm: the q/k/v projections' input.
    h: Tensor,
    /// The q and k projections before their norms, where the architecture has the norms.
    pre_norm: [Option<Tensor>; 2],
    /// The attention's inputs (q and k rotated) and output.
    qkv: [Tensor; 3],
    att: Tensor,
    attention: KeptAttention,
    /// The residual stream after the attention block, its norm, and the MLP's activations.
    x2: Tensor,
    h2: Tensor,
    gate: Tensor,
    up: Tensor,
    act: Tensor,
}

/// What a layer's forward reads besides its weights and input.
pub(crate) struct LayerContext<'a> {
    pub config: &'a ModelConfig,
    /// The rotary tables, `(B·L, head_dim/2)` in the compute dtype.
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub segments: &'a Arc<Segments>,
}

impl LayerContext<'_> {
    fn heads(&self) -> AttentionHeads {
        AttentionHeads {
            heads: self.config.num_heads,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        }
    }
}

impl LayerTape {
    /// The layer's output for input `x` and weights `w`, and the tape of its backward. The
    /// same ops as the graph's forward (`TrainableModel::layer`); `x` and `w` are read
    /// detached, so no graph is built.
    pub(crate) fn forward(
        w: &LayerWeights,
        x: &Tensor,
        cx: &LayerContext<'_>,
    ) -> Result<(Tensor, Self)> {
        let (eps, head_dim) = (cx.config.rms_norm_eps, cx.config.head_dim);
        let x = x.detach();
        let h = rms_norm(&x, &w.input_norm.detach(), eps)?;
        let project = |t: &Tensor, w: &Tensor, b: Option<&Tensor>| {
            linear(t, &w.detach(), b.map(|b| b.detach()).as_ref())
        };
        let q = project(&h, &w.q_proj, w.q_bias.as_ref())?;
        let k = project(&h, &w.k_proj, w.k_bias.as_ref())?;
        let v = project(&h, &w.v_proj, w.v_bias.as_ref())?;
        let norm = |t: Tensor, w: &Option<Tensor>| -> Result<(Tensor, Option<Tensor>)> {
            match w {
                Some(w) => Ok((rms_norm(&t, &w.detach(), eps)?, Some(t))),
                None => Ok((t, None)),
            }
        };
        let (q, q_pre) = norm(q, &w.q_norm)?;
        let (k, k_pre) = norm(k, &w.k_norm)?;
        // Contiguous as the kept attention takes them (already so: a no-op then).
        let q = rope(&q, cx.cos, cx.sin, head_dim)?.contiguous()?;
        let k = rope(&k, cx.cos, cx.sin, head_dim)?.contiguous()?;
        let v = v.contiguous()?;
        let (att, attention) = attention_kept(&q, &k, &v, cx.segments, cx.heads())?;
        let x2 = (&x + project(&att, &w.o_proj, None)?)?;
        let h2 = rms_norm(&x2, &w.post_norm.detach(), eps)?;
        let gate = project(&h2, &w.gate_proj, None)?;
        let up = project(&h2, &w.up_proj, None)?;
        let act = swiglu(&gate, &up)?;
        let out = (&x2 + project(&act, &w.down_proj, None)?)?;
        let tape = Self {
            x,
            h,
            pre_norm: [q_pre, k_pre],
            qkv: [q, k, v],
            att,
            attention,
            x2,
            h2,
            gate,
            up,
            act,
        };
        Ok((out, tape))
    }

    /// The gradient of the layer's input for the gradient `d_out` of its output, and the
    /// gradients the layer gives its trained tensors, each with the tensor it belongs to:
    /// without `adapters`, each of its weights `w` (the ones the forward read); with them
    /// (LoRA, [`crate::low_rank`]), each adapted projection's `A` and `B`, and no weight's.
    pub(crate) fn backward(
        self,
        w: &LayerWeights,
        d_out: &Tensor,
        cx: &LayerContext<'_>,
        adapters: Option<&[Option<LowRank>; 7]>,
    ) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let (eps, head_dim) = (cx.config.rms_norm_eps, cx.config.head_dim);
        let mut g = Filed {
            w,
            adapters,
            grads: Vec::new(),
        };
        // The MLP block: out = x2 + down(swiglu(gate(h2), up(h2))), h2 = post_norm(x2).
        let d_act = g.projection(Proj::Down, &self.act, d_out)?;
        drop(self.act);
        let (d_gate, d_up) = swiglu_grads(&self.gate, &self.up, &d_act)?;
        drop(d_act);
        let d_h2 = g.projection(Proj::Gate, &self.h2, &d_gate)?;
        let d_h2 = (d_h2 + g.projection(Proj::Up, &self.h2, &d_up)?)?;
        let (d_x2, d_post_norm) = rms_norm_grads(&self.x2, &w.post_norm, eps, &d_h2)?;
        g.norm(&w.post_norm, d_post_norm);
        let d_x2 = (d_x2 + d_out)?;
        // The attention block: x2 = x + o(attention(rope(q), rope(k), v)).
        let d_att = g.projection(Proj::O, &self.att, &d_x2)?;
        let [q, k, v] = &self.qkv;
        let [d_q, d_k, d_v] = self.attention.grads([q, k, v], &self.att, &d_att)?;
        drop(d_att);
        let d_q = rope_grad(&d_q, cx.cos, cx.sin, head_dim)?;
        let d_k = rope_grad(&d_k, cx.cos, cx.sin, head_dim)?;
        let [q_pre, k_pre] = &self.pre_norm;
        let mut unnorm = |d: Tensor, pre: &Option<Tensor>, w: &Option<Tensor>| match (pre, w) {
            (Some(pre), Some(w)) => {
                let (d, dw) = rms_norm_grads(pre, w, eps, &d)?;
                g.norm(w, dw);
                Ok::<_, candle_core::Error>(d)
            }
            _ => Ok(d),
        };
        let d_q = unnorm(d_q, q_pre, &w.q_norm)?;
        let d_k = unnorm(d_k, k_pre, &w.k_norm)?;
        let d_h = g.projection(Proj::Q, &self.h, &d_q)?;
        let d_h = (d_h + g.projection(Proj::K, &self.h, &d_k)?)?;
        let d_h = (d_h + g.projection(Proj::V, &self.h, &d_v)?)?;
        let (d_x, d_input_norm) = rms_norm_grads(&self.x, &w.input_norm, eps, &d_h)?;
        g.norm(&w.input_norm, d_input_norm);
        let d_x = (d_x + d_x2)?;
        Ok((d_x, g.grads))
    }
}

/// The gradients a layer's backward files, each with the tensor it belongs to.
struct Filed<'a> {
    w: &'a LayerWeights,
    adapters: Option<&'a [Option<LowRank>; 7]>,
    grads: Vec<(Tensor, Tensor)>,
}

impl Filed<'_> {
    /// Projection `p`'s input gradient for its input `x` and output gradient `d`; files its
    /// weight's and bias's gradients, or with adapters its `A`'s and `B`'s where it has them.
    fn projection(&mut self, p: Proj, x: &Tensor, d: &Tensor) -> Result<Tensor> {
        let (w, b) = (self.w.weight(p), self.w.bias(p));
        let Some(adapters) = self.adapters else {
            let (dx, dw, db) = linear_grads(x, w, b, d)?;
            self.grads.push((w.clone(), dw));
            if let (Some(b), Some(db)) = (b, db) {
                self.grads.push((b.clone(), db));
            }
            return Ok(dx);
        };
        let dx = linear_input_grad(x, w, d)?;
        if let Some(lr) = &adapters[p as usize] {
            let (da, db) = lr.grads(x, d)?;
            self.grads.push((lr.a.clone(), da));
            self.grads.push((lr.b.clone(), db));
        }
        Ok(dx)
    }

    /// Files a norm's weight gradient (frozen with adapters).
    fn norm(&mut self, w: &Tensor, dw: Tensor) {
        if self.adapters.is_none() {
            self.grads.push((w.clone(), dw));
        }
    }
}
